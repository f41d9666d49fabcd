"""The engine's C++ CPU kernels (``csrc/*.cpp``, compiled as one unit: ``csrc/kernels.cpp`` includes them), built
once per machine with ``torch.utils.cpp_extension``.

``native()`` is their operator namespace, ``torch.ops.hybridkv``, or None where they cannot be built (no C++
compiler or ninja, a failed build: said once on stderr). Each file registers its kernels with
``TORCH_LIBRARY_FRAGMENT`` and includes ATen's core headers only, so no Python binding is compiled
(``torch/extension.h`` made the build 97 s of a busy machine, the core headers 8 s). Every kernel has a pure-torch
path beside it, taken for None, for other devices and dtypes, and inside ``fast_paths(native_kernels=False)``: the
kernels only change the cost (each one's module says how its result relates to the torch path's).

Invariants:
- One build per source version and CPU: torch caches it under its extensions directory (``TORCH_EXTENSIONS_DIR``,
  else ``~/.cache/torch_extensions``); the name carries the CPU model, since the code is compiled for this CPU's
  instruction set (``-march=native``), and a hash of the sources and flags, so checkouts of different versions on
  one machine (worktrees) each keep their build instead of rebuilding over each other's under one name. ``make
  setup`` builds it (``scripts/setup.sh``); otherwise the first call does (seconds), and the server's warm-up makes
  that call.
- Concurrent first calls (several processes) build once: cpp_extension holds a lock file while building.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import Any

from hybridkv.engine.cpuinfo import cpu_field

SOURCES = ("kernels.cpp",)
"""What is compiled: one translation unit that includes every kernel's file (ATen's headers parsed once)."""
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fno-trapping-math"]
"""``-fopenmp`` joins them (``flags()``) where torch runs its threads on OpenMP (Linux builds): without it
``at::parallel_for`` compiles to one serial call, and every kernel ran on one thread whatever
``torch.set_num_threads`` said (the OpenMP runtime is torch's, already loaded: nothing more is linked).
``-fno-trapping-math``: the exp's rounding and float -> int conversion vectorise (no value changes: floating-point
exceptions are only not assumed to trap). A flag, not a per-file ``#pragma GCC optimize``: GCC does not inline a
function into one of other optimisation options, so the shared helpers would stay calls and their loops scalar."""


def flags() -> list[str]:
    """The compiler's flags here: ``FLAGS``, and ``-fopenmp`` where torch's threads are OpenMP's on Linux."""
    import torch

    threads = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    return [*FLAGS, *threads]


def _cpu_model() -> str:
    import platform

    return cpu_field("model name") or platform.processor() or platform.machine()


@functools.cache
def native() -> Any | None:
    """``torch.ops.hybridkv`` once the kernels are loaded (built on first call, then from torch's cache), or None if
    they cannot be built."""
    import torch
    from torch.utils import cpp_extension

    here = Path(__file__).parent / "csrc"
    cpu = hashlib.sha1(_cpu_model().encode()).hexdigest()[:8]
    version = hashlib.sha1(" ".join(flags()).encode())
    for source in sorted(here.iterdir()):  # every file the unit includes
        version.update(source.name.encode() + source.read_bytes())
    try:
        cpp_extension.load(
            name=f"hybridkv_cpu_kernels_{cpu}_{version.hexdigest()[:8]}",
            sources=[str(here / s) for s in SOURCES],
            extra_cflags=flags(),
            is_python_module=False,  # loaded as a library: its TORCH_LIBRARY fragments register the operators
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler / ninja, or the build failed
        print(f"hybridkv: C++ CPU kernels unavailable, using the torch paths ({exc})".splitlines()[0], file=sys.stderr)
        return None
    return torch.ops.hybridkv
