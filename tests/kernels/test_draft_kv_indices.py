"""Draft KV indexing (PyTorch reference / CPU path) against naive loops written straight from
the formulas of DESIGN.md ("Draft KV indices"), plus the guards: int32 width bound, used
length, positions past the table width, bad rows and out-of-range slots."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from eaglekv.errors import ConfigError, KVIndexError
from eaglekv.kernels.draft_kv_indices import (
    assign_draft_cache_locs, check_draft_kv_indices_fit, draft_kv_indices_buffer_width,
    draft_kv_indices_used_len, draft_region_extra, draft_token_positions,
    generate_draft_decode_kv_indices)

SWEEP = list(itertools.product([1, 3], [1, 2, 4], [1, 3, 5], [1, 4, 16]))   # B, K, S, ps


# ------------------------------------------------------------------ naive references

def naive_pos(L, t, s, K, S, ps):
    if ps == 1 or K == 1:
        return L + t * S + s
    last = L % ps
    npp = math.ceil((last + S) / ps)
    start = (L // ps) * ps + t * npp * ps + last
    return start + s


def naive_region_start(L, t, S, ps):
    last = L % ps
    npp = math.ceil((last + S) / ps)
    return (L // ps) * ps + t * npp * ps


def naive_decode(table, rows, lens, K, S, ps):
    """-> (kv rows, indptr rows) per step, as Python lists."""
    B, kv, ip = len(lens), [], []
    for step in range(S):
        it = step + 1
        row_vals, ptr = [], []
        for b in range(B):
            L, r = lens[b], table[rows[b]]
            for t in range(K):
                off = K * sum(lens[:b]) + b * it * K + t * (L + it)
                assert off == len(row_vals)
                ptr.append(off)
                if ps == 1 or K == 1 or t == 0:
                    prefix = r[:L]
                else:
                    last, rs = L % ps, naive_region_start(L, t, S, ps)
                    prefix = r[:L - last] + r[rs:rs + last]
                row_vals += prefix + [r[naive_pos(L, t, s, K, S, ps)] for s in range(it)]
        ptr.append(K * sum(lens) + B * K * it)
        kv.append(row_vals)
        ip.append(ptr)
    return kv, ip


def naive_reads(rows, lens, K, S, ps):
    """Every (row, col) the decode reads."""
    out = set()
    for b, L in enumerate(lens):
        for t in range(K):
            out.update((rows[b], c) for c in range(L if (ps == 1 or K == 1 or t == 0)
                                                   else L - L % ps))
            if ps > 1 and K > 1 and t > 0:
                rs = naive_region_start(L, t, S, ps)
                out.update((rows[b], rs + j) for j in range(L % ps))
            out.update((rows[b], naive_pos(L, t, s, K, S, ps)) for s in range(S))
    return out


def case(B, K, S, ps, seed=0, R=6):
    rng = random.Random(hash((B, K, S, ps, seed)))
    lens = [rng.choice([0, ps, 2 * ps - 1, rng.randint(1, 40)]) for _ in range(B)]
    rows = rng.sample(range(1, R), B)
    W = max(lens) + draft_region_extra(K, S, ps)
    return lens, rows, R, W


# ------------------------------------------------------------------ formulas and bounds

def test_buffer_width_and_used_len_examples():
    assert draft_kv_indices_buffer_width(4, 3, 256) == 3072
    assert draft_kv_indices_used_len(100, 2, 8, 3) == 224


def test_buffer_width_overflow_names_the_numbers():
    with pytest.raises(ConfigError, match=r"kv_indices flat offset would overflow int32.*"
                                          r"1048576 \* 4 \* 1024 = 4294967296 >= 2\*\*31 = "
                                          r"2147483648"):
        draft_kv_indices_buffer_width(2**20, 4, 2**10)
    assert draft_kv_indices_buffer_width(2**20, 2, 2**10 - 1) < 2**31
    with pytest.raises(ConfigError, match=r"= 2147483648 >= 2\*\*31"):
        draft_kv_indices_buffer_width(2**21, 1, 2**10)   # exactly 2**31 is already too wide
    for bad in [(0, 1, 1), (1, -2, 1), (1, 1, 0)]:
        with pytest.raises(ConfigError, match="must be >= 1"):
            draft_kv_indices_buffer_width(*bad)


def test_used_len_past_width_raises():
    check_draft_kv_indices_fit(224, 224)
    with pytest.raises(KVIndexError, match=r"slot 225 out of range \[0, 224\) in draft "
                                           r"kv_indices \(1 of 225 indices bad\)") as e:
        check_draft_kv_indices_fit(225, 224)
    assert (e.value.first_bad, e.value.limit) == (225, 224)


@pytest.mark.parametrize("K,S,ps", list(itertools.product([1, 2, 4], [1, 3, 5], [1, 4, 16])))
def test_region_extra_is_the_worst_case(K, S, ps):
    extra = draft_region_extra(K, S, ps)
    need = [naive_pos(L, K - 1, S - 1, K, S, ps) + 1 - L for L in range(3 * ps + 1)]
    assert max(need) == extra


# ------------------------------------------------------------------ positions

@pytest.mark.parametrize("B,K,S,ps", SWEEP)
def test_positions_match_naive(B, K, S, ps):
    lens, _, _, _ = case(B, K, S, ps)
    got = draft_token_positions(torch.tensor(lens), K, S, ps)
    want = [[[naive_pos(L, t, s, K, S, ps) for s in range(S)] for t in range(K)] for L in lens]
    assert got.dtype == torch.int64 and got.tolist() == want


# ------------------------------------------------------------------ assign

def assign_case(B, K, S, ps, W=None, dtype=torch.int32):
    lens, rows, R, W0 = case(B, K, S, ps)
    W = W0 if W is None else W
    table = torch.full((R, W), -7, dtype=dtype)
    loc = torch.randperm(B * K * S) + 100                            # (B*K*S,) [b][t][s]
    copy = (torch.randperm(B * max(K - 1, 1) * ps)[:B * (K - 1) * ps].view(B, K - 1, ps) + 5000
            if ps > 1 and K > 1 else None)
    return lens, rows, table, loc, copy


@pytest.mark.parametrize("B,K,S,ps", SWEEP)
def test_assign_writes_exactly_the_formula_positions(B, K, S, ps):
    lens, rows, table, loc, copy = assign_case(B, K, S, ps)
    want = table.clone()
    for b, L in enumerate(lens):
        for t in range(K):
            for s in range(S):
                want[rows[b], naive_pos(L, t, s, K, S, ps)] = int(loc[(b * K + t) * S + s])
            if copy is not None and t > 0:
                for j in range(L % ps):
                    want[rows[b], naive_region_start(L, t, S, ps) + j] = int(copy[b, t - 1, j])
    assign_draft_cache_locs(table, torch.tensor(rows), torch.tensor(lens), loc, K, S, ps, copy)
    assert torch.equal(table, want)


def test_assign_position_past_width_writes_nothing():
    B, K, S, ps = 3, 2, 3, 4
    lens, rows, table, loc, copy = assign_case(B, K, S, ps, W=24)
    lens[0] = 0
    lens[1] = 17      # last=1, npp=1: positions 17..19 and 21..23 fit
    lens[2] = 19      # last=3, npp=2: branch 1 at 19+8 = 27.. is past W = 24
    before = table.clone()
    with pytest.raises(KVIndexError, match=r"slot 27 out of range \[0, 24\) in "
                                           r"assign_draft_cache_locs position \(3 of 18 indices"):
        assign_draft_cache_locs(table, torch.tensor(rows), torch.tensor(lens), loc, K, S, ps,
                                copy)
    assert torch.equal(table, before)
    with pytest.raises(KVIndexError, match=r"slot 6 out of range \[0, 6\) in "
                                           r"assign_draft_cache_locs req_pool_indices"):
        assign_draft_cache_locs(table, torch.tensor([1, 6, 2]), torch.tensor([0, 0, 0]), loc,
                                K, S, ps, copy)
    assert torch.equal(table, before)


def test_assign_rejects_bad_arguments():
    lens, rows, table, loc, copy = assign_case(2, 2, 3, 4)
    args = (table, torch.tensor(rows), torch.tensor(lens))
    with pytest.raises(ValueError, match=r"need prefix_copy_locs of shape \(B, K-1, ps\)"):
        assign_draft_cache_locs(*args, loc, 2, 3, 4)
    with pytest.raises(ValueError, match="only used when page_size > 1 and topk > 1"):
        assign_draft_cache_locs(*args, loc, 2, 3, 1, copy)
    with pytest.raises(ValueError, match="expected B\\*K\\*S"):
        assign_draft_cache_locs(*args, loc[:-1], 2, 3, 4, copy)


# ------------------------------------------------------------------ decode kv indices

def decode_tables(B, K, S, ps, dtype=torch.int32, size_limit=10_000):
    """A table whose read entries hold distinct valid slots and every other entry -1 (so a
    read of a wrong entry shows up as an error)."""
    lens, rows, R, W = case(B, K, S, ps)
    table = torch.full((R, W), -1, dtype=dtype)
    reads = sorted(naive_reads(rows, lens, K, S, ps))
    vals = torch.randperm(size_limit)[:len(reads)]
    for (r, c), v in zip(reads, vals.tolist()):
        table[r, c] = v
    return lens, rows, table, size_limit


def run_decode(table, rows, lens, K, S, ps, size_limit, kv_dtype=torch.int32, width=None,
               fn=generate_draft_decode_kv_indices):
    B = len(lens)
    used = draft_kv_indices_used_len(sum(lens), K, B * K, S)
    width = used + 5 if width is None else width
    kv = torch.full((S, width), -3, dtype=kv_dtype)
    ip = torch.full((S, B * K + 2), -4, dtype=torch.int32)
    fn(table, torch.tensor(rows), torch.tensor(lens), K, S, ps, kv, ip, size_limit)
    return kv, ip


@pytest.mark.parametrize("B,K,S,ps", SWEEP)
@pytest.mark.parametrize("kv_dtype", [torch.int32, torch.int64])
def test_decode_kv_indices_match_naive(B, K, S, ps, kv_dtype):
    lens, rows, table, limit = decode_tables(B, K, S, ps)
    kv, ip = run_decode(table, rows, lens, K, S, ps, limit, kv_dtype)
    want_kv, want_ip = naive_decode(table.tolist(), rows, lens, K, S, ps)
    for step in range(S):
        n = len(want_kv[step])
        assert kv[step, :n].tolist() == want_kv[step]
        assert (kv[step, n:] == -3).all()                       # the tail is untouched
        assert ip[step, :B * K + 1].tolist() == want_ip[step]
        assert ip[step, B * K + 1] == -4
        assert n == draft_kv_indices_used_len(sum(lens), K, B * K, step + 1)


def test_decode_sees_the_assigned_slots_and_copied_pages():
    """assign then decode: branch t >= 1 sees the prefix's full pages, then its copy of the
    partial page, then its own drafts."""
    B, K, S, ps = 2, 3, 2, 4
    lens, rows, R = [6, 9], [1, 3], 4
    W = max(lens) + draft_region_extra(K, S, ps)
    table = torch.zeros(R, W, dtype=torch.int32)
    for b, L in enumerate(lens):
        table[rows[b], :L] = torch.arange(L) + 100 * (b + 1)
    loc = torch.arange(B * K * S) + 1000
    copy = torch.arange(B * (K - 1) * ps).view(B, K - 1, ps) + 2000
    assign_draft_cache_locs(table, torch.tensor(rows), torch.tensor(lens), loc, K, S, ps, copy)
    kv, ip = run_decode(table, rows, lens, K, S, ps, 5000)
    seg = kv[S - 1, ip[S - 1, 4]:ip[S - 1, 5]].tolist()     # request 1, branch 1
    assert seg == [200 + i for i in range(8)] + [2000 + 8 + 0] + [1000 + 8, 1000 + 9]


@pytest.mark.parametrize("bad", [-1, 10_000, 2**40])
@pytest.mark.parametrize("where", ["prefix", "draft", "copied page"])
def test_decode_out_of_range_slot_raises(bad, where):
    B, K, S, ps, R, limit = 3, 2, 3, 4, 6, 10_000
    lens, rows = [5, 13, 8], [4, 1, 2]                 # request 1: last = 1, npp = 1
    W = max(lens) + draft_region_extra(K, S, ps)
    table = torch.randperm(limit)[:R * W].view(R, W)    # int64, every entry valid
    L = lens[1]
    col = {"prefix": 2, "draft": naive_pos(L, 1, 2, K, S, ps),
           "copied page": naive_region_start(L, 1, S, ps)}[where]
    table[rows[1], col] = bad
    with pytest.raises(KVIndexError, match=rf"slot {bad} out of range \[0, {limit}\) in draft "
                                           rf"kv_indices \(1 of {R * W} indices bad\)"):
        run_decode(table, rows, lens, K, S, ps, limit)


def test_decode_bad_entries_that_are_not_read_are_fine_and_kv_stays_in_range():
    lens, rows, table, limit = decode_tables(3, 4, 3, 16)
    kv, _ = run_decode(table, rows, lens, 4, 3, 16, limit)    # the -1 entries are never read
    table[rows[0], 0] = limit
    kv2 = torch.zeros_like(kv)
    ip = torch.zeros(3, 13, dtype=torch.int32)
    with pytest.raises(KVIndexError):
        generate_draft_decode_kv_indices(table, torch.tensor(rows), torch.tensor(lens), 4, 3,
                                         16, kv2, ip, limit)
    assert not (kv2 == limit).any() and bool(((kv2 >= 0) & (kv2 < limit)).all())


def test_decode_guards_width_rows_and_columns():
    B, K, S, ps = 3, 2, 3, 4
    lens, rows, table, limit = decode_tables(B, K, S, ps)
    used = draft_kv_indices_used_len(sum(lens), K, B * K, S)
    with pytest.raises(KVIndexError, match=rf"slot {used} out of range \[0, {used - 1}\) in "
                                           rf"draft kv_indices \(1 of {used}"):
        run_decode(table, rows, lens, K, S, ps, limit, width=used - 1)
    with pytest.raises(KVIndexError, match=r"slot 6 out of range \[0, 6\) in draft kv_indices "
                                           r"req_pool_indices"):
        run_decode(table, [rows[0], 6, rows[2]], lens, K, S, ps, limit)
    W = table.shape[1]
    lens2 = [0, W - 2, 0]
    with pytest.raises(KVIndexError, match=rf"slot {W} out of range \[0, {W}\) in draft "
                                           rf"kv_indices req_to_token column"):
        run_decode(table, rows, lens2, K, S, ps, limit)
