"""The SGLang plugin: the entry point that registers the radix-cache backend ``"hybridkv"``.

SGLang 0.5.23 loads general plugins from the entry-point group ``sglang.srt.plugins``
(``sglang.srt.plugins.load_plugins``, called early in every process) and runs each one's
function once; ``register`` is that function (``pyproject.toml`` declares it). It registers
``build_tree_cache`` with ``register_radix_cache_backend("hybridkv", ...)``, so that
``--radix-cache-backend hybridkv`` makes ``create_tree_cache`` call it. With
``HYBRIDKV_SGLANG_ALLOCATOR=1`` it also registers the token-to-KV allocator hook (``allocator.py``:
full attention, hybridkv's ``UnifiedMemory`` as the free list); off by default.

Invariants: registering twice in one process is a no-op (SGLang's registry refuses a second
registration of a name; ``load_plugins`` is idempotent but a test may call ``register`` too);
the factory refuses, with the reason, what the backend does not serve (hierarchical cache, a
disabled cache, EAGLE bigram keys), instead of building a cache that would answer wrong.
"""

from __future__ import annotations

from typing import Any

BACKEND = "hybridkv"


def build_tree_cache(ctx: Any) -> Any:
    """The factory: a ``HybridKVRadixCache`` for the components ``ctx`` asks for (full; +SWA
    when ``is_hybrid_swa``; +Mamba when ``is_hybrid_ssm``)."""
    from hybridkv.integrations.sglang.radix_cache import HybridKVRadixCache, HybridKVSGLangError

    if ctx.enable_hierarchical_cache:
        raise HybridKVSGLangError(
            "--radix-cache-backend hybridkv does not attach SGLang's HiCache (hybridkv's own tiers are not "
            "wired into SGLang); drop --enable-hierarchical-cache"
        )
    if ctx.is_hybrid_swa and ctx.full_tokens_per_layer == 0:
        raise HybridKVSGLangError(
            "--radix-cache-backend hybridkv: pure sliding-window models (no full-attention layer) are not "
            "supported; SGLang's default backend serves them"
        )
    return HybridKVRadixCache(ctx.params, swa=bool(ctx.is_hybrid_swa), mamba=bool(ctx.is_hybrid_ssm))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the ``hybridkv`` radix-cache backend, and the
    token-to-KV allocator hook when ``HYBRIDKV_SGLANG_ALLOCATOR=1``."""
    import os

    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, build_tree_cache)
    if os.environ.get("HYBRIDKV_SGLANG_ALLOCATOR", "").strip() not in ("", "0"):
        from hybridkv.integrations.sglang.allocator import register_allocator_hook

        register_allocator_hook()
