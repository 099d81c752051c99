"""Fused decode-step kernels (add_rms_norm, silu_and_mul, rope_store_qkv): Triton equals the
PyTorch reference over a sweep of shapes, dtypes and index dtypes; each reference equals an
independent computation (the model's ops, fp64, transformers' RoPE); a bad slot or position
writes nothing and raises KVIndexError. Runs on the GPU when there is one, else under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
triton = pytest.importorskip("triton")

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels.fused import (add_rms_norm, add_rms_norm_torch, rope_store_qkv,  # noqa: E402
                                   rope_store_qkv_torch, silu_and_mul, silu_and_mul_torch)
from eaglekv.kernels.guard import kv_guard  # noqa: E402
from eaglekv.model.rope import RotaryEmbedding, to_interleaved  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
TOKENS = [1, 3, 17]
HIDDEN = [64, 576] + ([4096, 8192] if ON_GPU else [])
INTER = [64, 1536] + ([14336] if ON_GPU else [])
HEADS = [(9, 3, 64), (4, 4, 16)] + ([(32, 8, 128)] if ON_GPU else [])   # (H, Hkv, D)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
PAD = 3            # canary rows after size_limit that no valid slot touches
POSITIONS = 64     # rows of the cos/sin tables


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def assert_ulps(got, want, ulps: float, floor: float = 0.0):
    """|got - want| <= ulps * ulp(max(|want|, floor)) elementwise, ulp in got's dtype. `floor`
    (the inputs' scale) allows for cancellation: x0*c - x1*s near 0 keeps the absolute error
    of its terms, and the GPU contracts it into an fma."""
    assert got.dtype == want.dtype and got.shape == want.shape
    fi = torch.finfo(got.dtype)
    w = want.double().abs().clamp_min(max(fi.tiny, floor))
    ulp = torch.exp2(torch.floor(torch.log2(w))) * fi.eps                 # spacing at |want|
    err = (got.double() - want.double()).abs()
    bad = err > ulps * ulp
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} beyond {ulps} ulp, worst "
                           f"{float((err / ulp).max()):.2f} ulp")


# ------------------------------------------------------------------------------- add_rms_norm

@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(T, H, dtype, with_residual):
    x = randn(T, H, dtype=dtype, seed=1)
    res = randn(T, H, dtype=dtype, seed=2, scale=4.0) if with_residual else None
    w = (1 + randn(H, seed=3, scale=0.2)).to(dtype)
    normed, new_res = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_res = add_rms_norm_torch(x.cpu(), None if res is None else res.cpu(),
                                             w.cpu(), EPS)
    assert torch.equal(new_res.cpu(), ref_res)           # the add, rounded once, as torch
    if not with_residual:
        assert new_res is x                               # a plain RMSNorm: no copy
    assert_ulps(normed.cpu(), ref_normed, 8 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_is_the_model_math(dtype):
    """The reference is `rms_norm(residual + x)` bit for bit, and within 1 ulp of fp64 over the
    dtype-rounded sum."""
    x, res = randn(5, 576, dtype=dtype, seed=4), randn(5, 576, dtype=dtype, seed=5)
    w = (1 + randn(576, seed=6, scale=0.2)).to(dtype)
    normed, new_res = add_rms_norm_torch(x, res, w, EPS)
    assert torch.equal(new_res, res + x)
    assert torch.equal(normed, F.rms_norm(res + x, (576,), w, EPS))
    s = (res + x).double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    assert_ulps(normed, exact.to(dtype), 8 if dtype == torch.float32 else 1)
    plain, same = add_rms_norm_torch(x, None, w, EPS)
    assert same is x and torch.equal(plain, F.rms_norm(x, (576,), w, EPS))


def test_add_rms_norm_strided_rows():
    """x a column slice of a wider buffer, residual a transposed view: strides are honoured."""
    big = randn(6, 200, dtype=torch.bfloat16, seed=7)
    x = big[:, 8:136]                                                     # (6, 128) row stride 200
    res = randn(128, 6, dtype=torch.bfloat16, seed=8).t()                 # (6, 128) col stride 6
    w = randn(128, dtype=torch.bfloat16, seed=9)
    normed, new_res = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_res = add_rms_norm_torch(x, res, w, EPS)
    assert torch.equal(new_res, ref_res)
    assert_ulps(normed, ref_normed, 1)


# ------------------------------------------------------------------------------- silu_and_mul

def silu_mul_fp64(gate_up):
    g, u = gate_up.double().chunk(2, -1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("I", INTER)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(T, I, dtype):
    """Triton rounds once (within 1 ulp of fp64); the reference rounds twice (silu, then the
    product), so the two agree within 2 ulp in fp16/bf16."""
    gu = randn(T, 2 * I, dtype=dtype, seed=10, scale=3.0)
    out = silu_and_mul(gu)
    assert out.shape == (T, I) and out.dtype == dtype
    fp32 = dtype == torch.float32
    assert_ulps(out.cpu(), silu_and_mul_torch(gu.cpu()), 8 if fp32 else 2, floor=fp32)
    assert_ulps(out.cpu(), silu_mul_fp64(gu.cpu()).to(dtype), 8 if fp32 else 1, floor=fp32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_is_the_model_math(dtype):
    gu = randn(4, 2 * 96, dtype=dtype, seed=11, scale=3.0)
    gate, up = gu.chunk(2, -1)
    ref = silu_and_mul_torch(gu)
    assert torch.equal(ref, F.silu(gate) * up)
    assert_ulps(ref, silu_mul_fp64(gu).to(dtype), 8 if dtype == torch.float32 else 2)


def test_silu_and_mul_strided():
    big = randn(5, 300, dtype=torch.float16, seed=12)
    gu = big[:, 10:138]                                                   # (5, 128) row stride 300
    assert_ulps(silu_and_mul(gu), silu_and_mul_torch(gu), 2)


# ----------------------------------------------------------------------------- rope_store_qkv

def rope_tables(D: int, scale: float = 1.0, device=DEV):
    """RotaryEmbedding's cis (P, D/2) complex64 (magnitude `scale`), its cos/sin as strided
    float32 views (`cis.real`, `cis.imag`)."""
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), D, POSITIONS)
    cis = (rope.cis * scale).to(device)
    return cis, cis.real, cis.imag


def rope_case(T, H, Hkv, D, dtype, idx_dtype, seed=0, size_limit=40):
    """qkv as a view of the (T, (H+2Hkv)*D) matmul output, positions and distinct valid slots
    (both idx_dtype), and random caches of size_limit + PAD rows (PAD rows past the limit)."""
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype, seed=seed).view(T, H + 2 * Hkv, D)
    g = torch.Generator().manual_seed(seed + 1)
    pos = torch.randint(0, POSITIONS, (T,), generator=g).to(idx_dtype).to(DEV)
    loc = torch.randperm(size_limit, generator=g)[:T].to(idx_dtype).to(DEV)
    kc = randn(size_limit + PAD, Hkv, D, dtype=dtype, seed=seed + 2)
    vc = randn(size_limit + PAD, Hkv, D, dtype=dtype, seed=seed + 3)
    return qkv, pos, loc, kc, vc


def run_rope(fn, qkv, cos, sin, pos, loc, kc, vc, H, Hkv, size_limit=40, layer=None):
    """fn on copies of the caches -> (q, k_cache, v_cache)."""
    kc, vc = kc.clone(), vc.clone()
    q = fn(qkv, cos, sin, pos, kc, vc, loc, num_heads=H, num_kv_heads=Hkv,
           size_limit=size_limit, layer=layer)
    return q, kc, vc


def rows_changed(after, before):
    return (after != before).flatten(1).any(1).nonzero().view(-1).tolist()


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H,Hkv,D", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_rope_store_qkv_matches_reference(T, H, Hkv, D, dtype, idx_dtype):
    qkv, pos, loc, kc, vc = rope_case(T, H, Hkv, D, dtype, idx_dtype, seed=T)
    _, cos, sin = rope_tables(D, scale=1.0 if T != 3 else 1.25)   # magnitude != 1 works too
    q, k_out, v_out = run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, H, Hkv)
    cpu = [t.cpu() for t in (qkv, cos, sin, pos, loc, kc, vc)]
    rq, rk, rv = run_rope(rope_store_qkv_torch, *cpu, H, Hkv)
    ulps, floor = (8, 1.0) if dtype == torch.float32 else (1, 0.0)
    assert q.shape == (T, H, D) and q.dtype == dtype
    assert_ulps(q.cpu(), rq, ulps, floor)
    assert torch.equal(v_out.cpu(), rv)                           # v: an exact copy
    assert sorted(rows_changed(v_out, vc)) == sorted(loc.tolist())
    written = loc.long().cpu()
    assert_ulps(k_out.cpu()[written], rk[written], ulps, floor)
    others = torch.ones(kc.shape[0], dtype=torch.bool)
    others[written] = False
    assert torch.equal(k_out.cpu()[others], kc.cpu()[others])    # nothing else touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reference_is_rotary_embedding_apply(dtype):
    """The reference is RotaryEmbedding.apply on the q and k heads bit for bit, then
    store_cache: k rotated, v as it is, at out_cache_loc."""
    H, Hkv, D, T = 4, 2, 32, 5
    qkv, pos, loc, kc, vc = (t.cpu() for t in rope_case(T, H, Hkv, D, dtype, torch.int64))
    cis, cos, sin = rope_tables(D, scale=1.25, device="cpu")
    q, k_out, v_out = run_rope(rope_store_qkv_torch, qkv, cos, sin, pos, loc, kc, vc, H, Hkv)
    qk = RotaryEmbedding.apply(qkv[:, :H + Hkv], cis[pos].unsqueeze(1))    # (T, H+Hkv, D)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(k_out[loc], qk[:, H:]) and torch.equal(v_out[loc], qkv[:, H + Hkv:])


def test_rope_matches_transformers_rotate_half():
    """q, k in Hugging Face's rotate-half layout, rotated by transformers' apply_rotary_pos_emb,
    then permuted with to_interleaved, equal our rotation of the permuted inputs."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    H, Hkv, D, T = 3, 1, 16, 6
    q_hf = torch.randn(T, H, D, generator=torch.Generator().manual_seed(13))
    k_hf = torch.randn(T, Hkv, D, generator=torch.Generator().manual_seed(14))
    v = torch.randn(T, Hkv, D)
    pos = torch.tensor([0, 1, 5, 17, 40, 63])
    _, cos, sin = rope_tables(D, device="cpu")
    emb_cos = torch.cat([cos[pos], cos[pos]], -1)                         # (T, D) rotate-half
    emb_sin = torch.cat([sin[pos], sin[pos]], -1)
    q_rot, k_rot = llama.apply_rotary_pos_emb(q_hf, k_hf, emb_cos, emb_sin, unsqueeze_dim=1)

    def inter(x):                                                         # (T, n, D) per head
        n = x.shape[1]
        return to_interleaved(x.reshape(T, n * D).t(), n).t().reshape(T, n, D)
    qkv = torch.cat([inter(q_hf), inter(k_hf), v], 1)                     # (T, H+2Hkv, D)
    kc, vc = torch.zeros(8, Hkv, D), torch.zeros(8, Hkv, D)
    loc = torch.tensor([2, 3, 4, 5, 6, 7])
    for fn in (rope_store_qkv_torch, rope_store_qkv):                     # reference, Triton
        q, k_out, _ = run_rope(fn, qkv, cos, sin, pos, loc, kc, vc, H, Hkv, size_limit=8)
        torch.testing.assert_close(q, inter(q_rot), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out[loc], inter(k_rot), rtol=1e-5, atol=1e-5)


def test_rope_store_qkv_strided_inputs():
    """qkv sliced out of a wider buffer (head stride > D), contiguous cos/sin, strided index
    tensors: same result as the reference."""
    H, Hkv, D, T = 4, 2, 16, 5
    big = randn(T, H + 2 * Hkv, 2 * D, dtype=torch.float16, seed=15)
    qkv = big[..., D:]                                                    # (T, 8, 16) strides
    _, cos, sin = rope_tables(D)
    cos, sin = cos.contiguous(), sin.contiguous()
    pos = torch.tensor([3, 0, 63, 9, 9, 1, 2, 7, 5, 4], device=DEV)[::2]
    loc = torch.tensor([1, 0, 30, 0, 7, 0, 12, 0, 39, 0], device=DEV, dtype=torch.int32)[::2]
    kc = randn(43, Hkv, D, dtype=torch.float16, seed=16)
    vc = randn(43, Hkv, D, dtype=torch.float16, seed=17)
    got = run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, H, Hkv)
    cpu = [t.cpu() for t in (qkv, cos, sin, pos, loc, kc, vc)]
    want = run_rope(rope_store_qkv_torch, *cpu, H, Hkv)
    for a, b in zip(got, want):
        assert_ulps(a.cpu(), b, 1)


# ------------------------------------------------------------------------------------- guards

@pytest.mark.parametrize("bad", [40, -1])          # == size_limit (a real row), negative
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_bad_slot_writes_nothing_and_raises(bad, idx_dtype):
    """Outside a step: raises at once; only the valid tokens' rows were written (correctly)."""
    H, Hkv, D, T = 9, 3, 64, 4
    qkv, pos, _, kc, vc = rope_case(T, H, Hkv, D, torch.bfloat16, idx_dtype)
    loc = torch.tensor([5, bad, 6, 39], dtype=idx_dtype, device=DEV)
    _, cos, sin = rope_tables(D)
    k_out, v_out = kc.clone(), vc.clone()
    with pytest.raises(KVIndexError, match=rf"slot {bad} out of range \[0, 40\) in store_cache "
                                           rf"\(layer 2, 1 of 4 indices bad\)"):
        rope_store_qkv(qkv, cos, sin, pos, k_out, v_out, loc, num_heads=H, num_kv_heads=Hkv,
                       size_limit=40, layer=2)
    good = torch.tensor([0, 2, 3])
    ok_loc = loc.clone()
    ok_loc[1] = 0                                     # the reference on the valid tokens only
    rq, rk, rv = run_rope(rope_store_qkv_torch, *(t.cpu() for t in (qkv, cos, sin, pos)),
                          ok_loc.cpu(), kc.cpu(), vc.cpu(), H, Hkv)
    assert rows_changed(k_out, kc) == rows_changed(v_out, vc) == [5, 6, 39]
    rows = loc[good].long().cpu()
    assert_ulps(k_out.cpu()[rows], rk[rows], 1)
    assert torch.equal(v_out.cpu()[rows], rv[rows])


def test_bad_slot_in_a_step_still_returns_q():
    """Inside a guard step: q comes back for every token (the bad one too), the error waits
    for raise_if_error, and the buffer is clear after."""
    H, Hkv, D, T = 4, 4, 16, 3
    qkv, pos, _, kc, vc = rope_case(T, H, Hkv, D, torch.float16, torch.int64, seed=20)
    _, cos, sin = rope_tables(D)
    loc = torch.tensor([10, 41, 11], device=DEV)
    guard = kv_guard(DEV)
    k_out, v_out = kc.clone(), vc.clone()
    with guard.step():
        q = rope_store_qkv(qkv, cos, sin, pos, k_out, v_out, loc, num_heads=H,
                           num_kv_heads=Hkv, size_limit=40, layer=7)
    with pytest.raises(KVIndexError, match=r"slot 41 out of range \[0, 40\) in store_cache "
                                           r"\(layer 7, 1 of 3 indices bad\)"):
        guard.raise_if_error()
    guard.raise_if_error()                                                # nothing left
    rq, _, _ = run_rope(rope_store_qkv_torch, *(t.cpu() for t in (qkv, cos, sin, pos)),
                        torch.tensor([10, 0, 11]), kc.cpu(), vc.cpu(), H, Hkv)
    assert_ulps(q.cpu(), rq, 1)
    assert rows_changed(k_out, kc) == rows_changed(v_out, vc) == [10, 11]


def test_bad_position_reads_and_writes_nothing_and_raises():
    """A position outside the cos/sin tables is never read; that token's K/V are not stored."""
    H, Hkv, D, T = 4, 2, 16, 3
    qkv, _, _, kc, vc = rope_case(T, H, Hkv, D, torch.float32, torch.int64, seed=21)
    _, cos, sin = rope_tables(D)
    pos = torch.tensor([1, POSITIONS, 2], device=DEV)
    loc = torch.tensor([3, 4, 5], device=DEV)
    k_out, v_out = kc.clone(), vc.clone()
    with pytest.raises(KVIndexError, match=rf"slot {POSITIONS} out of range \[0, {POSITIONS}\) "
                                           r"in rope_store_qkv positions \(1 of 3 indices bad\)"):
        rope_store_qkv(qkv, cos, sin, pos, k_out, v_out, loc, num_heads=H, num_kv_heads=Hkv,
                       size_limit=40)
    assert rows_changed(k_out, kc) == rows_changed(v_out, vc) == [3, 5]


@pytest.mark.parametrize("bad_pos", [False, True])
def test_reference_path_raises_before_writing(monkeypatch, bad_pos):
    """The CPU (PyTorch) path: KVIndexError, with the layer, and no row written at all."""
    monkeypatch.delenv("EAGLEKV_TRITON_ON_CPU", raising=False)
    H, Hkv, D, T = 4, 2, 16, 3
    qkv, pos, _, kc, vc = (t.cpu() for t in rope_case(T, H, Hkv, D, torch.float32, torch.int32))
    _, cos, sin = rope_tables(D, device="cpu")
    loc = torch.tensor([1, 2, 3] if bad_pos else [1, 40, 3], dtype=torch.int32)
    if bad_pos:
        pos = torch.tensor([0, -1, 2])
    k_out, v_out = kc.clone(), vc.clone()
    what = "slot -1 .* rope_store_qkv positions" if bad_pos else "slot 40 .* store_cache"
    with pytest.raises(KVIndexError, match=rf"{what} \(layer 3, 1 of 3 indices bad\)"):
        rope_store_qkv(qkv, cos, sin, pos, k_out, v_out, loc, num_heads=H, num_kv_heads=Hkv,
                       size_limit=40, layer=3)
    assert torch.equal(k_out, kc) and torch.equal(v_out, vc)


# ------------------------------------------------------------------------ argument checks

def _rope_args(**over):
    H, Hkv, D, T = 4, 2, 16, 3
    qkv, pos, loc, kc, vc = rope_case(T, H, Hkv, D, torch.float16, torch.int64)
    _, cos, sin = rope_tables(D)
    args = dict(qkv=qkv, cos=cos, sin=sin, positions=pos, k_cache=kc, v_cache=vc,
                out_cache_loc=loc, num_heads=H, num_kv_heads=Hkv, size_limit=40)
    args.update(over)
    return args


def _bad_calls():
    x, w = torch.zeros(2, 8, device=DEV), torch.ones(8, device=DEV)
    return [
        (lambda: add_rms_norm(x, x[:1], w, EPS), ValueError, r"residual has shape \(1, 8\), "
                                                             r"expected \(2, 8\)"),
        (lambda: add_rms_norm(x, None, w.half(), EPS), TypeError, r"weight dtype torch.float16"),
        (lambda: add_rms_norm(x.view(2, 2, 4), None, w, EPS), ValueError, r"expected \(T, H\)"),
        (lambda: add_rms_norm(x.long(), None, w, EPS), TypeError, r"x dtype torch.int64"),
        (lambda: add_rms_norm(x, None, w.to("meta"), EPS), ValueError,
         rf"weight is on meta, the other inputs on {x.device}"),
        (lambda: silu_and_mul(torch.zeros(2, 7, device=DEV)), ValueError, r"expected \(T, 2I\)"),
        (lambda: rope_store_qkv(**_rope_args(num_heads=5)), ValueError, r"qkv has shape"),
        (lambda: rope_store_qkv(**_rope_args(cos=torch.zeros(64, 8, dtype=torch.float16,
                                                             device=DEV))),
         TypeError, r"cos dtype torch.float16, expected torch.float32"),
        (lambda: rope_store_qkv(**_rope_args(sin=torch.zeros(64, 4, device=DEV))), ValueError,
         r"sin has shape \(64, 4\), expected \(64, 8\)"),
        (lambda: rope_store_qkv(**_rope_args(out_cache_loc=torch.zeros(3, device=DEV))),
         TypeError, r"out_cache_loc dtype torch.float32"),
        (lambda: rope_store_qkv(**_rope_args(positions=torch.zeros(2, dtype=torch.long,
                                                                   device=DEV))),
         ValueError, r"positions has shape \(2,\), expected \(3\)"),
        (lambda: rope_store_qkv(**_rope_args(k_cache=torch.zeros(43, 3, 16, dtype=torch.float16,
                                                                 device=DEV))),
         ValueError, r"k_cache has shape \(43, 3, 16\), expected \(\*, 2, 16\)"),
        (lambda: rope_store_qkv(**_rope_args(v_cache=torch.zeros(43, 2, 16, device=DEV))),
         TypeError, r"v_cache dtype torch.float32, expected torch.float16"),
        (lambda: rope_store_qkv(**_rope_args(size_limit=44)), ValueError,
         r"size_limit=44, expected 1 <= size_limit <= 43"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_name_the_value(case):
    call, exc, msg = _bad_calls()[case]
    with pytest.raises(exc, match=msg):
        call()


def test_no_tokens():
    w = torch.ones(64, device=DEV)
    normed, res = add_rms_norm(torch.zeros(0, 64, device=DEV), torch.zeros(0, 64, device=DEV),
                               w, EPS)
    assert normed.shape == res.shape == (0, 64)
    assert silu_and_mul(torch.zeros(0, 32, device=DEV)).shape == (0, 16)
    args = _rope_args()
    args.update(qkv=args["qkv"][:0], positions=args["positions"][:0],
                out_cache_loc=args["out_cache_loc"][:0])
    before = args["k_cache"].clone()
    assert rope_store_qkv(**args).shape == (0, 4, 16)
    assert torch.equal(args["k_cache"], before)


# ------------------------------------------------------------------------------ cached launch
# On the GPU the second call of a signature skips the host checks and Triton's dispatch and
# calls the CompiledKernel's launcher (fused_triton.CachedLaunch). On CPU (interpreter) nothing
# is cached unless the fixture below hands back a launcher that runs the interpreted kernel.

def _three_calls(seed: int, loc=None, size_limit=40):
    """One call of each kernel on fixed shapes, new data -> (outputs, reference outputs)."""
    H, Hkv, D, T = 4, 2, 16, 3
    x, res = randn(T, 64, dtype=torch.bfloat16, seed=seed), randn(T, 64, dtype=torch.bfloat16)
    w = randn(64, dtype=torch.bfloat16, seed=seed + 1)
    gu = randn(T, 128, dtype=torch.float16, seed=seed + 2)
    qkv, pos, good_loc, kc, vc = rope_case(T, H, Hkv, D, torch.float32, torch.int64, seed=seed)
    loc = good_loc if loc is None else loc
    _, cos, sin = rope_tables(D)
    got = (*add_rms_norm(x, res, w, EPS), silu_and_mul(gu),
           *run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, H, Hkv, size_limit))
    want = (*add_rms_norm_torch(x.cpu(), res.cpu(), w.cpu(), EPS), silu_and_mul_torch(gu.cpu()),
            *run_rope(rope_store_qkv_torch, *(t.cpu() for t in (qkv, cos, sin, pos, loc, kc,
                                                                 vc)), H, Hkv, size_limit))
    return got, want


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert_ulps(a.cpu(), b, 2, floor=1.0 if b.dtype == torch.float32 else 0.0)


def test_repeated_calls_hit_the_cached_launch_and_match():
    from eaglekv.kernels import fused_triton as ft
    for seed in range(3):                   # same signatures, new data every call
        _assert_same(*_three_calls(seed))
    for cached in (ft._ADD_RMS_NORM, ft._SILU_AND_MUL, ft._ROPE_STORE_QKV):
        assert bool(cached.cache) == ON_GPU   # the GPU path really took the cached launch


class _InterpretedLaunch:
    """Stands in for a CompiledKernel on CPU: its launcher runs the kernel under the Triton
    interpreter with exactly the arguments the cached launch passes."""

    function, packed_metadata = 0, None

    def __init__(self, kernel, counter):
        self.kernel, self.counter = kernel, counter

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert (g2, launch_metadata, enter, exit_) == (1, None, None, None)
        self.counter[self.kernel] = self.counter.get(self.kernel, 0) + 1
        self.kernel[(g0, g1)](*args)


@pytest.fixture
def interpreted_fast_launch(monkeypatch):
    """On CPU, make the full path hand back a launcher so that the cached path runs too."""
    if ON_GPU:
        pytest.skip("the GPU runs the real cached launch")
    from eaglekv.kernels import fused_triton as ft
    hits: dict = {}
    for cached in (ft._ADD_RMS_NORM, ft._SILU_AND_MUL, ft._ROPE_STORE_QKV):
        real = cached.full_launch

        def full(grid, args, options, real=real, kernel=cached.kernel):
            real(grid, args, options)
            return _InterpretedLaunch(kernel, hits)
        monkeypatch.setattr(cached, "full_launch", full)
        monkeypatch.setattr(cached, "cache", {})
    monkeypatch.setattr(ft.sct, "_RAW_STREAM", lambda device: 0)
    return ft, hits


def test_cached_launch_on_cpu_matches_and_guards(interpreted_fast_launch):
    ft, hits = interpreted_fast_launch
    for seed in range(3):
        _assert_same(*_three_calls(seed))
    assert sorted(hits.values()) == [2, 2, 2]          # call 1 full path, calls 2 and 3 hits
    # a hit still registers and guards: a bad slot is not written and is raised
    loc = torch.tensor([1, 40, 2])
    with pytest.raises(KVIndexError, match=r"slot 40 out of range \[0, 40\) in store_cache"):
        _three_calls(5, loc=loc)
    assert sorted(hits.values()) == [3, 3, 3]
    # a new signature (size_limit) runs the checks again
    with pytest.raises(ValueError, match=r"size_limit=99"):
        _three_calls(6, size_limit=99)


def test_cached_launch_skipped_with_a_hook_or_fast_launch_off(interpreted_fast_launch,
                                                              monkeypatch):
    ft, hits = interpreted_fast_launch
    _three_calls(0)                                    # cached now
    runtime = triton.knobs.runtime
    before = runtime.launch_enter_hook
    monkeypatch.setattr(runtime, "launch_enter_hook", type("Hook", (), {"calls": [print]})())
    _assert_same(*_three_calls(1))
    assert not hits                                    # a profiler hook: the full path
    monkeypatch.setattr(runtime, "launch_enter_hook", before)
    monkeypatch.setattr(ft.FLAGS, "fast_launch", False)
    _assert_same(*_three_calls(2))
    assert not hits                                    # EAGLEKV_TRITON_FAST_LAUNCH=0
    monkeypatch.setattr(ft.FLAGS, "fast_launch", True)
    _assert_same(*_three_calls(3))
    assert sorted(hits.values()) == [1, 1, 1]          # and the cache was there all along


# ---------------------------------------------------------------------------------- CUDA graph

@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_captured_in_a_cuda_graph():
    """The three kernels captured in one graph (inside a guard step, as the decode graphs are)
    and replayed on new inputs copied into the static buffers equal the reference."""
    H, Hkv, D, T, Hd, I = 9, 3, 64, 4, 576, 1536
    dt = torch.bfloat16
    x, res = randn(T, Hd, dtype=dt, seed=30), randn(T, Hd, dtype=dt, seed=31)
    w = randn(Hd, dtype=dt, seed=32)
    gu = randn(T, 2 * I, dtype=dt, seed=33)
    qkv, pos, loc, kc, vc = rope_case(T, H, Hkv, D, dt, torch.int64, seed=34)
    _, cos, sin = rope_tables(D)
    guard = kv_guard(DEV)

    def step():
        a = add_rms_norm(x, res, w, EPS)
        b = silu_and_mul(gu)
        c = rope_store_qkv(qkv, cos, sin, pos, kc, vc, loc, num_heads=H, num_kv_heads=Hkv,
                           size_limit=40)
        return a, b, c
    with guard.step():
        step()                                            # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (normed, new_res), act, q = step()
    guard.raise_if_error()
    nqkv, npos, nloc, nkc, nvc = rope_case(T, H, Hkv, D, dt, torch.int64, seed=35)
    for dst, src in ((x, randn(T, Hd, dtype=dt, seed=36)), (gu, randn(T, 2 * I, dtype=dt)),
                     (qkv, nqkv), (pos, npos), (loc, nloc), (kc, nkc), (vc, nvc)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    rn, rr = add_rms_norm_torch(x.cpu(), res.cpu(), w.cpu(), EPS)
    assert torch.equal(new_res.cpu(), rr)
    assert_ulps(normed.cpu(), rn, 1)
    assert_ulps(act.cpu(), silu_and_mul_torch(gu.cpu()), 2)
    rq, rk, rv = run_rope(rope_store_qkv_torch, *(t.cpu() for t in (qkv, cos, sin, pos, loc,
                                                                      nkc, nvc)), H, Hkv)
    assert_ulps(q.cpu(), rq, 1)
    assert torch.equal(vc.cpu(), rv)
    assert_ulps(kc.cpu(), rk, 1)


# ----------------------------------------------------------------------------- norm_matmul
# (M, K, N): decode batches of the default model (K=576: qkv N=960, gate_up N=2*1536), odd
# sizes that leave partial blocks, and the largest batch the kernel takes
NORM_MATMUL_SHAPES = [(1, 64, 96), (3, 576, 960), (17, 96, 80), (64, 64, 48)] + (
    [(1, 4096, 6144), (16, 4096, 2 * 14336), (64, 576, 2 * 1536)] if ON_GPU else [])
MATMUL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def fuse_norm_matmul(monkeypatch):
    """The kernel is off by default (slower than cuBLAS on the H200): these tests turn it on."""
    from eaglekv.kernels import fused
    monkeypatch.setattr(fused, "FUSE_NORM_MATMUL", True)


@pytest.mark.parametrize("M,K,N", NORM_MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_matmul_matches_reference(M, K, N, dtype, with_residual, silu, fuse_norm_matmul):
    """The one-kernel add_rms_norm -> matmul (-> silu_and_mul) against the three ops: the new
    residual bit-identical, the output within the matmul's rounding (its accumulation order
    differs from the BLAS's) relative to the output's scale."""
    from eaglekv.kernels.fused import norm_matmul, norm_matmul_torch
    x = randn(M, K, dtype=dtype, seed=1)
    r = randn(M, K, dtype=dtype, seed=2) if with_residual else None
    nw = randn(K, dtype=dtype, seed=3, scale=0.2) + 1
    w = randn(K, N, dtype=dtype, seed=4, scale=K ** -0.5)
    got, got_res = norm_matmul(x, r, nw, EPS, w, silu_mul=silu)
    want, want_res = norm_matmul_torch(x, r, nw, EPS, w, silu_mul=silu)
    assert got.shape == want.shape == (M, N // 2 if silu else N) and got.dtype == dtype
    assert torch.equal(got_res, want_res)
    scale = want.double().abs().max().clamp_min(1e-3)
    err = (got.double() - want.double()).abs().max() / scale
    assert err <= MATMUL_TOL[dtype], f"max error {float(err):.3g} of the output's scale"


def test_norm_matmul_reference_is_the_model_math():
    """The reference is add_rms_norm -> @ -> silu_and_mul: the formula, computed in fp64."""
    from eaglekv.kernels.fused import norm_matmul_torch
    x, r, nw, w = randn(5, 64, seed=1), randn(5, 64, seed=2), randn(64, seed=3), randn(64, 96,
                                                                                         seed=4)
    y, res = norm_matmul_torch(x.cpu(), r.cpu(), nw.cpu(), EPS, w.cpu(), silu_mul=True)
    s = x.double().cpu() + r.double().cpu()
    h = s / torch.sqrt((s * s).mean(-1, keepdim=True) + EPS) * nw.double().cpu()
    g, u = (h @ w.double().cpu()).chunk(2, -1)
    assert torch.allclose(res.double(), s, atol=1e-6)
    assert torch.allclose(y.double(), g * torch.sigmoid(g) * u, atol=1e-4, rtol=1e-4)


def test_norm_matmul_bad_arguments_name_the_value(fuse_norm_matmul):
    from eaglekv.kernels.fused import norm_matmul
    x, nw = randn(2, 64), randn(64)
    with pytest.raises(ValueError, match=r"norm_matmul: w has shape \(32, 8\), expected "
                                         r"\(64, \*\)"):
        norm_matmul(x, None, nw, EPS, randn(32, 8))
    with pytest.raises(ValueError, match=r"expected \(K, 2I\) for silu_mul"):
        norm_matmul(x, None, nw, EPS, randn(64, 7), silu_mul=True)
    with pytest.raises(TypeError, match="norm_matmul: w dtype torch.float16"):
        norm_matmul(x, None, nw, EPS, randn(64, 8, dtype=torch.float16))


# ------------------------------------------------------------------------------------ gemv
# (M, K, N): decode rows of the default model's matmuls (qkv, o, gate_up, down) on the GPU,
# partial blocks of BLOCK_N and BLOCK_K under the interpreter
GEMV_SHAPES = [(1, 64, 96), (3, 96, 40), (4, 300, 24), (6, 64, 40), (16, 200, 48),
               (9, 40, 24)] + (
    [(1, 576, 960), (2, 576, 576), (1, 576, 2 * 1536), (4, 1536, 576), (1, 4096, 6144),
     (6, 576, 960), (8, 576, 2 * 1536),       # S5's and a tree's verify rows (dot tile)
     (16, 576, 960), (16, 1536, 576), (6, 576, 49152), (12, 4096, 6144)]
    if ON_GPU else [])


@pytest.mark.parametrize("M,K,N", GEMV_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", ["none", "norm", "norm+residual"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("layout", ["column_major", "row_major"])
def test_gemv_matches_reference(M, K, N, dtype, prologue, silu, layout, monkeypatch):
    """The matrix-vector kernel (decode-sized matmuls: gemv, and norm_matmul's fused path)
    against the separate ops, for the weight in nn.Linear's layout (the engine's on CUDA) and
    in the (in, out) one: the new residual bit-identical, the output within the matmul's
    rounding relative to its scale."""
    from eaglekv.kernels import fused
    monkeypatch.setattr(fused, "FUSE_GEMV", True)        # the CPU interpreter too
    x = randn(M, K, dtype=dtype, seed=1)
    w = randn(K, N, dtype=dtype, seed=4, scale=K ** -0.5)
    if layout == "column_major":
        w = fused.column_major(w)
        assert w.stride(0) == 1 and fused.use_gemv(x, w) == (M <= fused.gemv_max_rows())
    if prologue == "none":
        if silu:
            pytest.skip("gemv alone has no SiLU epilogue")
        got, want = fused.gemv(x, w), (x.cpu() @ w.cpu()).to(DEV)
    else:
        r = randn(M, K, dtype=dtype, seed=2) if prologue == "norm+residual" else None
        nw = randn(K, dtype=dtype, seed=3, scale=0.2) + 1
        got, got_res = fused._triton_impl().gemv_triton(x, r, nw, EPS, w, silu,
                                                       fused._check_gemv)
        want, want_res = fused.norm_matmul_torch(x.cpu(), None if r is None else r.cpu(),
                                                 nw.cpu(), EPS, w.cpu().contiguous(),
                                                 silu_mul=silu)
        assert torch.equal(got_res.cpu(), want_res)
    assert got.shape == want.shape == (M, N // 2 if silu else N) and got.dtype == dtype
    scale = want.double().abs().max().clamp_min(1e-3)
    err = (got.cpu().double() - want.cpu().double()).abs().max() / scale
    assert err <= MATMUL_TOL[dtype], f"max error {float(err):.3g} of the output's scale"


def test_gemv_rows_limits(monkeypatch):
    """Up to GEMV_MAX_ROWS rows the register tile; without its row groups
    (GEMV_GROUP_MAX_ROWS 0) 5-16 rows the tensor-core tile, taken only while GEMV_DOT_MAX_ROWS
    allows (off by default until measured); never 17 rows. By default (row groups to 8 rows)
    5-8 rows the register tile's row groups, 9 rows the library."""
    from eaglekv.kernels import fused
    ft = fused._triton_impl()
    monkeypatch.setattr(fused, "FUSE_GEMV", True)
    w = fused.column_major(randn(64, 32, seed=4))
    if "EAGLEKV_GEMV_GROUP_ROWS" not in os.environ:
        assert fused.GEMV_GROUP_MAX_ROWS == 8 and fused.GEMV_DOT_MAX_ROWS == 0
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 8)
    assert [fused.use_gemv(randn(M, 64), w) for M in (4, 5, 8, 9)] == [True] * 3 + [False]
    assert [ft.gemv_tiling(M, 64)[4] for M in (5, 8, 9)] == [False, False, True]
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 0)
    assert [ft.gemv_tiling(M, 64)[4] for M in (1, 4, 5, 16)] == [False, False, True, True]
    assert ft.gemv_tiling(5, 64)[0] == 16 and ft.gemv_tiling(16, 64)[0] == 16
    monkeypatch.setattr(fused, "GEMV_DOT_MAX_ROWS", 0)
    assert [fused.use_gemv(randn(M, 64), w) for M in (4, 5, 16)] == [True, False, False]
    monkeypatch.setattr(fused, "GEMV_DOT_MAX_ROWS", 16)
    assert [fused.use_gemv(randn(M, 64), w) for M in (4, 5, 16, 17)] == [True, True, True,
                                                                         False]


@pytest.mark.parametrize("M", [5, 6, 8])
def test_gemv_row_groups_match_the_reference(M, monkeypatch):
    """5-8 rows in row groups of the 4-row register tile (`fused.GEMV_GROUP_MAX_ROWS`): the
    matmul takes them (`use_gemv`), two groups of programs, and every prologue / epilogue
    equals the reference (the residual exact); off (0; 8 by default) they go to the
    tensor-core tile when it is on, else to the library."""
    from eaglekv.kernels import fused
    ft = fused._triton_impl()
    monkeypatch.setattr(fused, "FUSE_GEMV", True)
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 0)
    w = fused.column_major(randn(64, 32, seed=4))
    assert not fused.use_gemv(randn(M, 64), w) and ft.gemv_tiling(M, 64)[4]
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 8)
    assert fused.use_gemv(randn(M, 64), w) and not fused.use_gemv(randn(9, 64), w)
    bm, _, _, _, dot = ft.gemv_tiling(M, 64)
    assert (bm, dot, ft.gemv_row_groups(M, bm, dot)) == (4, False, 2)
    _gemv_matches_reference(M)
    x = randn(M, 300, seed=1)
    wb = fused.column_major(randn(300, 40, seed=4, scale=300 ** -0.5))
    got, want = fused.gemv(x, wb), (x.cpu() @ wb.cpu())
    assert ((got.cpu().double() - want.double()).abs().max() / want.double().abs().max()
            <= MATMUL_TOL[torch.float32])


def _gemv_matches_reference(M: int, K: int = 300, N: int = 40) -> None:
    """gemv_triton at its current tiling (norm prologue, with and without SiLU*mul) against
    norm_matmul_torch: the residual exact, the product within fp32's matmul tolerance."""
    from eaglekv.kernels import fused
    x, r = randn(M, K, seed=1), randn(M, K, seed=2)
    w = fused.column_major(randn(K, N, seed=4, scale=K ** -0.5))
    nw = randn(K, seed=3, scale=0.2) + 1
    for silu in (False, True):
        want, want_res = fused.norm_matmul_torch(x.cpu(), r.cpu(), nw.cpu(), EPS,
                                                 w.cpu().contiguous(), silu_mul=silu)
        got, got_res = fused._triton_impl().gemv_triton(x, r, nw, EPS, w, silu,
                                                       fused._check_gemv)
        assert torch.equal(got_res.cpu(), want_res)
        err = (got.cpu().double() - want.double()).abs().max() / want.double().abs().max()
        assert err <= MATMUL_TOL[torch.float32], float(err)


def test_gemv_wide_rows_take_more_rows_a_program(monkeypatch):
    """One row of K >= GEMV_WIDE_K (an 8B's) takes GEMV_WIDE_BLOCK_N weight rows a program,
    SmolLM2's widths and 2-4 rows the configured block_n; an explicit block_n wins, and off
    (None) every width takes the configured one; the wide tiling matches the reference."""
    from eaglekv.kernels import fused
    ft = fused._triton_impl()
    base = ft.GEMV_CONFIG["block_n"]
    assert [ft.gemv_tiling(1, K)[1] for K in (576, 1536, 4096, 14336)] == [
        base, base, ft.GEMV_WIDE_BLOCK_N, ft.GEMV_WIDE_BLOCK_N]
    assert ft.gemv_tiling(2, 4096)[1] == ft.gemv_tiling(4, 4096)[1] == base != ft.GEMV_WIDE_BLOCK_N
    assert ft.gemv_tiling(1, 4096, block_n=2)[1] == 2
    monkeypatch.setattr(fused, "GEMV_GROUP_MAX_ROWS", 0)  # without row groups: the dot tile
    assert ft.gemv_tiling(6, 4096)[1] == ft.GEMV_DOT_CONFIG["block_n"]   # for 5-16 rows
    monkeypatch.setattr(ft, "GEMV_WIDE_K", 256)           # a small K through the wide tiling
    assert ft.gemv_tiling(1, 300)[1] == ft.GEMV_WIDE_BLOCK_N
    _gemv_matches_reference(1)
    monkeypatch.setattr(ft, "GEMV_WIDE_K", None)
    assert ft.gemv_tiling(1, 14336)[1] == base


@pytest.mark.parametrize("tiling", [(8, 128, 2), (2, 32, 1), (16, 1024, 4)])
@pytest.mark.parametrize("silu", [False, True])
def test_gemv_tilings_match_reference(tiling, silu):
    """Other tilings than the default (block_n, block_k, num_warps): K over several blocks
    (the norm's two passes and the matmul's loop), partial blocks of N, each tiling compiled
    under its own launch key (a cached launch of one tiling never runs with another's grid)."""
    from eaglekv.kernels import fused
    M, K, N = 3, 300, 40
    x, r = randn(M, K, seed=1), randn(M, K, seed=2)
    w = fused.column_major(randn(K, N, seed=4, scale=K ** -0.5))
    nw = randn(K, seed=3, scale=0.2) + 1
    want, want_res = fused.norm_matmul_torch(x.cpu(), r.cpu(), nw.cpu(), EPS,
                                             w.cpu().contiguous(), silu_mul=silu)
    for t in (tiling, None):                             # then the default: its own launch
        bn, bk, nwarps = t or (None, None, None)
        got, got_res = fused._triton_impl().gemv_triton(x, r, nw, EPS, w, silu,
                                                       fused._check_gemv, block_n=bn,
                                                       block_k=bk, num_warps=nwarps)
        assert torch.equal(got_res.cpu(), want_res)
        err = (got.cpu().double() - want.double()).abs().max() / want.double().abs().max()
        assert err <= MATMUL_TOL[torch.float32], (t, float(err))


@pytest.mark.parametrize("M", [1, 4, 8])
def test_gemv_max_tile_caps_block_k_by_rows(M, monkeypatch):
    """`max_tile` (off by default): BLOCK_K shrinks with the rows, BLOCK_M * BLOCK_K at most
    the cap (BLOCK_K at least 128), an explicit block_k and K's own size win; the capped
    tiling matches the reference."""
    from eaglekv.kernels import fused
    ft = fused._triton_impl()
    assert ft.gemv_block_k(M, 4096) == ft.GEMV_CONFIG["block_k"]           # off: unchanged
    monkeypatch.setitem(ft.GEMV_CONFIG, "max_tile", 1024)
    assert ft.gemv_block_k(M, 4096) == {1: 1024, 4: 256, 8: 128}[M]
    assert ft.gemv_block_k(8, 4096, block_k=512) == 512 and ft.gemv_block_k(1, 100) == 128
    _gemv_matches_reference(M)


def test_gemv_takes_only_decode_rows_of_column_major_weights(monkeypatch):
    from eaglekv.kernels import fused
    monkeypatch.setattr(fused, "FUSE_GEMV", True)
    w = fused.column_major(randn(64, 32))
    assert fused.use_gemv(randn(fused.gemv_max_rows(), 64), w)
    assert not fused.use_gemv(randn(fused.gemv_max_rows() + 1, 64), w)    # cuBLAS from 9 rows
    assert not fused.use_gemv(randn(1, 64), randn(64, 32))                # (in, out) rows
    monkeypatch.setattr(fused, "FUSE_GEMV", False)
    assert not fused.use_gemv(randn(1, 64), w)
    monkeypatch.setattr(fused, "FUSE_GEMV", None)   # the default: CUDA, the fused matmuls,
    from eaglekv.kernels import pdl                 # and the bare ones where PDL is on
    assert fused.use_gemv(randn(1, 64), w, fused=True) == (DEV == "cuda")
    assert fused.use_gemv(randn(1, 64), w) == (DEV == "cuda" and pdl.enabled(torch.device(DEV)))
    assert fused.gemv_on(torch.device("cuda")) and not fused.gemv_on(torch.device("cpu"))
    monkeypatch.setattr(pdl, "enabled", lambda device: False)            # a bare one: cuBLAS
    assert not fused.gemv_on(torch.device("cuda"), fused=False)
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert fused.gemv_on(torch.device("cuda"), fused=False)
    assert not fused.gemv_on(torch.device("cpu"), fused=False)
    with pytest.raises(ValueError, match=r"gemv: w has shape \(32, 8\), expected \(64, \*\)"):
        fused.gemv(randn(2, 64), randn(32, 8))


def test_gemv_takes_several_rows_only_below_the_k_bound(monkeypatch):
    """2-4 rows go to the gemv kernel only where K < GEMV_ROWS_MAX_K (4096: an 8B's 4-row
    matmuls ran its register tile at half the bandwidth cuBLAS's 8 rows reached); one row at
    any K; no bound with None (as before 2026-12-07)."""
    from eaglekv.kernels import fused
    monkeypatch.setattr(fused, "FUSE_GEMV", True)
    assert fused.GEMV_ROWS_MAX_K == 4096
    w_small, w_wide = fused.column_major(randn(4095, 8)), fused.column_major(randn(4096, 8))
    assert fused.use_gemv(randn(4, 4095), w_small) and fused.use_gemv(randn(2, 4095), w_small)
    assert fused.use_gemv(randn(1, 4096), w_wide)
    assert not fused.use_gemv(randn(2, 4096), w_wide)
    assert not fused.use_gemv(randn(4, 4096), w_wide)
    monkeypatch.setattr(fused, "GEMV_ROWS_MAX_K", None)
    assert fused.use_gemv(randn(4, 4096), w_wide)


def test_gemv_weight_bounds_send_larger_weights_to_the_library(monkeypatch):
    """GEMV_MAX_WEIGHT_BYTES bounds every matmul's weight, GEMV_BARE_MAX_WEIGHT_BYTES only a
    bare one's (no norm prologue); None (the default) bounds nothing. norm_matmul past the
    bound is the separate ops' result."""
    from eaglekv.kernels import fused
    monkeypatch.setattr(fused, "FUSE_GEMV", True)
    assert fused.GEMV_MAX_WEIGHT_BYTES is None and fused.GEMV_BARE_MAX_WEIGHT_BYTES is None
    x, w = randn(1, 64), fused.column_major(randn(64, 32))             # 8192 bytes of fp32
    assert fused.use_gemv(x, w) and fused.use_gemv(x, w, fused=True)
    monkeypatch.setattr(fused, "GEMV_BARE_MAX_WEIGHT_BYTES", 8191)
    assert not fused.use_gemv(x, w) and fused.use_gemv(x, w, fused=True)
    monkeypatch.setattr(fused, "GEMV_BARE_MAX_WEIGHT_BYTES", 8192)
    assert fused.use_gemv(x, w)
    monkeypatch.setattr(fused, "GEMV_MAX_WEIGHT_BYTES", 8191)
    assert not fused.use_gemv(x, w) and not fused.use_gemv(x, w, fused=True)
    r, nw = randn(1, 64), randn(64)
    y, s = fused.norm_matmul(x, r, nw, 1e-5, w)
    h, s_ref = fused.add_rms_norm(x, r, nw, 1e-5)
    torch.testing.assert_close(y, h @ w)
    torch.testing.assert_close(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_unchecked_equals_checked(dtype):
    """`guard.unchecked()` compiles rope_store_qkv with CHECK=False (a launch signature of its
    own): q and both caches are the checked kernel's bit for bit on valid slots."""
    from eaglekv.kernels import guard
    qkv, pos, loc, kc, vc = rope_case(5, 9, 3, 64, dtype, torch.int64, seed=4)
    _, cos, sin = rope_tables(64)
    checked = run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, 9, 3)
    with guard.unchecked():
        bare = run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, 9, 3)
    assert all(torch.equal(a, b) for a, b in zip(bare, checked))
    again = run_rope(rope_store_qkv, qkv, cos, sin, pos, loc, kc, vc, 9, 3)  # checked again
    assert all(torch.equal(a, b) for a, b in zip(again, checked))


def test_rope_heads_per_program_follow_the_batch_buckets():
    """The heads a rope_store_qkv program takes depend on the token count only through its
    power-of-two bucket (no compile mid-run for an odd eager batch), and keep a small batch
    on at least ROPE_MIN_PROGRAMS programs within ROPE_TILE elements each."""
    from eaglekv.kernels.fused_triton import ROPE_TILE, rope_heads_per_program
    nh, pb = 15, 32                                   # SmolLM2: 9 + 2 * 3 heads, 64 dims
    for T in range(1, 300):
        b = 1 << (T - 1).bit_length()
        assert rope_heads_per_program(nh, pb, T) == rope_heads_per_program(nh, pb, b)
    assert [rope_heads_per_program(nh, pb, T) for T in (1, 2, 3, 4, 8, 256)] == [1, 4, 8, 8, 16, 16]
    assert rope_heads_per_program(48 + 16, 64, 1) * 64 <= ROPE_TILE
