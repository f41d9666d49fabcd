"""Tensor- and pipeline-parallel serving: process groups and a launcher.

``StageGroups`` holds a ``Parallel`` layout's ``torch.distributed`` groups; ``launch`` starts and always
reaps the processes. Each process runs its part of the layout (a PP stage, a TP rank) with
``engine.runner.build_runner``: model shard + ``UnifiedMemory`` + step function.

In each process of a world (``launch(fn, world_size, args)`` calls ``fn(rank, *args)`` after
joining it)::

    groups = StageGroups.create(Parallel(tp_size=2, pp_size=2), ranks=(0, 1, 2, 3))  # every process calls it
    options = EngineConfig(gpu_memory="1GiB", page_size=16)
    runner = build_runner(model_dir, model_dir, options, groups.parallel, groups.pp_rank, groups.tp_rank, groups)
    kv = RequestKV(runner.mem)              # each rank: its own memory, the same schedule
    logits = runner.forward(batch)          # (R, vocab), identical on every rank
"""

from hybridkv.engine.parallel.groups import StageGroups, backend_for, init_world
from hybridkv.engine.parallel.launch import LaunchError, LaunchTimeout, free_port, launch

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "StageGroups",
    "backend_for",
    "free_port",
    "init_world",
    "launch",
]
