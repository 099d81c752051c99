"""Triton draft KV indexing equals the PyTorch reference; bad rows, positions and slots are
never dereferenced or written and raise KVIndexError (at once, or at raise_if_error inside a
guard step). Runs on the GPU when there is one, else under TRITON_INTERPRET=1 (tiny shapes)."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
triton = pytest.importorskip("triton")

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels.guard import kv_guard  # noqa: E402
from eaglekv.kernels.draft_kv_indices import (  # noqa: E402
    assign_draft_cache_locs, assign_draft_cache_locs_torch, draft_kv_indices_used_len,
    draft_region_extra, draft_token_positions, draft_token_positions_torch,
    generate_draft_decode_kv_indices, generate_draft_decode_kv_indices_torch)

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
SWEEP = list(itertools.product([1, 3], [1, 2, 4], [1, 3, 5], [1, 4, 16]))   # B, K, S, ps
LIMIT = 5000


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


def case(B, K, S, ps, R=6, seed=0):
    """Lengths around page edges (and one past the 256-element loop block on the GPU), rows,
    and a table of valid slots (some entries are never read; they hold valid slots too)."""
    rng = random.Random(hash((B, K, S, ps, seed)))
    big = 300 if ON_GPU else 40
    lens = [rng.choice([0, ps - 1, ps, 2 * ps + 1, rng.randint(1, big)]) for _ in range(B)]
    rows = rng.sample(range(1, R), B)
    W = max(lens) + draft_region_extra(K, S, ps) + 1
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, LIMIT, (R, W), generator=g, dtype=torch.int32)
    return lens, rows, table


def tensors(lens, rows):
    return torch.tensor(rows, device=DEV), torch.tensor(lens, device=DEV)


@pytest.mark.parametrize("B,K,S,ps", SWEEP)
def test_positions_match_reference(B, K, S, ps):
    lens, _, _ = case(B, K, S, ps)
    L = torch.tensor(lens, device=DEV, dtype=torch.int32)
    assert torch.equal(draft_token_positions(L, K, S, ps).cpu(),
                       draft_token_positions_torch(L.cpu(), K, S, ps))


@pytest.mark.parametrize("B,K,S,ps", SWEEP)
def test_assign_matches_reference(B, K, S, ps):
    lens, rows, table = case(B, K, S, ps)
    loc = torch.randperm(B * K * S) + 7
    copy = (torch.randint(0, LIMIT, (B, K - 1, ps)) if ps > 1 and K > 1 else None)
    want = table.clone()
    assign_draft_cache_locs_torch(want, *[x.cpu() for x in tensors(lens, rows)], loc, K, S, ps,
                                  copy)
    got = table.to(DEV)
    assign_draft_cache_locs(got, *tensors(lens, rows), loc.to(DEV), K, S, ps,
                            None if copy is None else copy.to(DEV))
    assert torch.equal(got.cpu(), want)


def run_both(lens, rows, table, K, S, ps, kv_dtype, width=None):
    B = len(lens)
    used = draft_kv_indices_used_len(sum(lens), K, B * K, S)
    width = used + 3 if width is None else width
    out = []
    for fn, dev in ((generate_draft_decode_kv_indices_torch, "cpu"),
                    (generate_draft_decode_kv_indices, DEV)):
        kv = torch.full((S, width), -3, dtype=kv_dtype, device=dev)
        ip = torch.full((S, B * K + 2), -4, dtype=torch.int32, device=dev)
        r, L = torch.tensor(rows, device=dev), torch.tensor(lens, device=dev)
        fn(table.to(dev), r, L, K, S, ps, kv, ip, LIMIT, seq_lens_sum=sum(lens))
        out.append((kv.cpu(), ip.cpu()))
    return out


@pytest.mark.parametrize("B,K,S,ps", SWEEP)
def test_decode_kv_indices_match_reference(B, K, S, ps):
    kv_dtype = torch.int64 if (B + K + S + ps) % 2 else torch.int32   # both, over the sweep
    lens, rows, table = case(B, K, S, ps)
    (rk, rp), (gk, gp) = run_both(lens, rows, table, K, S, ps, kv_dtype)
    assert gk.dtype == kv_dtype
    assert torch.equal(gk, rk) and torch.equal(gp, rp)


@pytest.mark.parametrize("kv_dtype", [torch.int32, torch.int64])
def test_decode_int64_table_and_strided_kv(kv_dtype):
    lens, rows, table = case(3, 2, 3, 4, seed=1)
    table = table.to(torch.int64)
    (rk, rp), (gk, gp) = run_both(lens, rows, table, 2, 3, 4, kv_dtype)
    assert torch.equal(gk, rk) and torch.equal(gp, rp)


@pytest.mark.parametrize("bad", [-1, LIMIT, 2**40])
def test_decode_bad_slot_is_zeroed_and_raises(bad):
    B, K, S, ps = 3, 2, 3, 4
    lens, rows = [5, 13, 8], [4, 1, 2]
    table = torch.randint(0, LIMIT, (6, 13 + draft_region_extra(K, S, ps)))   # int64
    table[rows[1], 16] = bad                    # request 1, branch 1's copied partial page
    table[rows[2], 8 + 4 + 2] = bad             # request 2, branch 1's last draft slot
    kv = torch.zeros(S, 64 * K + B * K * S, dtype=torch.int32, device=DEV)
    ip = torch.zeros(S, B * K + 1, dtype=torch.int32, device=DEV)
    with pytest.raises(KVIndexError, match=rf"slot {bad} out of range \[0, {LIMIT}\) in draft "
                                           rf"kv_indices \(2 of {table.numel()} indices bad\)"):
        generate_draft_decode_kv_indices(table.to(DEV), *tensors(lens, rows), K, S, ps, kv, ip,
                                         LIMIT)
    assert bool(((kv >= 0) & (kv < LIMIT)).all())
    # everything else is what the reference writes for the same table with the bad slots at 0
    ref_kv, ref_ip = torch.zeros_like(kv.cpu()), torch.zeros_like(ip.cpu())
    generate_draft_decode_kv_indices_torch(table.masked_fill(table == bad, 0),
                                           *[x.cpu() for x in tensors(lens, rows)], K, S, ps,
                                           ref_kv, ref_ip, LIMIT)
    assert torch.equal(kv.cpu(), ref_kv) and torch.equal(ip.cpu(), ref_ip)


def test_assign_bad_position_writes_nothing_and_raises():
    B, K, S, ps = 3, 2, 3, 4
    lens, rows = [0, 17, 19], [1, 2, 3]
    table = torch.full((6, 24), -7, dtype=torch.int32, device=DEV)
    loc = torch.arange(B * K * S, device=DEV)
    copy = torch.arange(B * (K - 1) * ps, device=DEV).view(B, K - 1, ps)
    with pytest.raises(KVIndexError, match=r"slot 27 out of range \[0, 24\) in "
                                           r"assign_draft_cache_locs position \(3 of 18 indices"):
        assign_draft_cache_locs(table, *tensors(lens, rows), loc, K, S, ps, copy)
    assert (table == -7).all()
    with pytest.raises(KVIndexError, match=r"slot -1 out of range \[0, 6\) in "
                                           r"assign_draft_cache_locs req_pool_indices"):
        assign_draft_cache_locs(table, *tensors([0, 0, 0], [1, -1, 2]), loc, K, S, ps, copy)
    assert (table == -7).all()


def test_decode_bad_row_and_column_raise():
    B, K, S, ps = 3, 2, 3, 4
    lens, rows, table = case(B, K, S, ps)
    kv = torch.zeros(S, 4096, dtype=torch.int32, device=DEV)
    ip = torch.zeros(S, B * K + 1, dtype=torch.int32, device=DEV)
    with pytest.raises(KVIndexError, match=r"slot 9 out of range \[0, 6\) in draft kv_indices "
                                           r"req_pool_indices \(1 of 3"):
        generate_draft_decode_kv_indices(table.to(DEV), *tensors(lens, [rows[0], 9, rows[2]]),
                                         K, S, ps, kv, ip, LIMIT)
    W = table.shape[1]
    with pytest.raises(KVIndexError, match=rf"slot {W} out of range \[0, {W}\) in draft "
                                           rf"kv_indices req_to_token column \(4 of 18"):
        generate_draft_decode_kv_indices(table.to(DEV), *tensors([0, W - 2, 0], rows), K, S,
                                         ps, kv, ip, LIMIT)
    assert bool(((kv >= 0) & (kv < LIMIT)).all())


def test_deferred_decode_error_waits_for_raise_if_error():
    B, K, S, ps = 1, 2, 1, 1
    table = torch.arange(12, dtype=torch.int32, device=DEV).view(2, 6)
    table[1, 2] = LIMIT + 3
    kv = torch.zeros(S, 16, dtype=torch.int32, device=DEV)
    ip = torch.zeros(S, 3, dtype=torch.int32, device=DEV)
    guard = kv_guard(DEV)
    with guard.step():
        generate_draft_decode_kv_indices(table, *tensors([3], [1]), K, S, ps, kv, ip, LIMIT,
                                         seq_lens_sum=3)
    with pytest.raises(KVIndexError, match=rf"slot {LIMIT + 3} out of range \[0, {LIMIT}\) in "
                                           r"draft kv_indices \(1 of 12 indices bad\)"):
        guard.raise_if_error()
    guard.raise_if_error()     # cleared
    # branch 0: slots 6, 7, 0 (bad -> 0), then draft 9; branch 1: 6, 7, 0, then draft 10
    assert kv[0, :8].tolist() == [6, 7, 0, 9, 6, 7, 0, 10] and ip[0].tolist() == [0, 4, 8]


@pytest.mark.parametrize("B,K,S,ps", [(3, 1, 5, 1), (3, 2, 3, 4), (1, 4, 3, 16)])
def test_unchecked_kernels_equal_the_reference(B, K, S, ps):
    """`guard.unchecked()` compiles both draft-index kernels with CHECK=False (the bench's
    measure of what the checks cost): on valid rows, positions and slots they write what the
    reference writes."""
    from eaglekv.kernels import guard
    lens, rows, table = case(B, K, S, ps, seed=2)
    loc = torch.randperm(B * K * S) + 7
    copy = (torch.randint(0, LIMIT, (B, K - 1, ps)) if ps > 1 and K > 1 else None)
    want = table.clone()
    assign_draft_cache_locs_torch(want, *[x.cpu() for x in tensors(lens, rows)], loc, K, S, ps,
                                  copy)
    got = table.to(DEV)
    with guard.unchecked():
        assign_draft_cache_locs(got, *tensors(lens, rows), loc.to(DEV), K, S, ps,
                                None if copy is None else copy.to(DEV))
        (rk, rp), (gk, gp) = run_both(lens, rows, table, K, S, ps, torch.int32)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(gk, rk) and torch.equal(gp, rp)
