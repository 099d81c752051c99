"""The guard's range check in one Triton launch (`guard_triton.guard_range_triton`, what
`guard_indices` runs on CUDA) equals its torch-op reference (`guard.guard_range_torch`): the
safe copy, the count and the first bad key, over index dtypes, sizes across the block edge,
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
from eaglekv.kernels.guard_triton import BLOCK, guard_range_triton  # noqa: E402

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
    for err0, key_base in (([0, guard.NO_ERROR], 3 << 32), ([2, (1 << 32) + 9], 5 << 32)):
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


def test_empty():
    (rs, re), (ts, te) = both(torch.zeros(0, dtype=torch.int64), 0, 5, [0, guard.NO_ERROR], 0)
    assert ts.numel() == rs.numel() == 0 and te.tolist() == re.tolist() == [0, guard.NO_ERROR]
