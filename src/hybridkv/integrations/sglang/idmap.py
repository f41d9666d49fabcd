"""The ids SGLang holds, paired with the ids hybridkv's prefix cache holds (no SGLang import).

SGLang's tree values are *token locations* from its own allocator (``loc = page * page_size +
offset``) and, for Mamba, *state slots* of its ``mamba_allocator``. hybridkv's
``HybridRadixCache`` holds virtual page ids and state slots of a ``UnifiedMemory``. The plugin
keeps SGLang's allocator as the owner of the bytes and gives hybridkv a *shadow* memory: a
``UnifiedMemory`` for a one-layer-per-kind spec with the same page size, whose ids exist only to
be cached, locked and evicted by hybridkv's tree (its cells are a few bytes; no KV is stored in
it). ``IdMap`` binds each SGLang page/slot the tree holds to one shadow id.

Invariants:
- A bijection: ``sg_of_page[hk] = sg  <=>  hk_of_page[sg] = hk`` for every bound pair (same for
  slots); unbound entries are ``-1``. A shadow id is live in the shadow memory exactly while it
  is bound.
- ``bind_pages`` reuses the shadow page of an SGLang page already bound (the tree holds it: the
  caller inserts a prefix it was handed), and allocates shadow pages only for the rest; a
  refused call binds nothing.
- Every SGLang id is checked against the range its pool hands out before it indexes a table:
  a wrong id is an error naming the value and the range, never a wrapped index.
- Everything here runs on host numpy arrays; nothing reads device memory.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.memory import UnifiedMemory
from hybridkv.spec import FullAttention, LayerKind, Linear, ModelSpec, ShardSpec, SlidingWindow, StateTensor


class SGLangIdError(ValueError):
    """An id SGLang handed the plugin that no pool of this cache can hold."""


def shadow_memory(page_size: int, pages: int, window: int | None, slots: int | None) -> UnifiedMemory:
    """A ``UnifiedMemory`` whose page ids can mirror ``pages`` SGLang pages (and ``slots``
    SGLang Mamba slots): full attention, a sliding window of ``window`` tokens when given, a
    recurrent state when ``slots`` is given. One KV head of width 1 per kind: the bytes are
    a shadow, the ids are what the tree needs."""
    if page_size < 1 or pages < 1:
        raise SGLangIdError(f"shadow memory: page_size {page_size} and pages {pages} must be >= 1")
    kinds: list[LayerKind] = [FullAttention(1, 1, 1)]
    if window is not None:
        if window < 1:
            raise SGLangIdError(f"shadow memory: sliding window {window} must be >= 1 token")
        kinds.append(SlidingWindow(window, 1, 1, 1))
    if slots is not None:
        kinds.append(Linear("sglang-mamba", (StateTensor("state", (1,), torch.float16, None),)))
    spec = ModelSpec.from_kinds("sglang-shadow", kinds, kv_dtype=torch.float16, max_context=pages * page_size)
    token_bytes = 4 * len(kinds)  # k and v of one fp16 element per KV kind, a bound for the state's 2 bytes
    need = (pages + 2) * page_size * token_bytes + ((slots or 0) + 2) * 64
    budget = 4 * need + (1 << 20)  # room for slab edges: the shadow must never be the one that runs out
    mem = UnifiedMemory.create(
        ShardSpec.whole(spec),
        budget,
        "cpu",
        page_size=page_size,
        max_context=min(pages * page_size, 1 << 16),
        chunk_tokens=min(pages * page_size, 1 << 12),
    )
    if mem.pages.capacity < pages + 1:
        raise SGLangIdError(f"shadow memory holds {mem.pages.capacity} page ids, SGLang's pool {pages}")
    return mem


class IdMap:
    """SGLang page ids / Mamba slots <-> shadow page ids / slots."""

    def __init__(self, mem: UnifiedMemory, sg_pages: int, sg_slots: int = 0):
        self.mem = mem
        self.sg_pages = sg_pages
        self.sg_slots = sg_slots
        self.hk_of_page = np.full(sg_pages + 1, -1, dtype=np.int64)
        self.sg_of_page = np.full(mem.pages.capacity, -1, dtype=np.int64)
        self.hk_of_slot = np.full(sg_slots + 1, -1, dtype=np.int64)
        self.sg_of_slot = np.full(mem.slots.capacity if sg_slots else 0, -1, dtype=np.int64)

    # --- pages ------------------------------------------------------------------------------

    def check_pages(self, sg: np.ndarray, what: str) -> None:
        if sg.size and (sg.min() < 1 or sg.max() > self.sg_pages):
            bad = sg[(sg < 1) | (sg > self.sg_pages)][0]
            raise SGLangIdError(
                f"{what}: SGLang page {bad} is outside its allocator's pages 1..{self.sg_pages} (page 0 "
                "is the padding slot); pass token locations this allocator handed out"
            )

    def bind_pages(self, sg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shadow pages for ``sg`` (distinct SGLang pages); returns them and the mask of those
        allocated now (not bound before)."""
        self.check_pages(sg, "insert")
        hk = self.hk_of_page[sg]
        fresh = hk < 0
        count = int(np.count_nonzero(fresh))
        if count:
            new = self.mem.alloc_pages(count)
            hk = hk.copy()
            hk[fresh] = new
            self.hk_of_page[sg[fresh]] = new
            self.sg_of_page[new] = sg[fresh]
        return hk, fresh

    def release_pages(self, hk: np.ndarray) -> None:
        """Unbind shadow pages the tree did not keep and free them in the shadow memory."""
        if hk.size:
            self.unbind_pages(hk)
            self.mem.free_pages(hk)

    def unbind_pages(self, hk: np.ndarray) -> np.ndarray:
        """Unbind shadow pages (the tree frees them itself: eviction); returns their SGLang pages."""
        sg = self.sg_of_page[hk]
        if sg.size and sg.min() < 0:
            raise SGLangIdError(f"shadow pages {hk[sg < 0].tolist()} are bound to no SGLang page (plugin bug)")
        self.hk_of_page[sg] = -1
        self.sg_of_page[hk] = -1
        return sg

    def sg_pages_of(self, hk: np.ndarray) -> np.ndarray:
        sg = self.sg_of_page[hk]
        if sg.size and sg.min() < 0:
            raise SGLangIdError(f"shadow pages {hk[sg < 0].tolist()} are bound to no SGLang page (plugin bug)")
        return sg

    # --- state slots ------------------------------------------------------------------------

    def bind_slot(self, sg: int) -> tuple[int, bool]:
        """The shadow slot for SGLang Mamba slot ``sg``; and whether it was allocated now."""
        if not 0 <= sg <= self.sg_slots:
            raise SGLangIdError(
                f"insert: SGLang Mamba slot {sg} is outside its mamba allocator's slots 0..{self.sg_slots}"
            )
        hk = int(self.hk_of_slot[sg])
        if hk >= 0:
            return hk, False
        hk = int(self.mem.alloc_state(1)[0])
        self.hk_of_slot[sg] = hk
        self.sg_of_slot[hk] = sg
        return hk, True

    def release_slot(self, hk: int) -> None:
        self.unbind_slot(hk)
        self.mem.free_state(np.asarray([hk], dtype=np.int64))

    def unbind_slot(self, hk: int) -> int:
        sg = int(self.sg_of_slot[hk])
        if sg < 0:
            raise SGLangIdError(f"shadow slot {hk} is bound to no SGLang Mamba slot (plugin bug)")
        self.hk_of_slot[sg] = -1
        self.sg_of_slot[hk] = -1
        return sg
