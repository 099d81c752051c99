"""The fused MLP (`fused.fused_mlp`: add + RMSNorm + gate/up + SiLU*mul + down in one launch,
down split along the intermediate dimension into an fp32 accumulator by atomic adds): the
accumulator and the new residual equal the unfused kernels (the gemv with SiLU*mul, then
the gemv for down) and the PyTorch reference within the matmul's rounding, over rows, sizes,
dtypes and the fp32-x input the next layer hands it; the next layer's buffer comes back zero
and nothing past the rows is written; the next layer's qkv kernel takes the fp32 x; bad
arguments name the value. Runs on the GPU when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_here import DEV, GPU_MARK, ON_GPU  # noqa: I001  (before the kernel modules)

from eaglekv.kernels import fused  # noqa: E402

pytestmark = GPU_MARK
EPS = 1e-5
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")
    monkeypatch.setattr(fused, "FUSE_GEMV", True)         # the CPU interpreter too
    monkeypatch.setattr(fused, "FUSE_MLP", True)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def case(M, K, I, dtype, residual=True, x32=False, seed=0):
    """x (fp32 when x32: the previous layer's accumulator), residual, norm weight, gate_up
    column-major (K, 2I), down (I, K) by rows."""
    x = randn(M, K, dtype=torch.float32 if x32 else dtype, seed=seed)
    r = randn(M, K, dtype=dtype, seed=seed + 1) if residual else None
    nw = randn(K, dtype=dtype, seed=seed + 2, scale=0.5) + 1
    w = fused.column_major(randn(K, 2 * I, dtype=dtype, seed=seed + 3, scale=K ** -0.5))
    wd = randn(I, K, dtype=dtype, seed=seed + 4, scale=I ** -0.5)
    return x, r, nw, w, wd


def buffers(K, rows=fused.MLP_MAX_ROWS):
    return (torch.zeros((rows, K), dtype=torch.float32, device=DEV),
            torch.full((rows, K), 7.0, dtype=torch.float32, device=DEV))


def close(a, b, dtype, what):
    tol = TOL[dtype] * max(1.0, b.abs().max().item())
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err} > {tol}"


CASES = [(1, 64, 48, torch.float32, True, False), (1, 96, 200, torch.bfloat16, True, False),
         (2, 64, 40, torch.float16, True, False), (3, 48, 64, torch.float32, False, False),
         (4, 64, 48, torch.bfloat16, True, True), (1, 64, 36, torch.float32, True, True),
         (1, 576, 96, torch.bfloat16, True, True),
         # 5-8 rows (a verify of S5 / S7): two row groups of programs over the same weights
         (6, 64, 48, torch.float32, True, False), (8, 96, 40, torch.bfloat16, True, True),
         (5, 48, 64, torch.float16, False, False)]


@pytest.mark.parametrize("M,K,I,dtype,residual,x32", CASES)
def test_fused_mlp_equals_the_unfused_kernels_and_the_reference(M, K, I, dtype, residual, x32):
    x, r, nw, w, wd = case(M, K, I, dtype, residual, x32)
    acc, zero = buffers(K)
    y, new_r = fused.fused_mlp(x, r, nw, EPS, w, wd, acc, zero)
    assert y.dtype == torch.float32 and y.shape == (M, K)
    assert y.data_ptr() == acc.data_ptr()                       # the sum is in acc's rows
    assert torch.all(acc[M:] == 0)                              # nothing past the rows
    assert torch.all(zero == 0)                                 # the next layer's, cleared
    ref_y, ref_r = fused.fused_mlp_torch(x, r, nw, EPS, w, wd)
    close(y, ref_y, dtype, "accumulator vs reference")
    if r is not None:
        assert new_r.dtype == dtype
        close(new_r, ref_r, dtype, "residual vs reference")
    if not x32:        # the kernels it replaces: gate_up with SiLU*mul, then down's gemv
        act, res2 = fused._triton_impl().gemv_triton(x, r, nw, EPS, w, True, fused._check_gemv)
        down = fused._triton_impl().gemv_triton(act, None, None, 0.0, fused.column_major(wd),
                                                False, fused._check_gemv)[0]
        close(y, down.float(), dtype, "accumulator vs the two gemvs")
        if r is not None:
            assert torch.equal(new_r, res2)                      # the same rounding


def test_accumulates_and_the_torch_path_matches(monkeypatch):
    """acc is added to (the kernel's contract: zero on entry gives the sum), and off the
    Triton path the reference's values go into acc the same way."""
    x, r, nw, w, wd = case(2, 64, 48, torch.float32)
    acc, zero = buffers(64)
    acc[:2] = 1.0
    y, _ = fused.fused_mlp(x, r, nw, EPS, w, wd, acc, zero)
    ref, _ = fused.fused_mlp_torch(x, r, nw, EPS, w, wd)
    close(y, ref + 1.0, torch.float32, "acc + sum")
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        acc2, zero2 = buffers(64)
        y2, _ = fused.fused_mlp(x, r, nw, EPS, w, wd, acc2, zero2)
        assert torch.equal(y2, ref) and torch.all(zero2 == 0)


@pytest.mark.parametrize("kernel", ["gemv", "gemv_rope", "add_rms_norm"])
def test_next_layer_takes_the_fp32_accumulator(kernel, monkeypatch):
    """The next layer's add + RMSNorm + qkv (the gemv, or the gemv with RoPE and the K/V
    store) reads the fp32 x beside a bf16 residual: s = round_bf16(x + r), the same as the
    unfused input x rounded ... where the sum is what it rounds."""
    monkeypatch.setattr(fused, "FUSE_GEMV_ROPE", True)
    dtype, M, K = torch.bfloat16, 2, 64
    x32 = randn(M, K, seed=5)
    r = randn(M, K, dtype=dtype, seed=6)
    nw = randn(K, dtype=dtype, seed=7, scale=0.5) + 1
    s = (x32 + r.float()).to(dtype)             # what the kernel must form first
    H, Hkv, D = 2, 1, 16
    w = fused.column_major(randn(K, (H + 2 * Hkv) * D, dtype=dtype, seed=8, scale=K ** -0.5))
    if kernel == "gemv":
        y, new_r = fused.norm_matmul(x32, r, nw, EPS, w)
        y2, _ = fused.norm_matmul(s, None, nw, EPS, w)
        assert y.dtype == dtype and torch.equal(y, y2)
    elif kernel == "add_rms_norm":       # before cuBLAS's gate_up (merge + o up to 8 rows)
        y, new_r = fused.add_rms_norm(x32, r, nw, EPS)
        y2, _ = fused.add_rms_norm(s, None, nw, EPS)
        assert y.dtype == dtype and torch.equal(y, y2)
    else:
        cos, sin = randn(8, D // 2, seed=9), randn(8, D // 2, seed=10)
        pos = torch.tensor([1, 5], device=DEV)
        caches = [torch.zeros((6, Hkv, D), dtype=dtype, device=DEV) for _ in range(4)]
        loc = torch.tensor([2, 4], device=DEV)
        q, new_r = fused.norm_matmul_rope_store(x32, r, nw, EPS, w, cos, sin, pos, *caches[:2],
                                                loc, num_heads=H, num_kv_heads=Hkv,
                                                size_limit=6)
        q2, _ = fused.norm_matmul_rope_store(s, None, nw, EPS, w, cos, sin, pos, *caches[2:],
                                             loc, num_heads=H, num_kv_heads=Hkv, size_limit=6)
        assert q.dtype == dtype and torch.equal(q, q2)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert new_r.dtype == dtype and torch.equal(new_r, s)


def test_use_fused_mlp_bounds(monkeypatch):
    x, r, nw, w, wd = case(1, 64, 48, torch.float32)
    assert fused.use_fused_mlp(x, w, wd)
    assert not fused.use_fused_mlp(x, w, None)                  # model not prepared
    x5 = randn(fused.MLP_MAX_ROWS + 1, 64)
    monkeypatch.setattr(fused, "FUSE_MLP_MAX_ROWS", 16)
    assert not fused.use_fused_mlp(x5, w, wd)                   # the accumulators' rows
    monkeypatch.setattr(fused, "FUSE_MLP_MAX_ROWS", 1)          # the default: one row
    assert not fused.use_fused_mlp(randn(2, 64), w, wd)
    monkeypatch.setattr(fused, "MLP_MAX_WEIGHT_BYTES", 100)
    assert not fused.use_fused_mlp(x, w, wd)
    monkeypatch.setattr(fused, "MLP_MAX_WEIGHT_BYTES", 16 << 20)
    monkeypatch.setattr(fused, "FUSE_MLP", False)
    assert not fused.use_fused_mlp(x, w, wd)


def test_bad_arguments_name_the_value():
    x, r, nw, w, wd = case(2, 64, 48, torch.float32)
    acc, zero = buffers(64)
    with pytest.raises(ValueError, match=r"wd has shape \(47, 64\)"):
        fused.fused_mlp(x, r, nw, EPS, w, wd[:47], acc, zero)
    with pytest.raises(ValueError, match="at most 1"):
        fused.fused_mlp(x, r, nw, EPS, w, wd, acc[:1], zero)
    with pytest.raises(ValueError, match="same buffer"):
        fused.fused_mlp(x, r, nw, EPS, w, wd, acc, acc)
    with pytest.raises(TypeError, match="acc dtype torch.float16"):
        fused.fused_mlp(x, r, nw, EPS, w, wd, acc.half(), zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_product_forms_agree(dtype, monkeypatch):
    """`_gemv_acc`'s one-row form (ROW2, GEMV_ONE_ROW_2D: the products in the weight tile's
    own layout) and the 3-D form (the default) give the same gemv (bare, and with the norm
    and SiLU*mul) and the same fused MLP within fp32 summation order."""
    from eaglekv.kernels import fused_triton as ft
    x, r, nw, w, wd = case(1, 96, 40, dtype, x32=False, seed=3)
    got = {}
    for row2 in (True, False):
        monkeypatch.setattr(ft, "GEMV_ONE_ROW_2D", row2)
        act, res = ft.gemv_triton(x, r, nw, EPS, w, True, fused._check_gemv)
        bare = ft.gemv_triton(act, None, None, 0.0, fused.column_major(wd), False,
                              fused._check_gemv)[0]
        acc, zero = buffers(96)
        y, _ = fused.fused_mlp(x, r, nw, EPS, w, wd, acc, zero)
        got[row2] = (act, res, bare, y.clone())
    for a, b, what in zip(got[True], got[False], ("gate_up", "residual", "down", "mlp")):
        close(a, b, dtype, what)
