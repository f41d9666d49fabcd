"""hybridkv inside SGLang 0.5.23: the radix-cache backend ``hybridkv`` (``--radix-cache-backend hybridkv``).

- ``plugin.py``: ``register``, the ``sglang.srt.plugins`` entry point, and ``build_tree_cache``,
  the factory SGLang's ``create_tree_cache`` calls.
- ``radix_cache.py``: ``HybridKVRadixCache``, SGLang's ``BasePrefixCache`` contract answered by
  hybridkv's ``HybridRadixCache`` (full attention, sliding window, Mamba state), SGLang's
  allocators keeping the bytes.
- ``allocator.py``: ``HybridKVTokenToKVPoolAllocator``, SGLang's full-attention token-to-KV allocator
  over a ``UnifiedMemory``'s pages, and its opt-in hook (``HYBRIDKV_SGLANG_ALLOCATOR=1``).
- ``idmap.py``: SGLang's token locations and Mamba slots paired with the shadow ids the tree
  holds (no SGLang import).

Only ``radix_cache.py``, ``allocator.py`` and ``plugin.py`` import SGLang, on first use; nothing in hybridkv imports
this package. See ``docs/sglang.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.integrations.sglang.radix_cache import HybridKVRadixCache, HybridKVSGLangError

__all__ = ["HybridKVRadixCache", "HybridKVSGLangError", "build_tree_cache", "register"]


def __getattr__(name: str) -> Any:
    if name in ("register", "build_tree_cache"):
        from hybridkv.integrations.sglang import plugin

        return getattr(plugin, name)
    if name in ("HybridKVRadixCache", "HybridKVSGLangError"):
        from hybridkv.integrations.sglang import radix_cache

        return getattr(radix_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
