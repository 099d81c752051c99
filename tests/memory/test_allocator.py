"""SlotAllocator and ReqToTokenPool: padding never handed out, books always balanced.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from eaglekv.errors import AllocatorError, ConfigError, OutOfKVMemoryError
from eaglekv.memory import ReqToTokenPool, SlotAllocator

PAGE_SIZES = (1, 4, 16)
NUM_PAGES = 12


# ---- helpers ------------------------------------------------------------------------------------
def snapshot(a: SlotAllocator):
    """Everything that defines the allocator's state (public numbers and the private books)."""
    return (a.num_used(), a.free_pages, a.available_slots(), sorted(a.free_page_list()),
            a._used.copy(), a._page_count.copy())


def assert_same_state(a: SlotAllocator, snap) -> None:
    now = snapshot(a)
    assert now[:4] == snap[:4]
    assert np.array_equal(now[4], snap[4]) and np.array_equal(now[5], snap[5])
    a.check_integrity()


def slots_t(*s: int) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.int64)


class Model:
    """Test-side bookkeeping: request id -> list of slots, one per token position."""

    def __init__(self, a: SlotAllocator):
        self.a, self.reqs, self.next_id = a, {}, 0

    def new(self, n: int) -> None:
        s = self.a.alloc(n, 0, -1)
        self.reqs[self.next_id] = s.tolist()
        self.next_id += 1

    def grow(self, rid: int, n: int) -> None:
        cur = self.reqs[rid]
        s = self.a.alloc(n, len(cur), cur[-1] if cur else -1)
        cur.extend(s.tolist())

    def free_all(self, rid: int) -> None:
        self.a.free(torch.tensor(self.reqs.pop(rid), dtype=torch.int64))

    def free_tail(self, rid: int, k: int) -> None:
        cur = self.reqs[rid]
        tail = cur[len(cur) - k:]
        del cur[len(cur) - k:]
        self.a.free(torch.tensor(tail, dtype=torch.int32))  # int32, as req_to_token stores them

    def check(self) -> None:
        a, ps = self.a, self.a.page_size
        a.check_integrity()
        held = [s for r in self.reqs.values() for s in r]
        assert len(held) == len(set(held)), "a slot is held twice"
        assert a.num_used() == len(held)
        assert all(ps <= s < a.size + ps for s in held), "padding or foreign slot handed out"
        page_owner = {}
        for rid, r in self.reqs.items():
            for pos, s in enumerate(r):
                # pages filled in order: position p sits at offset p % ps of page (block p // ps)
                assert s % ps == pos % ps, f"req {rid} pos {pos} slot {s}: wrong offset in page"
                if pos % ps:
                    assert s == r[pos - 1] + 1, f"req {rid} pos {pos}: page not filled in order"
                assert page_owner.setdefault(s // ps, rid) == rid, "two requests share a page"
        assert a.free_pages == a.num_pages - len(page_owner)
        assert a.available_slots() == a.free_pages * ps


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"ps{p}")
def ps(request) -> int:
    return request.param


@pytest.fixture
def alloc(ps) -> SlotAllocator:
    return SlotAllocator(NUM_PAGES * ps, ps)


# ---- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("size,page_size", [(0, 1), (-4, 4), (10, 4), (2, 4), (8, 0), (8, -1),
                                            (17, 16)])
def test_bad_config_raises(size, page_size):
    """A size that is not a positive multiple of page_size, or page_size < 1, is a ConfigError."""
    with pytest.raises(ConfigError) as e:
        SlotAllocator(size, page_size)
    assert str(page_size) in str(e.value)


def test_fresh_allocator_is_full(alloc, ps):
    """A new allocator has every real slot free and balanced books."""
    alloc.check_integrity()
    assert alloc.is_full()
    assert alloc.available_slots() == alloc.size == NUM_PAGES * ps
    assert alloc.free_pages == alloc.num_pages == NUM_PAGES
    assert alloc.num_used() == 0


# ---- padding and exhaustion ---------------------------------------------------------------------
def test_whole_pool_is_exactly_the_real_slots(alloc, ps):
    """Allocating the whole pool yields exactly slots [ps, size + ps): no padding slot."""
    s = alloc.alloc(alloc.size)
    assert s.dtype == torch.int64 and s.shape == (alloc.size,)
    assert sorted(s.tolist()) == list(range(ps, alloc.size + ps))
    alloc.check_integrity()
    assert alloc.available_slots() == 0 and not alloc.is_full()
    with pytest.raises(OutOfKVMemoryError):
        alloc.alloc(1)


def test_token_by_token_never_padding(alloc, ps):
    """Many one-token requests until the pool is exhausted never get a padding slot."""
    got = []
    while alloc.available_slots():
        got.append(int(alloc.alloc(1)[0]))
    assert len(got) == NUM_PAGES  # one page per request
    assert all(s >= ps and s % ps == 0 for s in got)
    assert sorted(s // ps for s in got) == list(range(1, NUM_PAGES + 1))
    alloc.check_integrity()


def test_alloc_zero_is_noop(alloc):
    """alloc(0) returns an empty int64 tensor and changes nothing."""
    snap = snapshot(alloc)
    s = alloc.alloc(0)
    assert s.numel() == 0 and s.dtype == torch.int64
    assert_same_state(alloc, snap)


def test_alloc_negative_raises(alloc):
    """alloc(-1) raises AllocatorError and changes nothing."""
    snap = snapshot(alloc)
    with pytest.raises(AllocatorError, match="-1"):
        alloc.alloc(-1)
    assert_same_state(alloc, snap)


# ---- out of memory ------------------------------------------------------------------------------
def test_oom_fresh_numbers(alloc, ps):
    """Asking for size + 1 slots raises OutOfKVMemoryError carrying need / free / total."""
    snap = snapshot(alloc)
    with pytest.raises(OutOfKVMemoryError) as e:
        alloc.alloc(alloc.size + 1)
    err = e.value
    assert err.need == (NUM_PAGES + 1) * ps  # whole pages
    assert err.free == alloc.size and err.total == alloc.size
    msg = str(err)
    assert f"need {err.need}" in msg and f"{alloc.size} free" in msg and f"of {alloc.size}" in msg
    assert_same_state(alloc, snap)


def test_oom_after_partial_use(alloc, ps):
    """With some pages held, available_slots() fits and one more slot raises with the numbers."""
    held = alloc.alloc(3 * ps)
    avail = alloc.available_slots()
    assert avail == alloc.size - 3 * ps
    snap = snapshot(alloc)
    with pytest.raises(OutOfKVMemoryError) as e:
        alloc.alloc(avail + 1)
    assert e.value.free == avail and e.value.total == alloc.size
    assert str(avail) in str(e.value)
    assert_same_state(alloc, snap)
    rest = alloc.alloc(avail)
    assert set(rest.tolist()).isdisjoint(held.tolist())
    alloc.check_integrity()


def test_partial_last_page_counts_toward_capacity(ps):
    """A request's partly filled last page is used before new pages: exact fit succeeds."""
    a = SlotAllocator(4 * ps, ps)
    first = a.alloc(1)                       # one page held, ps - 1 free slots inside it
    fits = (ps - 1) + a.available_slots()
    snap = snapshot(a)
    with pytest.raises(OutOfKVMemoryError):
        a.alloc(fits + 1, 1, int(first[0]))
    assert_same_state(a, snap)
    more = a.alloc(fits, 1, int(first[0]))
    assert sorted([int(first[0])] + more.tolist()) == list(range(ps, 5 * ps))
    a.check_integrity()


# ---- free errors ---------------------------------------------------------------------------------
def test_double_free_raises_and_changes_nothing(alloc):
    """Freeing a slot that is already free raises AllocatorError naming it; state unchanged."""
    s = alloc.alloc(3)
    alloc.free(s[1:2])
    snap = snapshot(alloc)
    with pytest.raises(AllocatorError, match=f"double free: slot {int(s[1])}"):
        alloc.free(s[1:2])
    assert_same_state(alloc, snap)


def test_double_free_mixed_batch_is_atomic(alloc):
    """A free call with one good and one already-free slot frees neither."""
    s = alloc.alloc(4)
    alloc.free(s[3:])
    snap = snapshot(alloc)
    with pytest.raises(AllocatorError, match=str(int(s[3]))):
        alloc.free(torch.stack([s[0], s[3]]))
    assert_same_state(alloc, snap)
    assert alloc.num_used() == 3


def test_free_same_slot_twice_in_one_call(alloc):
    """A slot listed twice in one free() raises and changes nothing."""
    s = alloc.alloc(2)
    snap = snapshot(alloc)
    with pytest.raises(AllocatorError, match="twice"):
        alloc.free(torch.stack([s[0], s[0]]))
    assert_same_state(alloc, snap)


def test_free_never_handed_out_real_slot(alloc, ps):
    """Freeing an in-range real slot that was never handed out raises."""
    alloc.alloc(1)
    snap = snapshot(alloc)
    never = alloc.size + ps - 1  # last real slot, untouched on a fresh-ish pool
    with pytest.raises(AllocatorError, match=str(never)):
        alloc.free(slots_t(never))
    assert_same_state(alloc, snap)


@pytest.mark.parametrize("which", ["zero", "pad_last", "size_plus_ps", "far", "negative"])
def test_free_foreign_slot_raises(alloc, ps, which):
    """Padding slots, slots >= size + ps and negative slots are rejected with the valid range."""
    bad = {"zero": 0, "pad_last": ps - 1, "size_plus_ps": alloc.size + ps,
           "far": alloc.size + ps + 1000, "negative": -1}[which]
    good = alloc.alloc(2)
    snap = snapshot(alloc)
    with pytest.raises(AllocatorError) as e:
        alloc.free(torch.cat([good[:1], slots_t(bad)]))
    assert f"slot {bad}" in str(e.value) and f"[{ps}, {alloc.size + ps})" in str(e.value)
    assert_same_state(alloc, snap)


def test_free_empty_is_noop(alloc):
    """free() of an empty tensor changes nothing."""
    alloc.alloc(3)
    snap = snapshot(alloc)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert_same_state(alloc, snap)


# ---- last_slot contract (ps > 1) -----------------------------------------------------------------
@pytest.mark.parametrize("ps", [4, 16])
@pytest.mark.parametrize("last", ["padding", "free_slot", "out_of_range"])
def test_bad_last_slot_raises(ps, last):
    """Growing a partly filled page with a last_slot not in use raises and changes nothing."""
    a = SlotAllocator(4 * ps, ps)
    s = a.alloc(2)
    bad = {"padding": 0, "free_slot": int(s[1]) + 1, "out_of_range": 5 * ps}[last]
    snap = snapshot(a)
    with pytest.raises(AllocatorError, match="last_slot"):
        a.alloc(1, 2, bad)
    assert_same_state(a, snap)


@pytest.mark.parametrize("ps", [4, 16])
def test_rejected_alloc_leaks_no_page(ps):
    """Regression: an alloc rejected because in-page slots are in use changes nothing
    (it used to pop free pages before the check and leak them)."""
    a = SlotAllocator(4 * ps, ps)
    s = a.alloc(3)                       # positions 0..2 of page 1
    snap = snapshot(a)
    # wrong seq_len: claims only position 0 is committed, so in-page slots 1..2 are in use
    with pytest.raises(AllocatorError, match="in use"):
        a.alloc(ps + 1, 1, int(s[0]))
    assert_same_state(a, snap)


@pytest.mark.parametrize("ps", [4, 16])
def test_last_slot_inconsistent_with_seq_len_is_rejected(ps):
    """Regression: last_slot % ps must equal (seq_len - 1) % ps; otherwise alloc would run past
    the page end into a page still on the free list."""
    a = SlotAllocator(4 * ps, ps)
    s = a.alloc(ps)                      # page 1 full, last slot at offset ps - 1
    snap = snapshot(a)
    # seq_len=2 says the last page is only 2 / ps full, but last_slot is the page's last slot
    with pytest.raises(AllocatorError):
        a.alloc(2, 2, int(s[-1]))        # hands out slots of page 2 (free) today
    assert_same_state(a, snap)


# ---- random sequences ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_random_ops_keep_books(ps, seed):
    """400 seeded alloc/grow/free-tail/free ops: books, no sharing, in-order pages, full at end."""
    rng = random.Random(seed * 100 + ps)
    a = SlotAllocator(NUM_PAGES * ps, ps)
    m = Model(a)
    counts = dict(new=0, grow=0, tail=0, free=0, oom=0)
    for _ in range(400):
        op = rng.choices(["new", "grow", "tail", "free"], weights=[2, 10, 2, 1])[0]
        if op != "new" and not m.reqs:
            op = "new"
        rid = rng.choice(list(m.reqs)) if m.reqs else None
        if op in ("new", "grow"):
            # mostly token by token, sometimes a chunk (prefill / verify window)
            n = 1 if rng.random() < 0.7 else rng.randint(1, 2 * ps + 3)
            seq_len = 0 if op == "new" else len(m.reqs[rid])
            if a.pages_needed(seq_len, n) > a.free_pages:
                snap = snapshot(a)
                with pytest.raises(OutOfKVMemoryError):
                    m.new(n) if op == "new" else m.grow(rid, n)
                assert_same_state(a, snap)
                counts["oom"] += 1
                # make room: finish the longest request
                m.free_all(max(m.reqs, key=lambda r: len(m.reqs[r])))
            elif op == "new":
                m.new(n)
            else:
                m.grow(rid, n)
        elif op == "tail" and m.reqs[rid]:
            m.free_tail(rid, rng.randint(1, len(m.reqs[rid])))   # e.g. rejected draft tokens
        else:
            op = "free"
            m.free_all(rid)
        counts[op] += 1
        m.check()
    assert min(counts.values()) > 0, counts  # every kind of op (and OOM) was exercised
    for rid in list(m.reqs):
        m.free_all(rid)
        m.check()
    assert a.is_full()
    assert a.available_slots() == a.size and a.num_used() == 0


def test_pages_needed(ps):
    """pages_needed counts only new pages beyond the request's partly filled last one."""
    a = SlotAllocator(4 * ps, ps)
    assert a.pages_needed(0, 0) == 0
    assert a.pages_needed(0, 1) == 1
    assert a.pages_needed(0, ps) == 1
    assert a.pages_needed(0, ps + 1) == 2
    assert a.pages_needed(1, ps - 1) == 0        # fits in the last page
    assert a.pages_needed(1, ps) == 1
    assert a.pages_needed(ps, 1) == 1


def test_freed_page_is_reused(ps):
    """After a request finishes, its pages serve the next request (no leak over many rounds)."""
    a = SlotAllocator(2 * ps, ps)
    for _ in range(50):
        s = a.alloc(2 * ps)
        a.free(s)
        a.check_integrity()
    assert a.is_full()


def test_hand_out_order(ps):
    """A fresh allocator hands out pages 1, 2, 3, ... (a request's slots consecutive); a block
    freed together comes back next, in its own order, before any page freed earlier."""
    a = SlotAllocator(NUM_PAGES * ps, ps)
    first = a.alloc(3 * ps)
    assert first.tolist() == list(range(ps, 4 * ps))
    assert a.free_page_list() == list(range(4, NUM_PAGES + 1))
    second = a.alloc(2 * ps)
    a.free(first[:ps])                      # page 1
    a.free(second)                          # pages 4, 5: the newest free block
    assert a.free_page_list()[:3] == [4, 5, 1]
    assert a.alloc(2 * ps).tolist() == second.tolist()
    assert a.alloc_decode([0], [-1]).tolist() == [ps]      # page 1 next
    a.check_integrity()


def test_integrity_catches_a_corrupt_free_stack():
    """The free pages are a stack of tensors: a duplicate or a page out of range in it, or a
    count that does not balance, is reported by check_integrity."""
    for corrupt in (lambda a: a._stack.__setitem__(0, a._stack[1]),
                    lambda a: a._stack.__setitem__(0, 0),
                    lambda a: setattr(a, "_top", a._top - 1)):
        a = SlotAllocator(NUM_PAGES, 1)
        corrupt(a)
        with pytest.raises(AllocatorError):
            a.check_integrity()


def test_tail_free_returns_only_whole_pages(ps):
    """Freeing a tail returns a page only once none of its slots is in use."""
    a = SlotAllocator(4 * ps, ps)
    s = a.alloc(2 * ps)
    assert a.free_pages == 2
    a.free(s[2 * ps - 1:])                  # one slot of page 2
    assert a.free_pages == (3 if ps == 1 else 2)
    a.free(s[ps:2 * ps - 1])                # rest of page 2
    assert a.free_pages == 3
    a.check_integrity()


# ---- ReqToTokenPool -----------------------------------------------------------------------------
@pytest.fixture
def r2t() -> ReqToTokenPool:
    return ReqToTokenPool(4, 16, extra=5)


def test_r2t_shape_and_dtype(r2t):
    """The table is int32 [R + 1, max_context_len + extra] and starts at zero."""
    t = r2t.req_to_token
    assert t.dtype == torch.int32 and t.shape == (5, 21) and not t.any()
    assert r2t.free_rows == 4
    r2t.check_integrity()


def test_r2t_row_zero_never_handed_out(r2t):
    """Allocating every row yields rows 1..R; the next alloc is OutOfKVMemoryError."""
    rows = [r2t.alloc() for _ in range(4)]
    assert sorted(rows) == [1, 2, 3, 4]
    r2t.check_integrity()
    with pytest.raises(OutOfKVMemoryError) as e:
        r2t.alloc()
    assert e.value.free == 0 and e.value.total == 4
    r2t.check_integrity()


def test_r2t_free_zeroes_and_reuses(r2t):
    """free() zeroes the row and makes it available again."""
    r = r2t.alloc()
    r2t.req_to_token[r, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    r2t.free(r)
    assert not r2t.req_to_token[r].any()
    assert r2t.free_rows == 4
    r2t.check_integrity()
    assert r2t.alloc() in range(1, 5)


@pytest.mark.parametrize("which", ["padding", "past_end", "negative", "free_row"])
def test_r2t_free_bad_row_raises(r2t, which):
    """Freeing row 0, an out-of-range row, or a row not in use raises and changes nothing."""
    r = r2t.alloc()
    bad = {"padding": 0, "past_end": 5, "negative": -1, "free_row": 1 + r % 4}[which]
    before_free, before = r2t.free_rows, r2t.req_to_token.clone()
    with pytest.raises(AllocatorError, match=f"row {bad}"):
        r2t.free(bad)
    assert r2t.free_rows == before_free and torch.equal(r2t.req_to_token, before)
    r2t.check_integrity()


def test_r2t_double_free(r2t):
    """The second free of a row raises AllocatorError and leaves the books balanced."""
    r = r2t.alloc()
    r2t.free(r)
    with pytest.raises(AllocatorError, match=f"row {r}"):
        r2t.free(r)
    assert r2t.free_rows == 4
    r2t.check_integrity()


def test_r2t_integrity_catches_padding_write(r2t):
    """check_integrity raises when padding row 0 was written."""
    r2t.req_to_token[0, 3] = 11
    with pytest.raises(AllocatorError, match="row 0"):
        r2t.check_integrity()


def test_r2t_integrity_catches_lost_row(r2t):
    """check_integrity raises with the counts when a row disappears from the books."""
    r2t._free_rows.pop()
    with pytest.raises(AllocatorError, match="3 free \\+ 0 used != 4"):
        r2t.check_integrity()


@pytest.mark.parametrize("R,C", [(0, 16), (4, 0), (-1, 16)])
def test_r2t_bad_config(R, C):
    """max_running_requests < 1 or max_context_len < 1 is a ConfigError."""
    with pytest.raises(ConfigError):
        ReqToTokenPool(R, C)


def test_r2t_random_ops():
    """300 seeded alloc/free ops never hand out row 0 or a row twice, and end full."""
    rng = random.Random(7)
    p = ReqToTokenPool(6, 8)
    held: set[int] = set()
    for _ in range(300):
        if held and (rng.random() < 0.45 or p.free_rows == 0):
            r = rng.choice(sorted(held))
            held.remove(r)
            p.free(r)
        else:
            r = p.alloc()
            assert 1 <= r <= 6 and r not in held
            held.add(r)
            p.req_to_token[r, rng.randrange(8)] = rng.randint(1, 100)
        p.check_integrity()
        assert p.free_rows == 6 - len(held)
    for r in sorted(held):
        p.free(r)
    p.check_integrity()
    assert p.free_rows == 6 and not p.req_to_token.any()


# ---- the decode batch in one call ----------------------------------------------------------------
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alloc_decode_equals_one_by_one(ps, seed):
    """alloc_decode over a batch hands out what n alloc(1) calls would (the same slots when the
    free pages are taken in the same order) and leaves the same books."""
    rng = random.Random(seed)
    a, b = SlotAllocator(64 * ps, ps), SlotAllocator(64 * ps, ps)
    lens = [rng.randint(1, 2 * ps) for _ in range(4)]
    last = []
    for n in lens:                      # the same prefills on both
        s1, s2 = a.alloc(n), b.alloc(n)
        assert torch.equal(s1, s2)
        last.append(int(s1[-1]))
    for _ in range(2 * ps + 1):         # decode steps, across page ends
        batch = a.alloc_decode(lens, last)
        one = torch.cat([b.alloc(1, n, s) for n, s in zip(lens, last)])
        assert torch.equal(batch, one)
        lens = [n + 1 for n in lens]
        last = batch.tolist()
        assert_same_state(a, snapshot(b))


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_decode_out_of_memory_takes_nothing(ps):
    a = SlotAllocator(2 * ps, ps)
    s = a.alloc(ps)                     # page 1 full
    t = a.alloc(ps)                     # page 2 full: both requests need a new page
    snap = snapshot(a)
    with pytest.raises(OutOfKVMemoryError):
        a.alloc_decode([ps, ps], [int(s[-1]), int(t[-1])])
    assert_same_state(a, snap)


@pytest.mark.parametrize("ps", [4, 16])
@pytest.mark.parametrize("last", ["padding", "free_slot", "out_of_range", "wrong_offset"])
def test_alloc_decode_bad_last_slot_raises(ps, last):
    a = SlotAllocator(4 * ps, ps)
    s = a.alloc(2)
    bad = {"padding": 0, "free_slot": int(s[1]) + 1, "out_of_range": 5 * ps,
           "wrong_offset": int(s[0])}[last]
    snap = snapshot(a)
    with pytest.raises(AllocatorError, match="last_slot"):
        a.alloc_decode([2], [bad])
    assert_same_state(a, snap)


def test_alloc_rows_takes_distinct_free_slots_all_or_nothing():
    a = SlotAllocator(16, 1)
    first = a.alloc(3)
    rows = a.alloc_rows(4, 3)                          # 4 requests x 3 slots
    assert rows.shape == (4, 3)
    taken = torch.cat([first, rows.view(-1)])
    assert taken.unique().numel() == 15 and bool((taken >= 1).all())
    assert a.available_slots() == 1
    with pytest.raises(OutOfKVMemoryError):
        a.alloc_rows(1, 2)                             # 2 > 1 free: nothing taken
    assert a.available_slots() == 1
    a.free(rows.view(-1))
    a.free(first)
    a.check_integrity()
    assert a.available_slots() == 16
    with pytest.raises(AllocatorError, match="page_size 1"):
        SlotAllocator(16, 4).alloc_rows(1, 2)


def _twins(ps: int, size: int, seed: int):
    """Two allocators in the same state: requests of random lengths, some freed."""
    rng = random.Random(seed)
    pair = [SlotAllocator(size, ps), SlotAllocator(size, ps)]
    reqs = []
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 3 * ps + 1)
        if n // ps + 2 > pair[0].free_pages:
            break
        slots = [a.alloc(n) for a in pair]
        reqs.append((n, int(slots[0][-1])))
    if len(reqs) > 1:           # free one: its pages go back to the top of the stack
        n, _ = reqs.pop(rng.randrange(len(reqs)))
    return pair, reqs


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(12))
def test_decode_steps_equal_successive_decode_allocs(ps, seed):
    """`alloc_decode_steps(seq, last, m)` gives, row for row, what m successive
    `alloc_decode` calls give (each from the step before), and stops at the last step that
    fits when the pages run out, as the chain's loop of calls did; the books agree."""
    size = 64 * ps if seed % 3 else 12 * ps                  # some pools run out mid-chain
    (a, b), reqs = _twins(ps, size, seed)
    if not reqs:
        pytest.skip("no request fitted")
    m = random.Random(seed).randint(1, 3 * ps + 2)
    seq, last = [n for n, _ in reqs], [s for _, s in reqs]
    got = a.alloc_decode_steps(seq, last, m)
    want = []
    for _ in range(m):
        try:
            s = b.alloc_decode(seq, last)
        except OutOfKVMemoryError:
            break
        want.append(s)
        seq, last = [x + 1 for x in seq], s.tolist()
    assert got.shape == (len(want), len(reqs))
    if want:
        assert torch.equal(got, torch.stack(want))
    assert a.free_page_list() == b.free_page_list()
    assert torch.equal(a.used_slots(), b.used_slots())
    a.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_decode_steps_refuse_a_bad_last_slot_and_take_nothing(ps):
    alloc = SlotAllocator(32 * ps, ps)
    s = alloc.alloc(3)
    before = (alloc.free_page_list(), alloc.used_slots())
    if ps > 1:
        with pytest.raises(AllocatorError, match="last_slot"):
            alloc.alloc_decode_steps([3], [int(s[-1]) + 1], 5)     # not the in-use last slot
        assert (alloc.free_page_list(), alloc.used_slots().tolist()) == (
            before[0], before[1].tolist())
    assert alloc.alloc_decode_steps([3], [int(s[-1])], 0).shape == (0, 1)
    assert alloc.alloc_decode_steps([], [], 4).shape == (0, 0)
