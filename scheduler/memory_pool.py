"""Token-slot bookkeeping on the scheduler's side (CPU only; the K/V tensors live in the workers).

Two ledgers, laid out as SGLang lays them out:

- ``ReqToTokenPool``: a ``(max_requests + 1, max_context_len)`` int32 table. Row ``r`` lists, in
  position order, the KV slots of the request that holds row ``r``. Row 0 is never handed out:
  padded batch entries point at it.
- ``TokenToKVPoolAllocator``: the free list of KV slots ``1..size``. Slot 0 is never handed out:
  padded writes land there. With ``page_size > 1`` slots are handed out in whole pages
  (page ``p`` holds slots ``p*page_size .. p*page_size + page_size - 1``; page 0 is reserved),
  and ``alloc_extend`` first fills the free tail of each request's last page.

``SimulatedAllocator`` stands in for the second when only the tree's bookkeeping matters (a
``RadixCache`` built without an allocator: tests, tools, the in-batch sharing simulation).
None of them is thread-safe; one scheduler owns them.
"""

from __future__ import annotations

import torch


RELEASED_CHUNKS = 64  # single frees kept apart before they are joined into one tensor


class ReqToTokenPool:
    """Rows of the request-to-slot table. ``alloc``/``free`` mutate the free-row list only."""

    def __init__(self, max_requests: int, max_context_len: int):
        self.size = max_requests
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32)
        self._free_rows = list(range(max_requests, 0, -1))  # pop() hands out 1, 2, 3, ...

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take one row, or None when all rows are in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 < row <= self.size, f"row {row} out of range"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(slots)] = slots.to(torch.int32)

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[row, start:end].to(torch.int64)

    def clear(self) -> None:
        self._free_rows = list(range(self.size, 0, -1))


class TokenToKVPoolAllocator:
    """Free list of KV slots. ``available_size`` counts tokens, not pages.

    Mutates only its own free list. Freed slots are handed out again in the order they were
    freed (after the initial ascending order), which keeps reuse easy to reason about in tests.
    """

    def __init__(self, size: int, page_size: int = 1):
        assert size >= page_size >= 1, "pool must hold at least one page"
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        # Page 0 (slot 0 when page_size == 1) is the padding target; pages 1..num_pages are free.
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        # Freed pages wait here until the free pages run out (one concatenation then, not
        # one per free). Counted as they come: summing the list on every available_size
        # (several per admitted request) slowed a long-running scheduler down round after
        # round (3.6 s -> 15.8 s per 500 requests) until it was merged, tens of thousands of
        # requests later.
        self._released: list[torch.Tensor] = []  # in order; the newest ones still small
        self._num_released = 0
        self._small = 0  # how many of the newest entries are single frees, not yet joined

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released, self._num_released, self._small = [], 0, 0

    def available_size(self) -> int:
        return (len(self._free_pages) + self._num_released) * self.page_size

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > len(self._free_pages):
            self._merge_released()
            if n > len(self._free_pages):
                return None
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Hand out ``num_tokens`` slots (a multiple of ``page_size``), or None if too few free."""
        assert num_tokens % self.page_size == 0, "alloc takes whole pages; use alloc_extend"
        pages = self._take_pages(num_tokens // self.page_size)
        if pages is None:
            return None
        if self.page_size == 1:
            return pages.clone()
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def alloc_extend(self, prefix_lens, extend_lens, last_slots) -> torch.Tensor | None:
        """Slots for appending ``extend_lens[i]`` tokens to request ``i``, concatenated (each
        argument a list of ints or an int64 tensor, one entry per request).

        ``last_slots[i]`` is the slot of the request's last existing token (ignored when its
        prefix is empty). With pages, the free tail of that token's page is used first. Returns
        None, taking nothing, when the pool is short.
        """
        if self.page_size == 1:
            return self.alloc(sum(extend_lens))
        # One pass of tensor ops over the batch (a loop per request cost ~18 us each: 5 ms a
        # decode step at batch 256). Request i's slots: first the free tail of its last page
        # (last_slots[i] + 1, ...), then its new pages in order.
        p = self.page_size
        prefix = torch.as_tensor(prefix_lens, dtype=torch.int64)
        extend = torch.as_tensor(extend_lens, dtype=torch.int64)
        last = torch.as_tensor(last_slots, dtype=torch.int64)
        tail = torch.minimum(torch.where(prefix > 0, (-prefix) % p, 0), extend)
        pages_needed = torch.div(extend - tail + p - 1, p, rounding_mode="floor")
        pages = self._take_pages(int(pages_needed.sum()))
        if pages is None:
            return None
        owner = torch.repeat_interleave(torch.arange(len(extend_lens)), extend)  # [total]
        j = torch.arange(len(owner)) - (torch.cumsum(extend, 0) - extend)[owner]  # i's j-th
        beyond = (j - tail[owner]).clamp(min=0)  # position among its new pages' slots
        page_start = (torch.cumsum(pages_needed, 0) - pages_needed)[owner]
        page = pages[(page_start + beyond // p).clamp(max=max(len(pages) - 1, 0))] \
            if len(pages) else torch.zeros_like(owner)
        return torch.where(j < tail[owner], last[owner] + 1 + j, page * p + beyond % p)

    def free(self, slots: torch.Tensor) -> None:
        """Return slots. With pages, a page is returned when any of its slots is passed: callers
        free a page only once they hold none of its tokens any more."""
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64)
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        assert int(pages.min()) > 0, "slot 0 (padding) must never be freed"
        self._released.append(pages)
        self._num_released += len(pages)
        self._small += 1
        if self._small >= RELEASED_CHUNKS:  # the newest frees joined into one: the list grows
            self._released[-RELEASED_CHUNKS:] = [torch.cat(self._released[-RELEASED_CHUNKS:])]
            self._small = 0  # by one per 64 frees, and no free copies what came before


class SimulatedAllocator:
    """Unlimited slots for tests and tools. Hands out fresh ids 1, 2, 3, ... in whole pages,
    keeps the set of live slots, and rejects freeing a slot that is not live (a double free)."""

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self._next = page_size  # page 0 stays reserved, as in the real allocator
        self.live: set[int] = set()
        self.num_freed = 0

    def available_size(self) -> int:
        return 1 << 62

    def alloc(self, num_tokens: int) -> torch.Tensor:
        pages = -(-num_tokens // self.page_size)
        slots = torch.arange(self._next, self._next + num_tokens, dtype=torch.int64)
        self._next += pages * self.page_size
        self.live.update(slots.tolist())
        return slots

    def free(self, slots: torch.Tensor) -> None:
        for slot in slots.tolist():
            if slot not in self.live:
                raise ValueError(f"slot {slot} freed but not allocated (double free?)")
            self.live.remove(slot)
        self.num_freed += len(slots)
