"""Test and demo tooling for the transfer layer: not part of the product.

- ``pattern``: a byte pattern in global (layer, tensor, page, offset) coordinates and the
  arena a decode rank must end with;
- ``harness``: prefill ranks in child processes (``stage_worker``), decode ranks in this one;
- ``transports``: transport wrappers that change one behaviour (slow, lossy) for fault tests;
- ``pd_demo``: the multi-process prefill->decode demo behind ``hybridkv pd-demo``;
- ``tiny_tokenizer``: a real ``transformers`` word tokenizer for the tiny random models, saved beside one
  (``save_tiny_model``) for text clients (evaluation harnesses, chat tests).

Invariant: this package may import ``hybridkv.transfer`` (and everything below it); no
product package imports this one.
"""
