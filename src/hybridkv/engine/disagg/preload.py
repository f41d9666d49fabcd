"""What the engine forkserver imports once, before it forks any worker (``parallel.forkserver.PRELOAD``).

The worker modules (torch, the models, the transfer layer), the ``transformers`` config
classes of every architecture the engine serves (``read_config`` parses ``config.json`` with
them) and ``torch._dynamo`` (building a model on the meta device imports it at the first random
fill of a parameter: 1.5 s in every worker otherwise): each worker of a launch or a restart
starts with them imported. Importing them starts no thread (the forkserver must stay
single-threaded to fork safely: ``parallel.forkserver.forkserver_threads``).
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401  (imported for the workers: see above)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import hybridkv.engine.disagg.decode_worker
import hybridkv.engine.disagg.prefill_worker
from hybridkv.engine.registry import architectures, model_class

for _model_type in architectures():
    model_class(_model_type)  # imports the engine's model module
for _model_type in [*architectures(), "gemma3"]:  # gemma3: the multimodal wrapper of gemma3_text
    CONFIG_MAPPING[_model_type]  # the lookup imports the config module

__all__ = ["hybridkv"]
