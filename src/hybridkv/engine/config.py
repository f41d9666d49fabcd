"""EngineConfig: how one engine is sized and what it keeps, checked once when it is built.

Every engine of the product reads its options from one of these: ``Engine(model, weights, config)``,
``build_runner(..., config)`` for a rank of a parallel or disaggregated layout (it reads the memory's and
the model's fields), ``PDConfig.engine`` for the ranks of a disaggregated server, and the CLI's
``EngineOptions.engine``. Nothing downstream checks these fields again.

Fields (units, and what ``__post_init__`` checks):

- ``gpu_memory``: bytes (an int, or a size such as ``"256MiB"``) for the K/V and state pools of one
  process; a step's gathered keys take up to a quarter of it more (``pool_io.WORKSPACE_SHARE``). > 0.
- ``page_size``: tokens per KV page. >= 1.
- ``chunk_size``: tokens of one prefill chunk (a request computes at most this many per step). >= 1.
- ``max_running``: requests in one step's batch, at most. >= 1.
- ``max_step_tokens``: prompt tokens one step computes, at most (its decodes, one token each, ride on top); None:
  ``STEP_CHUNKS`` chunks (``step_tokens``). >= 1.
- ``max_context``: tokens of one request (prompt and output); None: the model's own. >= 1.
- ``dtype``: the weights', activations' and K/V's torch dtype. ``device``: where they live (``"cpu"``, ``"cuda"``).
- ``spec``: a ``ModelSpec`` that overrides the one derived from the model's config (tests, odd layouts).
- ``prefix_cache``: requests share cached prefixes (``HybridRadixCache``); ``cache_policy``: its eviction
  policy, a name in ``hybridkv.cache.POLICIES``.
- ``checkpoints``: where requests store recurrent-state checkpoints for later hits, a placement spec
  (``hybridkv.cache.placement``: none, interval:N, prompt-aligned[:K], branch, end); None: ``engine_default``
  for this chunk and page size (``placement``). Parsed here against ``page_size``.
- ``host_memory``: bytes of host memory below the device (None: no host tier). > 0.
- ``store``: ``"none"``, ``"mooncake"`` (the Mooncake Store) or a ``StorageTier`` the caller built;
  ``store_master``: host:port of a ``mooncake_master`` (None with mooncake: one is started on loopback;
  given without mooncake: refused); ``store_memory``: bytes of the segment a Mooncake client mounts
  (>= 16 MiB, Mooncake's floor, when the store is mooncake).
- ``tier_policy``: ``"back"`` (written below on eviction) or ``"through"`` (at once).
  Tiers hold what the prefix cache evicts: ``host_memory`` or a store needs ``prefix_cache``.

Invariants:
- A built ``EngineConfig`` is valid: each refusal is a ``ValueError`` naming the field and what to change.
- It is frozen, and picklable while its store is a name (a disaggregated server hands it to every worker process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache import POLICIES, KVManager
from hybridkv.cache.placement import CheckpointPlacement, engine_default
from hybridkv.engine.sched.scheduler import step_budget
from hybridkv.engine.sched.tiered import EngineTiers
from hybridkv.memory import parse_bytes
from hybridkv.spec import ModelSpec
from hybridkv.tiers import StorageTier, WritePolicy

STORES = ("none", "mooncake")
"""The stores a config names (besides a ``StorageTier`` object)."""

MOONCAKE_FLOOR = 16 << 20
"""The smallest segment a Mooncake Store client mounts, bytes."""


@dataclass(frozen=True)
class EngineConfig:
    gpu_memory: int | str = "256MiB"
    page_size: int = 16
    chunk_size: int = 64
    max_running: int = 64
    max_step_tokens: int | None = None
    max_context: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    spec: ModelSpec | None = None
    prefix_cache: bool = True
    cache_policy: str = "lru"
    checkpoints: str | None = None
    host_memory: int | str | None = None
    store: str | StorageTier = "none"
    store_master: str | None = None
    store_memory: int | str = "256MiB"
    tier_policy: str = "back"

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"gpu_memory must be > 0 bytes, got {self.gpu_memory!r}")
        if min(self.chunk_size, self.max_running, self.step_tokens) < 1:
            raise ValueError(
                f"an engine needs chunk_size, max_running and max_step_tokens >= 1, got chunk {self.chunk_size}, "
                f"max_running {self.max_running}, max_step_tokens {self.step_tokens}"
            )
        context = 1 if self.max_context is None else self.max_context
        for name, value in {"page_size": self.page_size, "max_context": context}.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1 tokens, got {value}")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"unknown cache_policy {self.cache_policy!r}; known: {', '.join(POLICIES)}")
        CheckpointPlacement.parse(self.placement, self.page_size)  # PlacementError (a ValueError) names the part
        self._check_tiers()

    def _check_tiers(self) -> None:
        store = self.store
        if not isinstance(store, StorageTier) and store not in STORES:
            raise ValueError(f"store must be one of {STORES} or a StorageTier, got {store!r}")
        if self.store_master is not None and store != "mooncake":
            raise ValueError("store_master names a mooncake_master: it needs store='mooncake'")
        if self.tiered and not self.prefix_cache:
            raise ValueError("tiers below the device hold what the prefix cache evicts: they need prefix_cache=True")
        if self.host_memory is not None and parse_bytes(self.host_memory) <= 0:
            raise ValueError(f"host_memory must be > 0 bytes, got {self.host_memory!r}")
        if store == "mooncake" and parse_bytes(self.store_memory) < MOONCAKE_FLOOR:
            raise ValueError(f"store_memory must be at least 16 MiB (Mooncake's floor), got {self.store_memory!r}")
        if self.tier_policy not in {p.value for p in WritePolicy}:
            raise ValueError(f"unknown tier_policy {self.tier_policy!r}; known: {', '.join(WritePolicy)}")

    @property
    def memory_bytes(self) -> int:
        """``gpu_memory`` in bytes."""
        return parse_bytes(self.gpu_memory)

    @property
    def step_tokens(self) -> int:
        """The tokens one step computes, at most (``max_step_tokens`` or its default)."""
        return step_budget(self.chunk_size, self.max_step_tokens)

    @property
    def placement(self) -> str:
        """The checkpoint placement spec requests use (``checkpoints`` or the engine default)."""
        return self.checkpoints or engine_default(self.chunk_size, self.page_size)

    def tiers(self, kvm: KVManager) -> EngineTiers | None:
        """The tiers below ``kvm``'s device memory these options ask for (None: the device only)."""
        return EngineTiers.build(
            kvm,
            self.chunk_size,
            host_memory=self.host_memory,
            store=self.store,
            store_master=self.store_master,
            store_memory=self.store_memory,
            policy=self.tier_policy,
        )

    @property
    def tiered(self) -> bool:
        """Tiers sit below the device: host memory, a store, or both."""
        return self.host_memory is not None or self.store != "none"


DEFAULT_CONFIG = EngineConfig()
"""Every default: what ``Engine(model, weights)`` and ``build_runner(model, weights)`` use."""
