"""Guarded KV row moves: equal a naive copy, reject any out-of-range src or dst before writing
(CPU) or redirect it to the padding slot and raise at the step's sync (CUDA)."""

from __future__ import annotations

import pytest
import torch

from eaglekv.errors import KVIndexError
from eaglekv.memory import KVPool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def filled_pool(device, size=12, ps=4):
    pool = KVPool(size, ps, num_layers=2, kv_heads=2, head_dim=8, device=device)
    for i, buf in enumerate(pool.k_buffer + pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(i)).to(device))
    return pool


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_move_equals_naive_copy(device, idx_dtype):
    pool = filled_pool(device)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    src = torch.tensor([4, 9, 15, 5], dtype=idx_dtype, device=device)
    dst = torch.tensor([5, 6, 4, 15], dtype=idx_dtype, device=device)  # overlaps src
    pool.move_kv(dst, src)
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        ref = old.clone()
        for d, s in zip(dst.tolist(), src.tolist()):
            ref[d] = old[s]
        assert torch.equal(new, ref)


@pytest.mark.parametrize("which", ["src", "dst"])
@pytest.mark.parametrize("bad", [-1, 16, 10**9])
def test_out_of_range_move_writes_nothing_on_cpu(which, bad):
    pool = filled_pool("cpu")
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    good = torch.tensor([4, 5])
    badt = torch.tensor([6, bad])
    src, dst = (badt, good) if which == "src" else (good, badt)
    with pytest.raises(KVIndexError, match=rf"slot {bad} out of range \[0, 16\) in move_kv {which}"):
        pool.move_kv(dst, src)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_out_of_range_move_is_deferred_on_gpu():
    """Inside a step: no exception until raise_if_error; only valid rows and the padding slot
    are touched; the error names the first bad index."""
    from eaglekv.kernels.guard import kv_guard
    pool = filled_pool("cuda")
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    guard = kv_guard("cuda")
    with guard.step():
        pool.move_kv(torch.tensor([5, 10**9], device="cuda"), torch.tensor([4, 6], device="cuda"))
    with pytest.raises(KVIndexError, match=r"slot 1000000000 out of range \[0, 16\) in move_kv dst"):
        guard.raise_if_error()
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        changed = (old != new).flatten(1).any(1).nonzero().view(-1).tolist()
        assert set(changed) <= {0, 5}


@pytest.mark.parametrize("device", DEVICES)
def test_pool_move_is_the_per_layer_move(device):
    """KVPool keeps its layers in one tensor and moves rows across all of them in two ops
    (move_kv_stacked): the same result as move_kv over the per-layer buffers."""
    from eaglekv.kernels.move_kv import move_kv
    a, b = filled_pool(device), filled_pool(device)
    assert all(x.data_ptr() == a.kv[0, i].data_ptr() for i, x in enumerate(a.k_buffer))
    src = torch.tensor([[4, 9], [15, 5]], device=device)
    dst = torch.tensor([[5, 6], [4, 15]], device=device)
    a.move_kv(dst, src)
    move_kv(b.k_buffer, b.v_buffer, dst, src, b.size_limit)
    assert torch.equal(a.kv, b.kv)
