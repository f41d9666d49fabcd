"""Recurrent-layer math of the reference engine, as pure PyTorch functions.

Each op comes as a pair: a chunked *prefill* of a batch of new-token chunks that continue
each request's carried state (returning the new state), and a one-token *decode* step.
States are plain tensors here; the layers read them from and write them to the memory's
state slots. Batches of unequal chunks are right-padded with a ``lengths`` vector
(``varlen``), never looped over in Python.
"""

from hybridkv.engine.ops.conv import causal_conv1d_decode, causal_conv1d_prefill
from hybridkv.engine.ops.gated_delta import gated_delta_decode, gated_delta_prefill
from hybridkv.engine.ops.kda import kda_decode, kda_prefill
from hybridkv.engine.ops.ssd import ssd_decode, ssd_prefill
from hybridkv.engine.ops.varlen import length_mask

__all__ = [
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "gated_delta_decode",
    "gated_delta_prefill",
    "kda_decode",
    "kda_prefill",
    "length_mask",
    "ssd_decode",
    "ssd_prefill",
]
