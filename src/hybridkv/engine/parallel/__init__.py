"""Tensor- and pipeline-parallel serving: process groups, a launcher, and the per-rank runner.

``ShardRunner`` is one process's part of a ``Parallel`` layout (a PP stage, a TP rank):
model shard + ``UnifiedMemory`` + step function. ``StageGroups`` holds the layout's
``torch.distributed`` groups; ``launch`` starts and always reaps the processes.
"""

from hybridkv.engine.parallel.groups import StageGroups, backend_for, init_world
from hybridkv.engine.parallel.launch import LaunchError, LaunchTimeout, free_port, launch
from hybridkv.engine.parallel.runner import ShardRunner, check_memory

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "ShardRunner",
    "StageGroups",
    "backend_for",
    "check_memory",
    "free_port",
    "init_world",
    "launch",
]
