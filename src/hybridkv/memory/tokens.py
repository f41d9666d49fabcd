"""The SGLang-style token API, an adapter over the page API: token locations in, pages out.

``TokenAllocator(mem)`` holds a ``UnifiedMemory`` and uses only its public page API:
``alloc_pages`` / ``free_pages``, the page id space and the page size (so
``TokenAllocator(mem).alloc_extend(...)`` works as SGLang's allocators do). A token location
is ``page * page_size + offset``. The engine and the cache hold whole pages through
``KVManager`` and never call it; it is the seam for engines that speak token locations (an
SGLang-style allocator), the memory benchmark drives it against SGLang-style baselines, and
the tests prove it.

Invariants: like every hot-path call of the memory, nothing here reads device memory
(no ``.item()``, ``.tolist()``, ``bool(tensor)``, ``torch.unique``, ``nonzero``);
``free_segment`` derives one representative token per page from the host-known start
position (``locs[k::page_size]``), never by sorting. A refused call changes nothing:
every argument is checked before ``alloc_pages`` reserves anything, and two requests of
one extend/decode batch may not continue the same partial page.
"""

from __future__ import annotations

import numpy as np

from hybridkv.memory.errors import InvalidIds
from hybridkv.memory.ids import IdsLike, count_arg, host_ids
from hybridkv.memory.unified import UnifiedMemory
from hybridkv.memory.virtual import distinct


class TokenAllocator:
    """Token-location calls over one ``UnifiedMemory``'s page API."""

    def __init__(self, mem: UnifiedMemory):
        self.mem = mem
        self.page_size = mem.page_size
        self._page_mark = np.zeros(mem.pages.capacity, dtype=np.int64)
        """Scratch over page ids (``_check_tails``): one int per page id."""

    def alloc(self, num_tokens: int) -> np.ndarray:
        """Token locations for ``num_tokens`` tokens on fresh pages."""
        num_tokens = count_arg(num_tokens, "alloc: num_tokens")
        pages = self.mem.alloc_pages(-(-num_tokens // self.page_size))
        ps = self.page_size
        return (pages[:, None] * ps + np.arange(ps)).reshape(-1)[:num_tokens]

    def alloc_extend(self, prefix_lens: IdsLike, seq_lens: IdsLike, last_locs: IdsLike) -> np.ndarray:
        """Batched prefill: request ``i`` grows from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        ``last_locs[i]`` is the location of token ``prefix_lens[i] - 1`` (ignored when the
        prefix is empty); new tokens first fill that token's page, then fresh pages.
        Returns the new tokens' locations, request after request.
        """
        ps = self.page_size
        prefix = host_ids(prefix_lens, "alloc_extend prefix_lens")
        seq = host_ids(seq_lens, "alloc_extend seq_lens")
        last = host_ids(last_locs, "alloc_extend last_locs")
        if not prefix.size == seq.size == last.size:
            raise InvalidIds(
                f"alloc_extend: {prefix.size} prefix_lens, {seq.size} seq_lens, {last.size} "
                "last_locs; give one of each per request"
            )
        if (prefix < 0).any() or (seq < prefix).any():
            i = int(np.argmax((prefix < 0) | (seq < prefix)))
            raise InvalidIds(
                f"alloc_extend: request {i} has prefix_len {prefix[i]} and seq_len {seq[i]}; "
                "need 0 <= prefix_len <= seq_len"
            )
        _check_tails(self, last, prefix, seq > prefix, "alloc_extend")
        old_pages = -(-prefix // ps)
        new_pages_per = -(-seq // ps) - old_pages
        pages = self.mem.alloc_pages(int(new_pages_per.sum()))
        if not np.count_nonzero(prefix % ps):
            return _fresh_page_tokens(ps, pages, new_pages_per, seq)
        counts = seq - prefix
        req = np.repeat(np.arange(seq.size), counts)
        starts = np.cumsum(counts) - counts
        pos = prefix[req] + (np.arange(req.size) - starts[req])
        page_index = pos // ps - old_pages[req]
        first_new = np.cumsum(new_pages_per) - new_pages_per
        page = last[req] // ps  # tokens that continue the request's last page
        fresh = page_index >= 0
        page[fresh] = pages[first_new[req[fresh]] + page_index[fresh]]
        return page * ps + pos % ps

    def alloc_decode(self, seq_lens: IdsLike, last_locs: IdsLike) -> np.ndarray:
        """Batched decode: one token per request; ``seq_lens`` include the new token."""
        ps = self.page_size
        seq = host_ids(seq_lens, "alloc_decode seq_lens")
        last = host_ids(last_locs, "alloc_decode last_locs")
        if seq.size != last.size:
            raise InvalidIds(f"alloc_decode: {seq.size} seq_lens but {last.size} last_locs")
        if seq.size and seq.min() < 2:
            raise InvalidIds("alloc_decode: every seq_len must be >= 2 (a prompt token and the new one)")
        _check_tails(self, last, seq - 1, None, "alloc_decode")
        new_page = (seq - 1) % ps == 0
        pages = self.mem.alloc_pages(int(np.count_nonzero(new_page)))
        out = last + 1
        out[new_page] = pages * ps
        return out

    def free(self, locs: IdsLike) -> None:
        """Free the pages that hold ``locs`` (any tokens of them, in any order)."""
        arr = host_ids(locs, "free")
        self.mem.free_pages(distinct(arr // self.page_size))

    def free_segment(self, locs: IdsLike, start_pos: int) -> None:
        """Free one request's row from position ``start_pos``: ``locs`` are its tokens there.

        Frees every page whose first position is ``>= start_pos``, found from one
        representative per page (``locs[k::page_size]``), never by sorting. The segment
        must end where the row ends or on a page boundary, else a page still in use would
        be freed; every token is checked against its expected page offset, so a segment
        longer than the row (or from another row) is refused.
        """
        arr = host_ids(locs, "free_segment")
        ps = self.page_size
        start_pos = count_arg(start_pos, "free_segment: start_pos")
        if arr.size == 0:
            return
        # loc - pos is page * ps - (first position of the page): a multiple of ps, constant
        # within a page, so it may only change where a page starts
        pos = start_pos + np.arange(arr.size)
        shift = arr - pos
        changes = np.flatnonzero(shift[1:] != shift[:-1]) + 1
        if np.count_nonzero(shift % ps) or np.count_nonzero(pos[changes] % ps) or arr.min() < 0:
            pages = arr // ps
            bad = (arr < 0) | (arr % ps != pos % ps)
            bad[1:] |= ((pos[1:] // ps) == (pos[:-1] // ps)) & (pages[1:] != pages[:-1])
            i = int(np.argmax(bad))
            raise InvalidIds(
                f"free_segment: token {i} (row position {pos[i]}) has location {arr[i]}, not "
                f"offset {pos[i] % ps} of the page its neighbours use; the segment is longer "
                "than the row, misaligned, or mixes rows"
            )
        head = (-start_pos) % ps
        self.mem.free_pages(arr[head::ps] // ps)


def _fresh_page_tokens(ps: int, pages: np.ndarray, pages_per: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Token locations when every request starts on a page boundary (no continuation)."""
    grid = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
    tail = seq % ps
    ragged = (pages_per > 0) & (tail > 0)
    if not np.count_nonzero(ragged):
        return grid
    valid = np.full(pages.size, ps, dtype=np.int64)
    valid[(np.cumsum(pages_per) - 1)[ragged]] = tail[ragged]
    return grid[(np.arange(ps) < valid[:, None]).reshape(-1)]


def _check_tails(
    tokens: TokenAllocator, last: np.ndarray, lengths: np.ndarray, grows: np.ndarray | None, what: str
) -> None:
    """Rows with ``lengths[i] > 0`` continue a row whose last token is at ``last[i]``.

    ``last[i]`` must be a live location at offset ``(lengths[i] - 1) % page_size``, and no
    two such rows may end on the same page where one of them writes into it (its page is
    partial and it grows: ``grows[i]``, or every row when None): both would be handed
    the same slots, or one would overwrite the other's tokens. (A shared prefix shares
    full pages only, or copies the partial one.)
    """
    has = lengths > 0
    count = np.count_nonzero(has)
    if not count:
        return
    whole = count == has.size
    loc, n = (last, lengths) if whole else (last[has], lengths[has])
    ps = tokens.page_size
    pages = loc // ps
    in_range = pages.min() > 0 and pages.max() < tokens.mem.pages.capacity
    if not (in_range and tokens.mem.pages.live[pages].all() and not np.count_nonzero(loc % ps != (n - 1) % ps)):
        bad = (pages <= 0) | (pages >= tokens.mem.pages.capacity)
        bad |= ~bad & ~tokens.mem.pages.live[np.where(bad, 0, pages)]
        bad |= loc % ps != (n - 1) % ps
        i = int(np.argmax(bad))
        raise InvalidIds(
            f"{what}: last location {loc[i]} does not hold token {n[i] - 1} of a live page "
            f"(page {pages[i]}, offset {loc[i] % tokens.page_size}, expected offset "
            f"{(n[i] - 1) % tokens.page_size})"
        )
    if count < 2:
        return
    # distinct pages <=> each row reads back its own index (no sort); a repeated page
    # keeps one of its rows' indices, so the others read back another
    order = np.arange(count)
    tokens._page_mark[pages] = order
    if not np.count_nonzero(tokens._page_mark[pages] != order):
        return
    writes = n % ps > 0
    if grows is not None:
        writes &= grows if whole else grows[has]
    _refuse_shared_tail(pages, np.flatnonzero(has), writes, last, what)


def _refuse_shared_tail(pages: np.ndarray, rows: np.ndarray, writes: np.ndarray, last: np.ndarray, what: str) -> None:
    """Raise for the first two rows that end on one page while one of them writes into it
    (rows that end on the same full page and both start fresh pages share nothing)."""
    order = np.argsort(pages, kind="stable")
    same = pages[order][1:] == pages[order][:-1]
    clash = same & (writes[order][1:] | writes[order][:-1])
    if not clash.any():
        return
    k = int(np.argmax(clash))
    first, second = sorted((int(rows[order[k]]), int(rows[order[k + 1]])))
    raise InvalidIds(
        f"{what}: requests {first} and {second} both continue page {pages[order[k]]} (last locations "
        f"{last[first]} and {last[second]}), so they would get the same slots; two requests cannot "
        "continue the same partial page: give one of them its own copy of the page first"
    )
