"""The guard's range check in one Triton launch (`guard_triton.guard_range_triton`, what
`guard_indices` runs on CUDA) equals its torch-op reference (`guard.guard_range_torch`): the
safe copy, the count, the first bad key and the value it names (recorded on the device, since
a chain of captured steps may overwrite the indices before the sync), over index dtypes, sizes across the block edge,
lower bounds 0 and -1, and an error buffer that already holds an earlier error. Runs on the GPU
when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
triton = pytest.importorskip("triton")

from eaglekv.kernels import guard  # noqa: E402
from eaglekv.kernels.guard_triton import (  # noqa: E402
    BLOCK, ONE_PROGRAM_MAX, guard_range_triton)

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []


def both(flat, low, limit, err0, key_base):
    out = []
    for fn in (guard.guard_range_torch, guard_range_triton):
        err = torch.tensor(err0, dtype=torch.int64, device=DEV)
        safe = fn(flat.to(DEV), low, limit, err, key_base)
        out.append((safe.cpu(), err.cpu()))
    return out


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 7, BLOCK, BLOCK + 3])
@pytest.mark.parametrize("low", [0, -1])
@pytest.mark.parametrize("bad_at", [None, "first", "last", "several"])
def test_triton_guard_equals_reference(dtype, n, low, bad_at):
    limit = 50
    g = torch.Generator().manual_seed(n + low)
    flat = torch.randint(low, limit, (n,), generator=g).to(dtype)
    if bad_at == "first":
        flat[0] = limit
    elif bad_at == "last":
        flat[-1] = low - 1
    elif bad_at == "several":
        flat[n // 2:: 3] = limit + 7
        flat[-1] = -5
    earlier = [2, (1 << 32) + 9, -4, (1 << 32) + 9]      # an earlier call's error, recorded
    for err0, key_base in ((guard.fresh_error_buffer(), 3 << 32), (earlier, 5 << 32),
                           (guard.fresh_error_buffer(), 0)):
        (rs, re), (ts, te) = both(flat, low, limit, err0, key_base)
        assert ts.dtype == dtype and torch.equal(ts, rs)
        assert torch.equal(te, re)
        if bad_at is None:
            assert te.tolist() == err0
        else:
            bad = ((flat < low) | (flat >= limit)).nonzero().view(-1)
            assert te[0] == err0[0] + bad.numel()
            assert te[1] == min(err0[1], key_base + int(bad[0]))
            assert bool((ts[bad] == 0).all())
            if err0[1] > key_base:    # this call's first error is the step's: its value kept
                assert te[2:].tolist() == [int(flat[bad[0]]), key_base + int(bad[0])]
            else:                     # the earlier call's stays
                assert te[2:].tolist() == err0[2:]


def test_empty():
    fresh = guard.fresh_error_buffer()
    (rs, re), (ts, te) = both(torch.zeros(0, dtype=torch.int64), 0, 5, fresh, 0)
    assert ts.numel() == rs.numel() == 0 and te.tolist() == re.tolist() == fresh


def test_many_programs_leave_the_value_to_the_host():
    """Above ONE_PROGRAM_MAX entries the blocks spread over programs: the count and the first
    key as the reference has them, the value's slots untouched (the host reads it back)."""
    n = ONE_PROGRAM_MAX + 5
    flat = torch.arange(n, dtype=torch.int64) % 40
    flat[[BLOCK + 1, n - 1]] = torch.tensor([-3, 99])
    (rs, re), (ts, te) = both(flat, 0, 50, guard.fresh_error_buffer(), 7 << 32)
    assert torch.equal(ts, rs) and te[:2].tolist() == re[:2].tolist() == [2, (7 << 32) + BLOCK + 1]
    assert te[2:].tolist() == guard.fresh_error_buffer()[2:]


def test_the_host_names_the_value_the_device_saw():
    """raise_if_error names the bad value recorded at the check even when the indices were
    overwritten before the sync (a later step of a captured chain rewrote the accepted path),
    with the call's own lower bound; without a recorded value it reads the indices back."""
    g = guard.KVGuard(torch.device(DEV))
    path = torch.tensor([[0, 2, 7], [0, -1, -1]], device=DEV)
    call = g.register("tree retrieve (accepted node)", 5, path, None, dense=True, low=-1)
    guard_range_triton(path.view(-1), -1, 5, g.err, call << 32)
    path.fill_(-1)                              # the next step of the chain
    with pytest.raises(guard.KVIndexError) as e:
        g.raise_if_error()
    assert (e.value.first_bad, e.value.low, e.value.limit, e.value.num_bad) == (7, -1, 5, 1)
    assert "slot 7 out of range [-1, 5)" in str(e.value)
    assert g.err.tolist() == guard.fresh_error_buffer() and not g.calls
    table = torch.tensor([3, 11, 4], device=DEV)        # a kernel that records the key alone
    call = g.register("decode_attention", 8, table, 2)
    g.err[0], g.err[1] = 1, (call << 32) + 1
    with pytest.raises(guard.KVIndexError, match=r"slot 11 out of range \[0, 8\) in "
                       r"decode_attention \(layer 2"):
        g.raise_if_error()
