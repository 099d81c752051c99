"""Slot allocator over a paged KV pool.

Slots `[0, page_size)` are the padding page and are never handed out; real slots are
`[page_size, size + page_size)`. Allocation is by page (`page = slot // page_size`): a request
owns whole pages and fills them in order, so with page_size > 1 a new token first goes to the
free tail of the request's last page. A page goes back to the free list when none of its slots
is in use any more. Freeing a slot twice, or one never handed out, raises `AllocatorError`.
"""

from __future__ import annotations

import numpy as np
import torch

from eaglekv.errors import AllocatorError, ConfigError, OutOfKVMemoryError


class SlotAllocator:
    def __init__(self, size: int, page_size: int = 1):
        if page_size < 1:
            raise ConfigError(f"page_size={page_size} must be >= 1")
        if size < page_size or size % page_size:
            raise ConfigError(f"KV pool size={size} must be a positive multiple of "
                              f"page_size={page_size}")
        self.size, self.page_size = size, page_size
        self.num_pages = size // page_size
        # pages 1..num_pages are real; page 0 is the padding page
        # the free pages as a stack: `_stack[:_top]`, the next page handed out at the top (the
        # end). Pops and pushes are slices, so a speculative step's hundreds of draft and verify
        # slots cost a few ops at any batch. A fresh allocator hands out pages 1, 2, 3, ...; a
        # block freed together comes back in ascending order, so a request's pages stay
        # consecutive whenever they can (its K/V then read as one slice instead of a gather).
        # The books are numpy arrays: an op costs ~1 us where a torch op on a CPU tensor costs
        # 10-20 us on the H200's host (its profile of an S5 step at batch 1: `free` 0.47 ms of
        # a 2.6 ms step with torch tensors). Slots go in and out as torch int64 tensors.
        self._stack = np.arange(self.num_pages, 0, -1, dtype=np.int64)
        self._top = self.num_pages
        self._used = np.zeros(size + page_size, dtype=np.bool_)              # per slot
        self._page_count = np.zeros(self.num_pages + 1, dtype=np.int64)   # used slots per page
        self.owners = None     # memory/ownership.SlotOwners in the checked mode, else None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return self._top

    def free_page_list(self) -> list[int]:
        """The free pages, in the order they will be handed out."""
        return self._stack[:self._top][::-1].tolist()

    def available_slots(self) -> int:
        """Slots in wholly free pages (what a new request can count on)."""
        return self._top * self.page_size

    def num_used(self) -> int:
        return int(np.count_nonzero(self._used))

    def used_slots(self) -> torch.Tensor:
        """Every slot currently handed out, int64 (sorted)."""
        return torch.from_numpy(np.flatnonzero(self._used).astype(np.int64))

    def pages_needed(self, seq_len: int, n: int) -> int:
        """New pages a request of `seq_len` committed slots needs to grow by `n` tokens."""
        ps = self.page_size
        return -(-(seq_len + n) // ps) - (-(-seq_len // ps))

    # ---- alloc / free --------------------------------------------------------------------------
    def alloc(self, n: int, seq_len: int = 0, last_slot: int = -1) -> torch.Tensor:
        """Slots for positions `seq_len .. seq_len + n - 1` of one request, as int64 `[n]`.

        `last_slot` is the slot of position `seq_len - 1` (needed when page_size > 1 and the
        request's last page is partly filled: the new positions continue inside that page).
        """
        if n < 0:
            raise AllocatorError(f"alloc of n={n} slots")
        ps = self.page_size
        need_pages = self.pages_needed(seq_len, n)
        if need_pages > self._top:
            raise OutOfKVMemoryError(need_pages * ps, self.available_slots(), self.size)
        in_last = 0
        if ps > 1 and seq_len % ps:
            if (last_slot < ps or last_slot >= self.size + ps or not self._used[last_slot]
                    or last_slot % ps != (seq_len - 1) % ps):
                raise AllocatorError(f"last_slot={last_slot} is not the in-use slot of position "
                                     f"{seq_len - 1} (seq_len={seq_len}, page_size={ps})")
            in_last = min(n, ps - seq_len % ps)
            tail = np.arange(last_slot + 1, last_slot + 1 + in_last)
            if self._used[tail].any():
                raise AllocatorError(f"slot {int(tail[self._used[tail]][0])} after last_slot="
                                     f"{last_slot} is already in use")
        slots = np.empty(n, dtype=np.int64)
        if in_last:
            slots[:in_last] = tail
        rest = n - in_last
        if rest:  # whole free pages: nothing in them is in use, so nothing can fail after this
            pages = self._pop(need_pages)
            # (need_pages, ps) -> flat, first `rest` of them
            page_slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)
            slots[in_last:] = page_slots[:rest]
        return self._take(slots)

    def alloc_rows(self, count: int, n: int) -> torch.Tensor:
        """Page size 1: n slots for each of `count` requests, as int64 `(count, n)`, all or
        nothing (what `count` calls of `alloc(n)` give, in a few vector ops). Raises
        OutOfKVMemoryError (nothing taken) when they do not fit."""
        if self.page_size != 1:
            raise AllocatorError(f"alloc_rows needs page_size 1 (page_size={self.page_size})")
        if count < 0 or n < 0:
            raise AllocatorError(f"alloc_rows of count={count} x n={n} slots")
        m = count * n
        if m > self._top:
            raise OutOfKVMemoryError(m, self.available_slots(), self.size)
        return self._take(self._pop(m)).view(count, n)

    def alloc_decode(self, seq_lens: list[int], last_slots: list[int]) -> torch.Tensor:
        """One slot each for n requests' next token, as int64 `[n]`, all or nothing: what
        `alloc(1, seq_lens[i], last_slots[i])` gives, for the whole decode batch in a few
        vector ops instead of n calls. Raises OutOfKVMemoryError (nothing taken) when the
        new pages do not fit."""
        ps, n = self.page_size, len(seq_lens)
        seq = np.asarray(seq_lens, dtype=np.int64)                             # (n,)
        fresh = seq % ps == 0                                                  # needs a page
        k = int(np.count_nonzero(fresh))
        if k > self._top:
            raise OutOfKVMemoryError(k * ps, self.available_slots(), self.size)
        slots = np.empty(n, dtype=np.int64)
        if k < n:   # the others continue in their last page, right after last_slot
            last = np.asarray(last_slots, dtype=np.int64)[~fresh]
            want = last + 1
            bad = ((last < ps) | (last >= self.size + ps) | (last % ps != (seq[~fresh] - 1) % ps))
            if not bad.any():
                bad = ~self._used[last] | self._used[want]
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise AllocatorError(f"decode alloc: last_slot={int(last[i])} is not the in-use "
                                     f"slot before a free one (seq_len="
                                     f"{int(seq[~fresh][i])}, page_size={ps})")
            slots[~fresh] = want
        if k:
            slots[fresh] = self._pop(k) * ps
        return self._take(slots)

    def alloc_decode_steps(self, seq_lens: list[int], last_slots: list[int],
                           m: int) -> torch.Tensor:
        """Slots for the next m decode steps of n requests, int64 `(m', n)`: row j is what the
        j-th of m successive `alloc_decode` calls gives (positions seq_lens + j, each
        continuing the row before), in one pass for a multi-step decode chain. m' < m when the
        free pages run out: the steps that fit, whole (a step is all or nothing, and so is the
        call: on an error nothing is taken)."""
        ps, n = self.page_size, len(seq_lens)
        if m <= 0 or n == 0:
            return torch.empty(0, n, dtype=torch.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)                             # (n,)
        j = np.arange(m, dtype=np.int64)[:, None]                              # (m, 1)
        fresh = (seq[None, :] + j) % ps == 0                                   # (m, n) new page
        need = np.cumsum(np.count_nonzero(fresh, axis=1))                      # pages by step
        m = int(np.searchsorted(need, self._top, side="right"))                # steps that fit
        if m == 0:
            return torch.empty(0, n, dtype=torch.int64)
        fresh = fresh[:m]
        last = np.asarray(last_slots, dtype=np.int64)
        cont = ~fresh[0]                         # step 0 continues the request's last page
        if cont.any():
            lc = last[cont]
            bad = (lc < ps) | (lc >= self.size + ps) | (lc % ps != (seq[cont] - 1) % ps)
            if not bad.any():
                bad = ~self._used[lc]
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise AllocatorError(f"decode alloc: last_slot={int(lc[i])} is not the in-use "
                                     f"slot of position {int(seq[cont][i]) - 1} "
                                     f"(page_size={ps})")
        # slot[j, i]: a fresh step opens a page, any other continues the step before it
        # (step -1 being last_slots): anchor = the latest fresh step <= j, or -1
        anchor = np.maximum.accumulate(np.where(fresh, j[:m], -1), axis=0)     # (m, n)
        opened = np.zeros((m, n), dtype=np.int64)
        opened[fresh] = self._stack[self._top - int(need[m - 1]):self._top][::-1] * ps
        base = np.where(anchor >= 0, opened[np.maximum(anchor, 0), np.arange(n)], last)
        slots = base + (j[:m] - anchor)                                        # (m, n)
        if self._used[slots[~fresh]].any():
            s = int(slots[~fresh][self._used[slots[~fresh]]][0])
            raise AllocatorError(f"decode alloc: slot {s} after a request's last slot is "
                                 "already in use")
        self._pop(int(need[m - 1]))
        return self._take(slots.reshape(-1)).view(m, n)

    def _take(self, slots: np.ndarray) -> torch.Tensor:
        """Mark the (distinct, free) slots in use -> them as a torch int64 tensor."""
        self._used[slots] = True
        if self.page_size == 1:
            self._page_count[slots] = 1
        else:
            np.add.at(self._page_count, slots // self.page_size, 1)
        out = torch.from_numpy(slots)
        if self.owners is not None:
            self.owners.on_alloc(out)
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots; raises (freeing nothing) on a foreign or already-free slot."""
        if slots.device.type != "cpu" or slots.dtype != torch.int64:
            slots = slots.to("cpu", torch.int64)
        s = slots.numpy().reshape(-1)
        if s.size == 0:
            return
        ps = self.page_size
        lo, hi = ps, self.size + ps
        out = (s < lo) | (s >= hi)
        if out.any():
            raise AllocatorError(f"free of slot {int(s[out][0])}, which this allocator "
                                 f"never hands out (valid [{lo}, {hi}))")
        uniq = np.unique(s)                                              # sorted
        if uniq.size != s.size:
            raise AllocatorError(f"free of a slot listed twice in one call ({s[:8].tolist()}...)")
        not_used = ~self._used[s]
        if not_used.any():
            raise AllocatorError(f"double free: slot {int(s[not_used][0])} is not in use")
        if self.owners is not None:
            self.owners.on_free(torch.from_numpy(s))
        self._used[s] = False
        if ps == 1:
            self._page_count[uniq] = 0
            self._push(uniq)
            return
        pages = s // ps
        np.add.at(self._page_count, pages, -1)
        emptied = np.unique(pages)
        self._push(emptied[self._page_count[emptied] == 0])

    def _pop(self, m: int) -> np.ndarray:
        """The next m free pages (the caller checked m <= _top), int64 (m,), a copy."""
        self._top -= m
        return self._stack[self._top:self._top + m][::-1].copy()

    def _push(self, pages: np.ndarray) -> None:
        """Pages freed together, handed out again in this order (before any older free page)."""
        k = pages.size
        self._stack[self._top:self._top + k] = pages[::-1]
        self._top += k

    # ---- books ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Free pages + held pages == all pages, and the per-page counts match the slots."""
        ps = self.page_size
        free_t = self._stack[:self._top]
        if not 0 <= self._top <= self.num_pages:
            raise AllocatorError(f"free page count {self._top} outside [0, {self.num_pages}]")
        distinct = np.unique(free_t).size
        if distinct != free_t.size:
            raise AllocatorError(f"free page list holds duplicates ({free_t.size} entries, "
                                 f"{distinct} distinct)")
        if ((free_t < 1) | (free_t > self.num_pages)).any():
            raise AllocatorError("free page list holds a page outside [1, num_pages]")
        if self._used[:ps].any():
            raise AllocatorError("a padding-page slot is marked in use")
        counts = self._used.reshape(-1, ps).sum(1)
        if not np.array_equal(counts, self._page_count):
            raise AllocatorError("per-page use counts disagree with the slot bitmap")
        if (counts[free_t] != 0).any():
            raise AllocatorError("a page on the free list has slots in use")
        held = int((counts[1:] > 0).sum())
        free = self._top
        if held + free != self.num_pages:
            raise AllocatorError(f"{free} free pages + {held} held pages != "
                                 f"{self.num_pages} total (leaked {self.num_pages - held - free})")

    def is_full(self) -> bool:
        """True when every page is free again (the state after all requests finished)."""
        return self._top == self.num_pages and not self._used.any()
