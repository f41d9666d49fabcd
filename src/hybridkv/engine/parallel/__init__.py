"""Tensor- and pipeline-parallel serving: process groups, a launcher, and the per-rank runner.

``ShardRunner`` is one process's part of a ``Parallel`` layout (a PP stage, a TP rank):
model shard + ``UnifiedMemory`` + step function. ``StageGroups`` holds the layout's
``torch.distributed`` groups; ``launch`` starts and always reaps the processes.

In each process of a world (``launch(fn, world_size, args)`` calls ``fn(rank, *args)`` after
joining it)::

    groups = StageGroups.create(Parallel(tp_size=2, pp_size=2), ranks=(0, 1, 2, 3))  # every process calls it
    runner = ShardRunner(model_dir, model_dir, groups.parallel, groups.pp_rank, groups.tp_rank, groups,
                         gpu_memory="1GiB", page_size=16)
    alloc = RequestAllocator(runner.mem)    # each rank: its own memory, the same schedule
    logits = runner.forward(batch)          # (R, vocab), identical on every rank
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
