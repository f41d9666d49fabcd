"""The baseline for the memory benchmark: static pools with device-resident free lists.

This is how serving engines commonly write a paged allocator (SGLang's paged and SWA
allocators are the model): one fixed-size pool per kind, a free-page tensor on the device,
sizes read back with ``.item()``, pages deduplicated with ``torch.unique``, and a
full->SWA page mapping tensor. It is deliberately straightforward and correct; the
benchmark runs it on the same trace to compare speed, host syncs and capacity.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    pass


class StaticPagePool:
    def __init__(self, num_pages: int, page_size: int, device: str = "cpu"):
        self.page_size = page_size
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64, device=device)

    def take(self, count: int) -> torch.Tensor:
        if count > self.free_pages.numel():
            raise OutOfPages(f"{count} pages asked, {self.free_pages.numel()} free")
        out, self.free_pages = self.free_pages[:count], self.free_pages[count:]
        return out

    def give(self, pages: torch.Tensor) -> None:
        self.free_pages = torch.cat([self.free_pages, pages])


class StaticAllocator:
    """Full pool, optional SWA pool (same page ids via a mapping), optional state slots."""

    def __init__(self, full_pages: int, page_size: int, swa_pages: int = 0, state_slots: int = 0, device: str = "cpu"):
        self.ps = page_size
        self.full = StaticPagePool(full_pages, page_size, device)
        self.swa = StaticPagePool(swa_pages, page_size, device) if swa_pages else None
        self.full_to_swa = torch.zeros(full_pages + 1, dtype=torch.int64, device=device)
        self.slots = StaticPagePool(state_slots, 1, device) if state_slots else None

    def _new_pages(self, count: int) -> torch.Tensor:
        pages = self.full.take(count)
        if self.swa is not None:
            self.full_to_swa[pages] = self.swa.take(count)
        return pages

    def alloc_extend(self, prefix: torch.Tensor, seq: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        ps = self.ps
        old = (prefix + ps - 1) // ps
        new_per = (seq + ps - 1) // ps - old
        pages = self._new_pages(int(new_per.sum().item()))
        counts = seq - prefix
        total = int(counts.sum().item())
        req = torch.repeat_interleave(torch.arange(seq.numel(), device=seq.device), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        pos = prefix[req] + torch.arange(total, device=seq.device) - starts[req]
        page_index = pos // ps - old[req]
        first_new = torch.cumsum(new_per, 0) - new_per
        fresh = page_index >= 0
        new_idx = torch.where(fresh, first_new[req] + page_index, 0)
        page = torch.where(fresh, pages[new_idx] if pages.numel() else 0, last[req] // ps)
        return page * ps + pos % ps

    def alloc_decode(self, seq: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        need = (seq - 1) % self.ps == 0
        count = int(need.sum().item())
        pages = self._new_pages(count)
        out = last + 1
        out[need] = pages * self.ps
        return out

    def free_segment(self, locs: torch.Tensor) -> None:
        pages = torch.unique(locs // self.ps)
        if self.swa is not None:
            swa = self.full_to_swa[pages]
            self.swa.give(swa[swa > 0])
            self.full_to_swa[pages] = 0
        self.full.give(pages)

    def free_window(self, pages: torch.Tensor) -> None:
        assert self.swa is not None
        self.swa.give(self.full_to_swa[pages])
        self.full_to_swa[pages] = 0

    def alloc_state(self, count: int) -> torch.Tensor:
        assert self.slots is not None
        return self.slots.take(count)

    def free_state(self, slots: torch.Tensor) -> None:
        assert self.slots is not None
        self.slots.give(slots)
