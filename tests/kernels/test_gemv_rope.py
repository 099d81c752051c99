"""The qkv gemv with rope_store_qkv as its epilogue (`fused.norm_matmul_rope_store` with
FUSE_GEMV_ROPE): q, the K/V cache rows and the new residual equal the two kernels it replaces
(the gemv's norm + qkv, then rope_store_qkv) over a sweep of rows, head shapes, dtypes and
index dtypes, and the PyTorch reference within the matmul's rounding; a bad slot or position
writes no cache row and is reported once with its value, q still comes back; off by default,
and only where the gemv's column block holds whole pairs of one head. Runs on the GPU when
there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
pytest.importorskip("triton")

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels import fused  # noqa: E402
from eaglekv.kernels.guard import kv_guard  # noqa: E402
from eaglekv.model.rope import RotaryEmbedding  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
EPS = 1e-5
LIMIT, PAD, POSITIONS = 40, 3, 64
HEADS = [(9, 3, 64), (4, 4, 16), (4, 2, 8)] + ([(32, 8, 128)] if ON_GPU else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MATMUL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")
    monkeypatch.setattr(fused, "FUSE_GEMV", True)         # the CPU interpreter too
    monkeypatch.setattr(fused, "FUSE_GEMV_ROPE", True)
    monkeypatch.setattr(fused, "GEMV_DOT_MAX_ROWS", 16)   # 5-16 rows: the tensor-core tile


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def case(M, H, Hkv, D, dtype, idx_dtype, residual=True, seed=0):
    K = 64
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(type("C", (), {"rope_theta": 10000.0})(), D, POSITIONS)
    cis = rope.cis.to(DEV)
    return dict(
        x=randn(M, K, dtype=dtype, seed=seed + 1),
        residual=randn(M, K, dtype=dtype, seed=seed + 2) if residual else None,
        norm_weight=randn(K, dtype=dtype, seed=seed + 3, scale=0.2) + 1, eps=EPS,
        w=fused.column_major(randn(K, (H + 2 * Hkv) * D, dtype=dtype, seed=seed + 4,
                                   scale=K ** -0.5)),
        cos=cis.real, sin=cis.imag,
        positions=torch.randint(0, POSITIONS, (M,), generator=g).to(idx_dtype).to(DEV),
        k_cache=randn(LIMIT + PAD, Hkv, D, dtype=dtype, seed=seed + 5),
        v_cache=randn(LIMIT + PAD, Hkv, D, dtype=dtype, seed=seed + 6),
        out_cache_loc=torch.randperm(LIMIT, generator=g)[:M].to(idx_dtype).to(DEV),
        num_heads=H, num_kv_heads=Hkv, size_limit=LIMIT)


def run(fn, args, layer=None):
    """fn on copies of the caches -> (q, new residual, k_cache, v_cache)."""
    a = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    q, res = fn(**a, layer=layer)
    return q, res, a["k_cache"], a["v_cache"]


def unfused(**a):
    """The two kernels the fused one replaces: the gemv (norm + qkv), then rope_store_qkv."""
    qkv, res = fused._triton_impl().gemv_triton(a["x"], a["residual"], a["norm_weight"],
                                                a["eps"], a["w"], False, fused._check_gemv)
    H, Hkv, D = a["num_heads"], a["num_kv_heads"], a["k_cache"].shape[-1]
    q = fused.rope_store_qkv(qkv.view(-1, H + 2 * Hkv, D), a["cos"], a["sin"], a["positions"],
                             a["k_cache"], a["v_cache"], a["out_cache_loc"], num_heads=H,
                             num_kv_heads=Hkv, size_limit=a["size_limit"], layer=a["layer"])
    return q, res


def reference(**a):
    """The PyTorch path: norm_matmul_torch, then rope_store_qkv_torch (on the CPU)."""
    c = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    qkv, res = fused.norm_matmul_torch(c["x"], c["residual"], c["norm_weight"], c["eps"],
                                       c["w"].contiguous())
    H, Hkv, D = c["num_heads"], c["num_kv_heads"], c["k_cache"].shape[-1]
    q = fused.rope_store_qkv_torch(qkv.view(-1, H + 2 * Hkv, D), c["cos"], c["sin"],
                                   c["positions"], c["k_cache"], c["v_cache"],
                                   c["out_cache_loc"], num_heads=H, num_kv_heads=Hkv,
                                   size_limit=c["size_limit"])
    a["k_cache"].copy_(c["k_cache"])          # on a GPU the CPU copies took the writes
    a["v_cache"].copy_(c["v_cache"])
    return q, res


def rows_changed(after, before):
    return (after != before).flatten(1).any(1).nonzero().view(-1).tolist()


def close(got, want, dtype):
    scale = want.double().abs().max().clamp_min(1e-3)
    err = (got.cpu().double() - want.cpu().double()).abs().max() / scale
    assert err <= MATMUL_TOL[dtype], f"max error {float(err):.3g} of the output's scale"


# (M, H, Hkv, D, dtype, index dtype, residual): every value of each at least once (the
# interpreter runs a program ~10 ms: the full product took 290 s on the CPU)
I32, I64, F32, F16, BF16 = torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16
CASES = [(1, 9, 3, 64, BF16, I64, True), (4, 4, 4, 16, F16, I32, True),
         (3, 4, 2, 8, F32, I64, False), (1, 4, 2, 8, BF16, I32, False),
         (4, 4, 2, 32, F32, I32, True), (3, 4, 4, 16, BF16, I64, True),
         (2, 4, 2, 8, F16, I64, False),
         # the tensor-core tile (5-16 rows: a verify window; 5-8 only with the row groups
         # off, which the test sets on the CPU: the row groups have their own test below),
         # its column block 16 wide
         (6, 9, 3, 64, BF16, I64, True), (16, 4, 2, 16, F32, I32, False),
         (9, 4, 4, 32, F16, I32, True)]
if ON_GPU:
    CASES += [(M, H, Hkv, D, dt, ix, r) for M in (1, 4, 6, 16) for H, Hkv, D in HEADS
              if M <= 4 or D % 16 == 0
              for dt in DTYPES for ix in (I32, I64) for r in (True, False)]


@pytest.mark.parametrize("M,H,Hkv,D,dtype,idx_dtype,residual", CASES)
def test_fused_equals_the_two_kernels_and_the_reference(M, H, Hkv, D, dtype, idx_dtype,
                                                        residual, monkeypatch):
    if not ON_GPU:    # 5-8 rows: the tensor-core tile (on a GPU the default's row groups,
        monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 0)   # 16 rows the tensor cores)
    a = case(M, H, Hkv, D, dtype, idx_dtype, residual, seed=M + D)
    assert fused.use_gemv_rope(a["x"], a["w"], D)
    q, res, kc, vc = run(fused.norm_matmul_rope_store, a)
    q2, res2, kc2, vc2 = run(unfused, a)
    assert q.shape == (M, H, D) and q.dtype == dtype
    assert torch.equal(res, res2)                                  # the residual: bit for bit
    if ON_GPU:           # the same math; the compiler may contract it differently
        for got, want in ((q, q2), (kc, kc2), (vc, vc2)):
            close(got, want, dtype)
    else:
        assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    written = a["out_cache_loc"].long().tolist()
    assert sorted(rows_changed(kc, a["k_cache"])) == sorted(rows_changed(vc, a["v_cache"])) \
        == sorted(written)                                         # nothing else touched
    q3, res3, kc3, vc3 = run(reference, a)
    assert torch.equal(res.cpu(), res3)
    close(q, q3, dtype)
    close(kc[written], kc3[written], dtype)
    close(vc[written], vc3[written], dtype)


@pytest.mark.parametrize("M,H,Hkv,D,dtype,residual", [(5, 6, 2, 64, BF16, True),
                                                      (8, 4, 2, 16, F32, False),
                                                      (6, 4, 4, 8, F16, True)])
def test_row_groups_equal_the_two_kernels_and_the_reference(M, H, Hkv, D, dtype, residual,
                                                            monkeypatch):
    """5-8 rows in row groups of the 4-row register tile (`fused.GEMV_GROUP_MAX_ROWS`, a
    verify window at batch 1) instead of the tensor-core tile: the same values as the two
    kernels and the reference, each row's K/V at its own slot; a bad slot in the second
    group is refused and named by its own value."""
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 8)
    ft = fused._triton_impl()
    bm, _, _, _, dot = ft.gemv_tiling(M, 64)
    assert (bm, dot, ft.gemv_row_groups(M, bm, dot)) == (4, False, 2)
    a = case(M, H, Hkv, D, dtype, I64, residual, seed=M + D)
    assert fused.use_gemv_rope(a["x"], a["w"], D)
    q, res, kc, vc = run(fused.norm_matmul_rope_store, a)
    q2, res2, kc2, vc2 = run(unfused, a)
    assert torch.equal(res, res2)
    for got, want in ((q, q2), (kc, kc2), (vc, vc2)):
        close(got, want, dtype)
    written = a["out_cache_loc"].long().tolist()
    assert sorted(rows_changed(kc, a["k_cache"])) == sorted(written)
    q3, res3, kc3, vc3 = run(reference, a)
    close(q, q3, dtype)
    close(kc[written], kc3[written], dtype)
    bad = a["out_cache_loc"].clone()
    bad[M - 1] = LIMIT + 2                         # the second group's last row
    guard = kv_guard(DEV)
    with guard.step():
        _, _, kc4, _ = run(fused.norm_matmul_rope_store, dict(a, out_cache_loc=bad), layer=2)
    with pytest.raises(KVIndexError, match=rf"slot {LIMIT + 2} out of range \[0, {LIMIT}\) in "
                                           r"store_cache \(layer 2, 1 of \d+ indices bad\)"):
        guard.raise_if_error()
    assert sorted(rows_changed(kc4, a["k_cache"])) == sorted(written[:M - 1])


def test_bad_slot_and_position_write_no_row_and_are_reported():
    """In a guard step: q for every token (a bad position rotates by row 0), no cache row for
    the bad tokens, the errors at raise_if_error naming the value, the buffer clear after;
    the same as the two kernels. Outside a step the first bad kind raises at once."""
    H, Hkv, D = 4, 2, 16
    a = case(4, H, Hkv, D, torch.float16, torch.int64, seed=7)
    a["out_cache_loc"] = torch.tensor([10, LIMIT + 1, 11, 12], device=DEV)
    guard = kv_guard(DEV)
    with guard.step():
        q, _, kc, vc = run(fused.norm_matmul_rope_store, a, layer=5)
    with pytest.raises(KVIndexError, match=rf"slot {LIMIT + 1} out of range \[0, {LIMIT}\) in "
                                           r"store_cache \(layer 5, 1 of 4 indices bad\)"):
        guard.raise_if_error()
    guard.raise_if_error()                                        # nothing left
    with guard.step():
        q2, _, kc2, vc2 = run(unfused, a, layer=5)
    with pytest.raises(KVIndexError):
        guard.raise_if_error()
    assert torch.equal(q, q2) or ON_GPU
    assert rows_changed(kc, a["k_cache"]) == rows_changed(vc, a["v_cache"]) == [10, 11, 12]
    a["out_cache_loc"] = torch.tensor([10, 13, 11, 12], device=DEV)
    a["positions"] = torch.tensor([1, POSITIONS, 2, -1], device=DEV)
    with pytest.raises(KVIndexError, match=rf"slot {POSITIONS} out of range \[0, {POSITIONS}\) "
                                           r"in rope_store_qkv positions \(2 of 4 indices bad\)"):
        run(fused.norm_matmul_rope_store, a)
    q, _, kc, vc = (None, None, a["k_cache"].clone(), a["v_cache"].clone())
    with guard.step():
        q, _ = fused.norm_matmul_rope_store(**dict(a, k_cache=kc, v_cache=vc))
    with pytest.raises(KVIndexError, match="rope_store_qkv positions"):
        guard.raise_if_error()
    assert rows_changed(kc, a["k_cache"]) == rows_changed(vc, a["v_cache"]) == [10, 11]
    assert q.shape == (4, H, D) and bool(torch.isfinite(q.float()).all())


def test_on_for_small_qkv_weights_and_only_for_whole_pairs(monkeypatch):
    """On by default (EAGLEKV_GEMV_ROPE unset) for a qkv weight of at most
    GEMV_ROPE_MAX_BYTES: measured faster for SmolLM2's 1.1 MB, slower for the 8B shape's 50 MB
    (H100, 2026-12-06); off with the switch; never where a column block splits a pair."""
    a = case(1, 4, 2, 16, torch.float32, torch.int64)
    if "EAGLEKV_GEMV_ROPE" not in os.environ:
        assert fused.FUSE_GEMV_ROPE and fused.GEMV_ROPE_MAX_BYTES == 8 << 20
    monkeypatch.setattr(fused, "FUSE_GEMV_ROPE", False)
    assert not fused.use_gemv_rope(a["x"], a["w"], 16)
    monkeypatch.setattr(fused, "FUSE_GEMV_ROPE", True)
    assert fused.use_gemv_rope(a["x"], a["w"], 16)
    nbytes = a["w"].numel() * a["w"].element_size()
    monkeypatch.setattr(fused, "GEMV_ROPE_MAX_BYTES", nbytes - 1)   # a larger weight: not
    assert not fused.use_gemv_rope(a["x"], a["w"], 16)
    monkeypatch.setattr(fused, "GEMV_ROPE_MAX_BYTES", None)         # =1: any size
    assert fused.use_gemv_rope(a["x"], a["w"], 16)
    cfg = fused._triton_impl().GEMV_CONFIG
    monkeypatch.setitem(cfg, "block_n", 3)                       # odd: splits a pair
    assert not fused.use_gemv_rope(a["x"], a["w"], 15 * 3)
    monkeypatch.setitem(cfg, "block_n", 32)                      # does not divide D = 16
    assert not fused.use_gemv_rope(a["x"], a["w"], 16)
    # the fallback (the two kernels) gives the fused kernel's values
    q, res, kc, vc = run(fused.norm_matmul_rope_store, a)
    monkeypatch.setitem(cfg, "block_n", 4)
    assert fused.use_gemv_rope(a["x"], a["w"], 16)
    q2, res2, kc2, vc2 = run(fused.norm_matmul_rope_store, a)
    close(q, q2, torch.float32)
    assert torch.equal(res, res2)
    close(kc, kc2, torch.float32)
    # without row groups 6 rows take the tensor-core tile, whose column block (16) must
    # divide head_dim too
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 0)
    a6 = case(6, 4, 2, 8, torch.float32, torch.int64)
    assert fused._triton_impl().gemv_tiling(6, 64)[1] == 16
    assert fused.use_gemv(a6["x"], a6["w"], fused=True)
    assert not fused.use_gemv_rope(a6["x"], a6["w"], 8)
    q, res, kc, vc = run(fused.norm_matmul_rope_store, a6)          # the two kernels
    q3, res3, kc3, vc3 = run(reference, a6)
    close(q, q3, torch.float32)


def test_bad_arguments_name_the_value():
    a = case(1, 4, 2, 16, torch.float32, torch.int64)
    with pytest.raises(ValueError, match=r"w has shape \(64, 100\), expected \(64, "
                                         r"\(num_heads \+ 2 \* num_kv_heads\) \* head_dim = 128"):
        fused.norm_matmul_rope_store(**dict(a, w=fused.column_major(randn(64, 100))))
    with pytest.raises(ValueError, match=r"size_limit=44"):
        fused.norm_matmul_rope_store(**dict(a, size_limit=44))
    with pytest.raises(ValueError, match=r"positions has shape"):
        fused.norm_matmul_rope_store(**dict(a, positions=torch.zeros(2, dtype=torch.long,
                                                                     device=DEV)))


_BAD_FUSED_STORE = """
import sys
sys.path.insert(0, "tests/kernels")
import torch
from test_gemv_rope import case, run
from eaglekv.kernels import fused
fused.FUSE_GEMV, fused.FUSE_GEMV_ROPE = True, True
a = case(2, 4, 2, 16, torch.bfloat16, torch.int64)
a["out_cache_loc"] = torch.tensor([1, 41], device="cuda")
run(fused.norm_matmul_rope_store, a)
torch.cuda.synchronize()
print("NO ASSERT")
"""


@pytest.mark.skipif(not ON_GPU, reason="the interpreter ignores tl.device_assert")
@pytest.mark.parametrize("assert_on", [True, False])
def test_device_assert_switch(assert_on):
    """EAGLEKV_DEVICE_ASSERT=1: a bad slot is a hard device assert in the fused kernel too;
    without it, the same launch raises KVIndexError."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "EAGLEKV_DEVICE_ASSERT": "1" if assert_on else "0",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _BAD_FUSED_STORE], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "NO ASSERT" not in r.stdout
    if assert_on:
        assert "device-side assert" in r.stderr or "Assertion" in r.stderr, r.stderr[-2000:]
    else:
        assert f"KVIndexError: slot 41 out of range [0, {LIMIT})" in r.stderr, r.stderr[-2000:]
