"""Triton paged attention (decode split-K, extend causal / tree mask) equals the PyTorch
reference, the reference equals a dense computation, and a bad slot is never read: the other
sequences' outputs stay right and KVIndexError names the op. Runs on the GPU when there is
one, else under TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
triton = pytest.importorskip("triton")

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels.attention import (  # noqa: E402
    decode_attention, decode_attention_torch, default_num_splits, extend_attention,
    extend_attention_torch)
from eaglekv.kernels.guard import kv_guard  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
SHAPES = [(9, 3, 64), (32, 8, 128), (4, 4, 64)] + ([(16, 2, 128), (8, 1, 96)] if ON_GPU else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 2e-2)}
# 4-node tree: 0 is the root, 1 and 2 its children, 3 the child of 1; a node sees its
# ancestors and itself
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


def close(a, b, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=atol, rtol=rtol)


def paged_table(lens, page_size, g):
    """A req_to_token (R+1, W) int32 table (row 0 the padding row), request b in a shuffled
    row; its position p holds slot page_b[p // ps] * ps + p % ps, pages allocated shuffled from
    [1, n_pages) (page 0 the padding page). Returns (flat table, kv_start, number of slots)."""
    B, ps = len(lens), page_size
    W = max(lens) + ps + 3
    rows = torch.randperm(B + 2, generator=g)[:B] + 1                  # (B,) in [1, R]
    n_pages = 1 + sum(-(-n // ps) for n in lens) + 2
    pages = torch.randperm(n_pages - 1, generator=g) + 1
    rtt = torch.zeros(B + 3, W, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rtt[rows[b], :n] = (pages[used + pos // ps] * ps + pos % ps).to(torch.int32)
        used += -(-n // ps)
    return rtt.view(-1), rows.to(torch.int64) * W, n_pages * ps     # kv_start = rows * W


def indptr_table(lens, g, num_slots=None):
    """A flat kv_indices buffer: [pad x3][seq 0][gap x2][seq 1][gap x2]..., random slots."""
    num_slots = num_slots or sum(lens) + 8
    parts, starts, at = [torch.zeros(3, dtype=torch.int32)], [], 3
    for n in lens:
        starts.append(at)
        parts += [torch.randint(0, num_slots, (n,), generator=g, dtype=torch.int32),
                  torch.zeros(2, dtype=torch.int32)]
        at += n + 2
    return torch.cat(parts), torch.tensor(starts, dtype=torch.int64), num_slots


def make_table(layout, lens, g):
    if layout == "indptr":
        return indptr_table(lens, g)
    return paged_table(lens, int(layout.removeprefix("page")), g)


def kv_buffers(rows, hkv, D, dtype, g):
    kb = torch.randn(rows, hkv, D, generator=g).to(dtype)
    vb = torch.randn(rows, hkv, D, generator=g).to(dtype)
    return kb, vb


def to_dev(*xs):
    return [x.to(DEV) for x in xs]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(shape, dtype):
    """B in {1, 3}, splits in {1, 3}, kv_len 1 / 70 (not a multiple of BLOCK_N) / 2 (< splits),
    tables paged (ps 1 and 16) and a flat indptr buffer."""
    H, hkv, D = shape
    g = torch.Generator().manual_seed(H + D)
    for B, splits, layout in [(1, 3, "page1"), (3, 1, "page16"), (3, 3, "indptr")]:
        lens = [70, 1, 2][:B]
        table, start, rows = make_table(layout, lens, g)
        kb, vb = kv_buffers(rows, hkv, D, dtype, g)
        q = torch.randn(B, H, D, generator=g).to(dtype)
        kv_len = torch.tensor(lens)
        ref = decode_attention_torch(q, kb, vb, table, start, kv_len, D ** -0.5,
                                     size_limit=rows)
        out = decode_attention(*to_dev(q, kb, vb, table, start, kv_len), D ** -0.5,
                               size_limit=rows, num_splits=splits)
        close(out, ref, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_matches_reference(shape, dtype):
    """Causal over a paged (ps 1) table, tree mask over a ps-16 table, causal over a flat
    indptr buffer; prefixes 0 / 70 / 5."""
    H, hkv, D = shape
    g = torch.Generator().manual_seed(H * D)
    pre, ext = [70, 0, 5], [4, 3, 1]
    for mask, layout in [(None, "page1"), (TREE, "page16"), (None, "indptr")]:
        table, start, rows = make_table(layout, [p + e for p, e in zip(pre, ext)], g)
        kb, vb = kv_buffers(rows, hkv, D, dtype, g)
        q = torch.randn(sum(ext), H, D, generator=g).to(dtype)
        m = None if mask is None else mask.expand(3, 4, 4).clone()
        args = (table, start, torch.tensor(pre), torch.tensor(ext), torch.tensor([0, 4, 7]))
        ref = extend_attention_torch(q, kb, vb, *args, D ** -0.5, size_limit=rows, mask=m)
        out = extend_attention(*to_dev(q, kb, vb, *args), D ** -0.5, size_limit=rows,
                               mask=None if m is None else m.to(DEV), max_extend=4)
        close(out, ref, dtype)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 64)])
def test_extend_several_query_blocks(shape):
    """40 queries (more than one query block) after a 70-key prefix, causal; the second
    request's queries start after a gap in q, whose rows stay untouched."""
    H, hkv, D = shape
    g = torch.Generator().manual_seed(5)
    pre, ext = [70, 3], [40, 17]
    table, start, rows = paged_table([p + e for p, e in zip(pre, ext)], 16, g)
    kb, vb = kv_buffers(rows, hkv, D, torch.float16, g)
    q = torch.randn(60, H, D, generator=g).to(torch.float16)
    args = (table, start, torch.tensor(pre), torch.tensor(ext), torch.tensor([0, 43]))
    sentinel = torch.full_like(q, 7.0)
    ref = extend_attention_torch(q, kb, vb, *args, 0.1, size_limit=rows, out=sentinel)
    out = extend_attention(*to_dev(q, kb, vb, *args), 0.1, size_limit=rows, max_extend=40,
                           out=sentinel.to(DEV))
    close(out, ref, torch.float16)
    assert torch.equal(out[40:43].cpu(), sentinel[40:43])


def test_tree_mask_and_untouched_rows():
    """Tree verify of two requests (4 and 3 nodes in a width-4 window): each request's rows
    equal a per-node dense computation over prefix + ancestors + itself; the padding query
    rows past extend_len are not written."""
    H, hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(11)
    pre, ext = [6, 9], [4, 3]
    table, start, rows = paged_table([p + 4 for p in pre], 1, g)
    kb, vb = kv_buffers(rows, hkv, D, torch.float32, g)
    q = torch.randn(8, H, D, generator=g)                              # request 1: rows 4..6
    mask = TREE.expand(2, 4, 4).clone()
    out = torch.full_like(q, -3.0).to(DEV)
    extend_attention(*to_dev(q, kb, vb, table, start, torch.tensor(pre), torch.tensor(ext),
                             torch.tensor([0, 4])), 0.125, size_limit=rows,
                     mask=mask.to(DEV), max_extend=4, out=out)
    out = out.cpu()
    assert torch.equal(out[7], torch.full((H, D), -3.0))              # past extend_len[1]
    for b, q0 in enumerate([0, 4]):
        for t in range(ext[b]):
            keys = list(range(pre[b])) + [pre[b] + j for j in range(4) if TREE[t, j]]
            slots = table[start[b] + torch.tensor(keys)].long()
            k = kb[slots].repeat_interleave(H // hkv, 1)               # (S, H, D)
            v = vb[slots].repeat_interleave(H // hkv, 1)
            p = torch.softmax(torch.einsum("hd,shd->hs", q[q0 + t], k) * 0.125, -1)
            torch.testing.assert_close(out[q0 + t], torch.einsum("hs,shd->hd", p, v),
                                       atol=2e-5, rtol=1e-5)


def test_reference_equals_dense():
    """The references against independent computations: decode against SDPA over a padded
    (B, Smax) gather; extend (causal) against causal SDPA over the whole sequence."""
    H, hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(3)
    lens = [5, 1, 33]
    table, start, rows = paged_table(lens, 16, g)
    kb, vb = kv_buffers(rows, hkv, D, torch.float64, g)
    q = torch.randn(3, H, D, generator=g, dtype=torch.float64)
    ref = decode_attention_torch(q, kb, vb, table, start, torch.tensor(lens), 0.2,
                                 size_limit=rows)
    S = max(lens)
    pos = torch.arange(S)
    valid = pos[None, :] < torch.tensor(lens)[:, None]                 # (B, S)
    idx = torch.where(valid, table[start[:, None] + pos[None, :]].long(), 0)
    k, v = kb[idx].transpose(1, 2), vb[idx].transpose(1, 2)            # (B, Hkv, S, D)
    dense = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None],
                                           scale=0.2, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(ref, dense)
    # extend: the last e positions of a causal pass over all L = p + e positions
    pre, ext = [5, 0, 28], [3, 1, 5]
    qx = torch.randn(9, H, D, generator=g, dtype=torch.float64)
    got = extend_attention_torch(qx, kb, vb, table, start, torch.tensor(pre), torch.tensor(ext),
                                 torch.tensor([0, 3, 4]), 0.2, size_limit=rows)
    for b, q0 in enumerate([0, 3, 4]):
        L = pre[b] + ext[b]
        slots = table[start[b]:start[b] + L].long()
        qf = torch.cat([torch.randn(pre[b], H, D, dtype=torch.float64, generator=g),
                        qx[q0:q0 + ext[b]]])                            # (L, H, D)
        full = F.scaled_dot_product_attention(qf.transpose(0, 1), kb[slots].transpose(0, 1),
                                              vb[slots].transpose(0, 1), is_causal=True,
                                              scale=0.2, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got[q0:q0 + ext[b]], full[pre[b]:])


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_len,splits", [(70, 3), (2, 16), (0, 4)])
def test_decode_merge_in_the_o_projection(shape, dtype, kv_len, splits):
    """`defer_merge` leaves the split-K partials for the o projection (`fused.gemv_merge`):
    the merge kernel followed by the gemv (bit for bit on the CPU), with splits past the keys (2 keys in
    16 splits) and no keys at all (zeros in, zeros out); `finish()` is the undeferred output."""
    from eaglekv.kernels import fused
    from eaglekv.kernels.attention import DecodePartials
    H, hkv, D = shape
    g = torch.Generator().manual_seed(kv_len + splits + D)
    table, start, rows = paged_table([kv_len], 4, g)
    kb, vb = kv_buffers(rows, hkv, D, dtype, g)
    q = torch.randn(1, H, D, generator=g).to(dtype)
    w = fused.column_major(torch.randn(H * D, 24, generator=g).to(dtype)).to(DEV)
    args = (*to_dev(q, kb, vb, table, start, torch.tensor([kv_len])), D ** -0.5)
    plain = decode_attention(*args, size_limit=rows, num_splits=splits)
    p = decode_attention(*args, size_limit=rows, num_splits=splits, defer_merge=True)
    assert isinstance(p, DecodePartials) and p.mid_o.shape[:3] == (1, H, splits)
    got = fused.gemv_merge(p, w)
    want = fused.gemv(plain.reshape(1, -1), w)
    if ON_GPU:      # the two kernels' reductions may sum in another order
        close(got, want, dtype)
    else:
        assert torch.equal(got, want)
    assert torch.equal(p.finish(), plain)
    if kv_len == 0:
        assert not got.any()
    # the kernel's one K tile: unpadded power-of-two heads, pow2(H) * D <= 1024
    assert fused.merge_fits(9, 64) and fused.merge_fits(4, 32)
    assert not fused.merge_fits(8, 96) and not fused.merge_fits(32, 128)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,kv_lens,splits", [(1, [70], 3), (3, [2, 40, 0], 16), (2, [9, 30], 1)])
def test_merge_and_o_projection_in_one_launch(shape, dtype, B, kv_lens, splits):
    """`fused.merge_o`: the split-K partials (or, unsplit, the attention output) merged per
    head and times that head's rows of o, summed into an fp32 accumulator: the merged
    attention in w's dtype times w within fp32 summation order, rows past B untouched, the
    next layer's buffer cleared; with splits past the keys and a row with no keys."""
    from eaglekv.kernels import fused
    H, hkv, D = shape
    g = torch.Generator().manual_seed(sum(kv_lens) + splits + D + B)
    table, start, rows = paged_table(kv_lens, 4, g)
    kb, vb = kv_buffers(rows, hkv, D, dtype, g)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    N = 80
    w = fused.column_major(torch.randn(H * D, N, generator=g).to(dtype)).to(DEV)
    args = (*to_dev(q, kb, vb, table, start, torch.tensor(kv_lens)), D ** -0.5)
    plain = decode_attention(*args, size_limit=rows, num_splits=splits)
    attn = decode_attention(*args, size_limit=rows, num_splits=splits, defer_merge=True)
    acc = torch.zeros((4, N), dtype=torch.float32, device=DEV)
    zero = torch.full((4, N), 3.0, dtype=torch.float32, device=DEV)
    got = fused.merge_o(attn, w, acc, zero)
    assert got.shape == (B, N) and got.data_ptr() == acc.data_ptr()
    want = fused.merge_o_torch(plain, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max()))
    assert not acc[B:].any() and not zero.any()
    if 0 in kv_lens:
        assert not got[kv_lens.index(0)].any()
    with pytest.raises(ValueError, match="same buffer"):
        fused.merge_o(plain, w, acc, acc)
    with pytest.raises(ValueError, match="does not match w"):
        fused.merge_o(plain, w[:-1], acc, zero)


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's constexpr `name`, then launches."""

    def __init__(self, kernel, name):
        self.kernel, self.name, self.seen = kernel, name, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.append(kw.get(self.name))
            return launch(*args, **kw)
        return run


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,splits", [([70, 1, 0, 9], 1), ([70, 2, 130], 3),
                                         ([19, 1], 16)])
def test_decode_prefetch_is_the_same_kernel(page_size, dtype, lens, splits, monkeypatch):
    """`DECODE_PREFETCH` (a one-token decode over a checked table reads its first key tile,
    all but the last key, before the PDL wait): the same output bit for bit as without it,
    over requests of 0, 1, 2 keys, two and three key tiles (70 and 130 keys, tiles of 64),
    splits past the keys; and only a `one_token` call over a checked table takes it."""
    from eaglekv.kernels import attention_triton
    H, hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(sum(lens) + splits + page_size)
    table, start, rows = paged_table(lens, page_size, g)
    kb, vb = kv_buffers(rows, hkv, D, dtype, g)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    args = (*to_dev(q, kb, vb, table, start, torch.tensor(lens)), D ** -0.5)
    spy = _LaunchSpy(attention_triton._decode_kernel, "PREFETCH")
    monkeypatch.setattr(attention_triton, "_decode_kernel", spy)
    kw = dict(size_limit=rows, num_splits=splits, checked=False, one_token=True)
    monkeypatch.setattr(attention_triton, "DECODE_PREFETCH", False)
    want = decode_attention(*args, **kw)
    monkeypatch.setattr(attention_triton, "DECODE_PREFETCH", True)
    got = decode_attention(*args, **kw)
    decode_attention(*args, **{**kw, "one_token": False})      # a verify's or a draft's
    decode_attention(*args, **{**kw, "checked": True})          # the kernel checks the table
    assert spy.seen == [False, True, False, False]
    assert torch.equal(got, want)
    close(got, decode_attention_torch(q, kb, vb, table, start, torch.tensor(lens), D ** -0.5,
                                      size_limit=rows), dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_empty_sequence_and_out(splits):
    """kv_len 0 gives zeros (not NaN); `out=` is written in place and returned."""
    g = torch.Generator().manual_seed(2)
    table, start, rows = paged_table([0, 4], 1, g)
    kb, vb = kv_buffers(rows, 3, 64, torch.float16, g)
    q = torch.randn(2, 9, 64, generator=g).to(torch.float16)
    kv_len = torch.tensor([0, 4])
    out = torch.full((2, 9, 64), float("nan"), dtype=torch.float16, device=DEV)
    res = decode_attention(*to_dev(q, kb, vb, table, start, kv_len), 0.125, size_limit=rows,
                           num_splits=splits, out=out)
    assert res is out and torch.equal(out[0].cpu(), torch.zeros(9, 64, dtype=torch.float16))
    close(out, decode_attention_torch(q, kb, vb, table, start, kv_len, 0.125, size_limit=rows),
          torch.float16)


def _bad_tables(bad):
    """Three sequences over a ps-1 table; sequence 1 has `bad` at positions 2, 5 and 65."""
    g = torch.Generator().manual_seed(9)
    lens = [9, 70, 6]
    table, start, rows = paged_table(lens, 1, g)
    good = table.clone()
    for pos in (2, 5, 65):
        table[start[1] + pos] = bad(rows)
    return g, lens, table, good, start, rows, int(start[1]) + 2


BAD = {"limit": lambda rows: rows, "negative": lambda rows: -1}


@pytest.mark.parametrize("which", list(BAD))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_bad_slot(which, splits):
    """Inside a step: masked, the other sequences equal the reference, raise_if_error names
    the op, layer, first bad slot and counts 3 (each bad key once, over heads and splits).
    Outside a step: raises at once. CPU path: raises before computing."""
    g, lens, table, good, start, rows, _ = _bad_tables(BAD[which])
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    q = torch.randn(3, 9, 64, generator=g)
    kv_len = torch.tensor(lens)
    ref = decode_attention_torch(q, kb, vb, good, start, kv_len, 0.125, size_limit=rows)
    bad = BAD[which](rows)
    msg = (rf"slot {bad} out of range \[0, {rows}\) in decode_attention \(layer 4, 3 of "
           rf"{table.numel()} indices bad\)")
    dq, dk, dv, dt, ds, dl = to_dev(q, kb, vb, table, start, kv_len)
    guard = kv_guard(DEV)
    with guard.step():
        out = decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows, layer=4,
                               num_splits=splits)
    with pytest.raises(KVIndexError, match=msg):
        guard.raise_if_error()
    close(out[[0, 2]], ref[[0, 2]], torch.float32)
    assert torch.isfinite(out[1]).all()
    with pytest.raises(KVIndexError, match=msg):
        decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows, layer=4,
                         num_splits=splits)
    with pytest.MonkeyPatch.context() as mp:                           # the torch path
        mp.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        out = torch.full_like(q, 5.0)
        with pytest.raises(KVIndexError, match=rf"slot {bad} .* decode_attention \(layer 4, "
                                               rf"3 of 85 indices bad\)"):
            decode_attention(q, kb, vb, table, start, kv_len, 0.125, size_limit=rows,
                             layer=4, out=out)
        assert torch.equal(out, torch.full_like(q, 5.0))


@pytest.mark.parametrize("which", list(BAD))
@pytest.mark.parametrize("mask", [False, True])
def test_extend_bad_slot(which, mask):
    """Bad slots in request 1's prefix (read by both query blocks and every kv head) and in
    its window (read by the second block only): each reported once, the other requests equal
    the reference."""
    g, lens, table, good, start, rows, _ = _bad_tables(BAD[which])
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    pre, ext = [5, 25, 2], [4, 45, 4]                                 # prefix + ext == lens
    q = torch.randn(53, 9, 64, generator=g)
    m = torch.ones(3, 45, 45, dtype=torch.bool).tril() if mask else None
    args = (start, torch.tensor(pre), torch.tensor(ext), torch.tensor([0, 4, 49]))
    ref = extend_attention_torch(q, kb, vb, good, *args, 0.125, size_limit=rows, mask=m)
    guard = kv_guard(DEV)
    with guard.step():
        out = extend_attention(*to_dev(q, kb, vb, table, *args), 0.125, size_limit=rows,
                               mask=None if m is None else m.to(DEV), max_extend=45)
    with pytest.raises(KVIndexError, match=rf"slot {BAD[which](rows)} out of range \[0, "
                                           rf"{rows}\) in extend_attention \(3 of "
                                           rf"{table.numel()} indices bad\)"):
        guard.raise_if_error()
    close(out[:4], ref[:4], torch.float32)
    close(out[49:], ref[49:], torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        with pytest.raises(KVIndexError, match=r"extend_attention \(3 of 85 indices bad\)"):
            extend_attention(q, kb, vb, table, *args, 0.125, size_limit=rows, mask=m)


@pytest.mark.parametrize("tile", [(16, 32), (32, 64), (16, 64)], ids=lambda t: f"r{t[0]}n{t[1]}")
def test_short_extend_tiles_match_reference(tile, monkeypatch):
    """A short extend's tile (SHORT_MIN_ROWS rows of queries x heads, SHORT_BLOCK_N keys a
    tile: smaller tiles keep the verify kernel's registers from spilling): the same results,
    tree masks, several query blocks, untouched rows and bad slots as the default tile."""
    from eaglekv.kernels import attention_triton as at
    monkeypatch.setattr(at, "SHORT_MIN_ROWS", tile[0])
    monkeypatch.setattr(at, "SHORT_BLOCK_N", tile[1])
    rows, keys = tile
    assert at.extend_tile(6, 4, 64) == (max(-(-rows // 4), 8), keys, True)   # SmolLM2's S5 verify
    assert at.extend_tile(45, 4, 64) == (32, keys, True)
    assert at.extend_tile(100, 4, 64)[:2] == (32, 64)                        # not short
    assert at.extend_tile(4, 1, 64) == (max(rows, 4), keys, True)            # no grouping
    test_tree_mask_and_untouched_rows()
    test_extend_several_query_blocks((9, 3, 64))
    test_extend_matches_reference((9, 3, 64), torch.bfloat16)
    test_extend_bad_slot("limit", True)


def _args(**over):
    """A valid small decode call, with some arguments replaced."""
    a = dict(q=torch.zeros(2, 9, 64), k_buffer=torch.zeros(8, 3, 64),
             v_buffer=torch.zeros(8, 3, 64), table=torch.zeros(16, dtype=torch.int32),
             kv_start=torch.zeros(2, dtype=torch.int64), kv_len=torch.ones(2, dtype=torch.int64),
             scale=0.125)
    a.update(over)
    kw = {k: a.pop(k) for k in list(a) if k not in ("q", "k_buffer", "v_buffer", "table",
                                                    "kv_start", "kv_len", "scale")}
    return a, {"size_limit": 8, **kw}


@pytest.mark.parametrize("over,err,match", [
    (dict(table=torch.zeros(16, dtype=torch.int64)), TypeError, "flat int32"),
    (dict(table=torch.zeros(2, 8, dtype=torch.int32)), TypeError, r"view\(-1\)"),
    (dict(k_buffer=torch.zeros(8, 4, 64), v_buffer=torch.zeros(8, 4, 64)), ValueError,
     "9 query heads is not a multiple of 4 kv heads"),
    (dict(k_buffer=torch.zeros(8, 3, 64, dtype=torch.float16)), TypeError, "k_buffer dtype"),
    (dict(v_buffer=torch.zeros(8, 3, 32)), ValueError, "must both be"),
    (dict(k_buffer=torch.zeros(8, 64, 3).transpose(1, 2)), ValueError, "contiguous"),
    (dict(size_limit=9), ValueError, r"size_limit=9 must be an int in \[1, 8\]"),
    (dict(kv_len=torch.ones(3, dtype=torch.int64)), ValueError, "kv_len has 3 entries"),
    (dict(kv_start=torch.zeros(2)), TypeError, "kv_start must be a 1-D int64"),
    (dict(q=torch.zeros(2, 9)), ValueError, "expected 3-D"),
    (dict(q=torch.zeros(2, 9, 64, dtype=torch.float64)), TypeError, "q dtype"),
    (dict(num_splits=0), ValueError, "num_splits=0"),
    (dict(out=torch.zeros(2, 9, 32)), ValueError, "out is"),
    (dict(scale=float("nan")), TypeError, "scale=nan"),
])
def test_decode_bad_arguments(over, err, match):
    a, kw = _args(**over)
    with pytest.raises(err, match=match):
        decode_attention(*a.values(), **kw)


def test_extend_bad_arguments():
    a, kw = _args()
    q, kb, vb, table, start, _, scale = a.values()
    lens = torch.ones(2, dtype=torch.int64)
    call = (q, kb, vb, table, start, lens, lens, start, scale)
    with pytest.raises(ValueError, match=r"mask is torch.int64 \(2, 4, 4\)"):
        extend_attention(*call, size_limit=8, mask=torch.ones(2, 4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expected bool \(2, Nmax, Nmax\)"):
        extend_attention(*call, size_limit=8, mask=torch.ones(3, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"max_extend=3 must be an int in \[0, 2\]"):
        extend_attention(*call, size_limit=8, max_extend=3)
    with pytest.raises(ValueError, match="q_start has 3 entries"):
        extend_attention(*call[:7], torch.zeros(3, dtype=torch.int64), scale, size_limit=8)
    if ON_GPU:
        with pytest.raises(ValueError, match="different devices"):
            extend_attention(q.cuda(), *call[1:], size_limit=8)


def test_default_num_splits():
    assert default_num_splits(1, 3, 10**6) == 16                       # capped
    assert default_num_splits(1, 3, 100) == 2                          # >= 64 keys a split
    assert default_num_splits(64, 8, 4096) == 1                        # 512 programs already
    assert default_num_splits(8, 3, 4096) == 11                        # 8*3*11 >= 264
    # a batch is rounded up to a power of two (a graph bucket's count: no compile mid-run)
    assert [default_num_splits(b, 3, 4096) for b in (5, 6, 7)] == [11] * 3
    assert default_num_splits(9, 3, 4096) == default_num_splits(16, 3, 4096) == 6


def test_no_triton_import_at_module_import():
    code = ("import sys, eaglekv.kernels.attention; "
            "assert 'eaglekv.kernels.attention_triton' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif(not ON_GPU, reason="needs > 2**31 elements per buffer")
def test_slot_times_stride_past_2_31():
    """Slots whose byte offset passes 2**31 elements (int64 address arithmetic)."""
    hkv, D = 1, 16
    rows = 2**31 // (hkv * D) + 64
    kb = torch.zeros(rows, hkv, D, dtype=torch.bfloat16, device="cuda")
    vb = torch.zeros_like(kb)
    slots = torch.arange(rows - 40, rows, device="cuda", dtype=torch.int32)
    kb[slots.long()] = torch.randn(40, hkv, D, device="cuda").to(torch.bfloat16)
    vb[slots.long()] = torch.randn(40, hkv, D, device="cuda").to(torch.bfloat16)
    q = torch.randn(1, 2, D, device="cuda").to(torch.bfloat16)
    start = torch.zeros(1, dtype=torch.int64, device="cuda")
    kv_len = torch.full((1,), 40, dtype=torch.int64, device="cuda")
    out = decode_attention(q, kb, vb, slots, start, kv_len, 0.25, size_limit=rows,
                           num_splits=2)
    ref = decode_attention_torch(q.cpu(), kb[slots.long()].cpu(), vb[slots.long()].cpu(),
                                 torch.arange(40, dtype=torch.int32), start.cpu(),
                                 kv_len.cpu(), 0.25, size_limit=40)
    close(out, ref, torch.bfloat16)
    tx = extend_attention(q[0:1].expand(3, 2, D).contiguous(), kb, vb, slots, start,
                          torch.tensor([37], device="cuda"), torch.tensor([3], device="cuda"),
                          torch.zeros(1, dtype=torch.int64, device="cuda"), 0.25,
                          size_limit=rows)
    close(tx[2:3], ref, torch.bfloat16)                                # last query sees all


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_cuda_graph_capture_and_replay():
    """Captured once with fixed buffers, replayed with new kv_len / tables: equals the
    reference each time (no host sync, no device-dependent shapes)."""
    g = torch.Generator().manual_seed(4)
    table, start, rows = paged_table([300, 200, 100], 16, g)
    kb, vb = kv_buffers(rows, 3, 64, torch.bfloat16, g)
    dq = torch.randn(3, 9, 64, generator=g).to(torch.bfloat16).cuda()
    dk, dv, dt, ds = to_dev(kb, vb, table, start)
    dl = torch.tensor([300, 200, 100], device="cuda")
    out = torch.empty_like(dq)
    guard = kv_guard("cuda")
    with guard.step():
        decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows, max_kv_len=300,
                         out=out)                                      # warm-up (compile)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows, max_kv_len=300,
                             out=out)
    guard.raise_if_error()
    for lens in ([300, 200, 100], [17, 1, 0], [64, 299, 65]):
        dl.copy_(torch.tensor(lens))
        dq.copy_(torch.randn(3, 9, 64, generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_torch(dq.cpu(), kb, vb, table, start, torch.tensor(lens),
                                     0.125, size_limit=rows)
        close(out, ref, torch.bfloat16)


def _outside_msg(op, first, n_table, count=None, layer=None):
    where = f"layer {layer}, " if layer is not None else ""
    n = rf"{count} of {n_table}" if count is not None else rf"\d+ of {n_table}"
    return (rf"slot {first} out of range \[0, {n_table}\) in {op} table position "
            rf"\({where}{n} indices bad")


def _raises_in_step(call, match):
    """`call` inside a guard step: no error until raise_if_error, which names `match`."""
    guard = kv_guard(DEV)
    with guard.step():
        out = call()
    with pytest.raises(KVIndexError, match=match):
        guard.raise_if_error()
    return out


# request 1's metadata corrupted: (kv_start, kv_len) of a paged table of n entries
# (its row at start1) -> (expected first position, count)
DECODE_OUTSIDE = {
    "start_past_end": (lambda n, s1: (n - 5, 70), lambda n, s1: (n, 65)),
    "row_past_table": (lambda n, s1: (n + 3 * 80, 70), lambda n, s1: (n + 240, 70)),
    "start_negative": (lambda n, s1: (-3, 70), lambda n, s1: (-1, 3)),
    "negative_only": (lambda n, s1: (-20, 9), lambda n, s1: (-12, 9)),   # the one nearest 0
    "len_huge": (lambda n, s1: (s1, 2**31 - 1), lambda n, s1: (n, s1 + 2**31 - 1 - n)),
}


@pytest.mark.parametrize("case", list(DECODE_OUTSIDE))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_table_position_outside(case, splits):
    """A corrupt kv_start / kv_len that reads past the request table (or before it): no
    position outside the table is read, the step's sync raises KVIndexError naming
    "decode_attention table position", the first such position and the count; the other
    sequences equal the reference; outside a step it raises at once; the torch path raises
    the same before computing."""
    g = torch.Generator().manual_seed(21)
    lens = [9, 70, 6]
    table, start, rows = paged_table(lens, 1, g)
    n = table.numel()
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    q = torch.randn(3, 9, 64, generator=g)
    ref = decode_attention_torch(q, kb, vb, table, start, torch.tensor(lens), 0.125,
                                 size_limit=rows)
    s1, l1 = DECODE_OUTSIDE[case][0](n, int(start[1]))
    first, count = DECODE_OUTSIDE[case][1](n, int(start[1]))
    bad_start, bad_len = start.clone(), torch.tensor(lens)
    bad_start[1], bad_len[1] = s1, l1
    msg = _outside_msg("decode_attention", first, n, count, layer=2)
    dq, dk, dv, dt, ds, dl = to_dev(q, kb, vb, table, bad_start, bad_len)
    out = _raises_in_step(lambda: decode_attention(dq, dk, dv, dt, ds, dl, 0.125,
                                                   size_limit=rows, layer=2, max_kv_len=70,
                                                   num_splits=splits), msg)
    close(out[[0, 2]], ref[[0, 2]], torch.float32)
    assert torch.isfinite(out[1]).all()
    with pytest.raises(KVIndexError, match=msg):                       # outside a step
        decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows, layer=2,
                         max_kv_len=70, num_splits=splits)
    with pytest.MonkeyPatch.context() as mp:                           # the torch path
        mp.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        res = torch.full_like(q, 5.0)
        with pytest.raises(KVIndexError, match=msg) as e:
            decode_attention(q, kb, vb, table, bad_start, bad_len, 0.125, size_limit=rows,
                             layer=2, out=res)
        assert torch.equal(res, torch.full_like(q, 5.0))
        assert e.value.first_bad == first and e.value.op == "decode_attention table position"


def test_decode_kv_indices_segment_past_buffer():
    """The draft's flat kv_indices buffer: the last segment's kv_indptr moved so that it runs
    4 entries past the buffer; also an error with a bad slot in another request: the table
    position (the earlier guard call) is the one named, the count is the step's."""
    g = torch.Generator().manual_seed(22)
    lens = [5, 7, 6]
    table, start, rows = indptr_table(lens, g)
    n = table.numel()
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    q = torch.randn(3, 9, 64, generator=g)
    bad = start.clone()
    bad[2] = n - 2
    dq, dk, dv, dt, ds, dl = to_dev(q, kb, vb, table, bad, torch.tensor(lens))
    msg = _outside_msg("decode_attention", n, n, 4)
    _raises_in_step(lambda: decode_attention(dq, dk, dv, dt, ds, dl, 0.125, size_limit=rows,
                                             num_splits=2), msg)
    dt2 = dt.clone()
    dt2[int(start[0]) + 1] = rows                                      # and a bad slot
    _raises_in_step(lambda: decode_attention(dq, dk, dv, dt2, ds, dl, 0.125, size_limit=rows,
                                             num_splits=2), _outside_msg("decode_attention",
                                                                         n, n, 5))   # 4 + 1


def test_extend_writes_only_its_own_rows():
    """A corrupt extend_len never writes another request's output rows, whatever order the
    programs run in (on the H200 the test below lost request 2's rows to request 1's
    extend_len of 1000, a race the interpreter's in-order grid hides): rows past the next
    request's q_start, and past the grid's max_extend, keep what `out` held."""
    g = torch.Generator().manual_seed(5)
    pre, true_ext = [5, 3], [10, 0]
    table, start, rows = paged_table([pre[0] + 40, pre[1] + 4], 1, g)
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    q = torch.randn(53, 9, 64, generator=g)
    q0 = torch.tensor([0, 10])
    ref = extend_attention_torch(q, kb, vb, table, start, torch.tensor(pre),
                                 torch.tensor(true_ext), q0, 0.125, size_limit=rows)
    sentinel = torch.full_like(q, 7.0)
    # request 0's extend_len 40 (in its table, so nothing to report) runs into request 1's
    # rows [10, 53): request 1 has no query this step, and its rows must keep the sentinel
    out = extend_attention(*to_dev(q, kb, vb, table, start, torch.tensor(pre),
                                   torch.tensor([40, 0]), q0), 0.125, size_limit=rows,
                           max_extend=45, out=sentinel.clone().to(DEV))
    close(out[:10], ref[:10], torch.float32)               # causal: rows < 10 see j <= t only
    assert torch.equal(out[10:].cpu(), sentinel[10:])
    with pytest.MonkeyPatch.context() as mp:                  # the torch path refuses it
        mp.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        with pytest.raises(ValueError, match=r"queries \[0, 40\) of request 0 run into request "
                                             r"1's, which start at 10"):
            extend_attention(q, kb, vb, table, start, torch.tensor(pre), torch.tensor([40, 0]),
                             q0, 0.125, size_limit=rows)
    # one request, extend_len 1000 past the grid's 45 rows (and past its table: reported)
    out = _raises_in_step(
        lambda: extend_attention(*to_dev(q, kb, vb, table, start[:1], torch.tensor(pre[:1]),
                                         torch.tensor([1000]), q0[:1]), 0.125,
                                 size_limit=rows, max_extend=45, out=sentinel.clone().to(DEV)),
        r"extend_attention table position")
    assert torch.equal(out[45:].cpu(), sentinel[45:])


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("case", ["prefix_past_end", "start_negative", "extend_past_grid"])
def test_extend_table_position_outside(case, mask):
    """Extend (verify / prefill) with request 1's kv_start, prefix_len or extend_len corrupt:
    prefix and window reads past the table are not made and are reported once, naming
    "extend_attention table position" and the first such position; an extend_len past the
    grid's max_extend (a corrupt one) is reported by the last query block in the grid. The
    other requests equal the reference; the torch path raises before computing."""
    g = torch.Generator().manual_seed(23)
    pre, ext = [5, 25, 2], [4, 45, 4]
    table, start, rows = paged_table([p + e for p, e in zip(pre, ext)], 1, g)
    n = table.numel()
    kb, vb = kv_buffers(rows, 3, 64, torch.float32, g)
    q = torch.randn(53, 9, 64, generator=g)
    m = torch.ones(3, 45, 45, dtype=torch.bool).tril() if mask else None
    q0 = torch.tensor([0, 4, 49])
    ref = extend_attention_torch(q, kb, vb, table, start, torch.tensor(pre), torch.tensor(ext),
                                 q0, 0.125, size_limit=rows, mask=m)
    bad_start, bad_ext = start.clone(), torch.tensor(ext)
    if case == "prefix_past_end":          # prefix [n-10, n+15), window [n+15, n+60)
        bad_start[1] = n - 10
        first, count, tcount = n, 60, 60
    elif case == "start_negative":         # prefix [-7, 18), window in the table
        bad_start[1] = -7
        first, count, tcount = -1, 7, 7
    else:                                  # the window runs 1000 past the table
        bad_start[1], bad_ext[1] = n - 30, 1000
        # causal: block_m 32 (4 query rows per program x 3 kv heads), 2 blocks in the grid,
        # the last reads the keys pos < 25 + 64; a tree mask reads the whole window
        tcount = 25 + 1000 - 30
        first, count = n, tcount if mask else 25 + 64 - 30
    args = (bad_start, torch.tensor(pre), bad_ext, q0)
    out = _raises_in_step(
        lambda: extend_attention(*to_dev(q, kb, vb, table, *args), 0.125, size_limit=rows,
                                 mask=None if m is None else m.to(DEV), max_extend=45),
        _outside_msg("extend_attention", first, n, count))
    close(out[:4], ref[:4], torch.float32)
    close(out[49:], ref[49:], torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLEKV_TRITON_ON_CPU", "0")
        with pytest.raises(KVIndexError, match=_outside_msg("extend_attention", first, n,
                                                            tcount)):
            extend_attention(q, kb, vb, table, *args, 0.125, size_limit=rows, mask=m)


def test_outside_key_round_trip():
    """TablePositions decodes the kernels' 32-bit key of a position outside the table."""
    from eaglekv.kernels.attention_triton import TablePositions
    tp = TablePositions(1000)
    assert tp.reshape(-1) is tp and tp.numel() == 1000
    assert [tp[0], tp[7], tp[2**31], tp[2**31 + 4]] == [1000, 1007, -1, -5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchecked_kernels_equal_the_checked_ones(dtype):
    """`guard.unchecked()` (the bench's measure of what the checks cost) compiles decode and
    extend with CHECK=False: on valid tables their outputs are the checked kernels' bit for
    bit (split-K, paged and indptr tables, causal and tree masks), and no error is recorded."""
    from eaglekv.kernels import guard
    H, hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(11)
    for B, splits, layout in [(1, 3, "page1"), (3, 1, "page16"), (3, 3, "indptr")]:
        lens = [70, 1, 2][:B]
        table, start, rows = make_table(layout, lens, g)
        kb, vb = kv_buffers(rows, hkv, D, dtype, g)
        q = torch.randn(B, H, D, generator=g).to(dtype)
        args = to_dev(q, kb, vb, table, start, torch.tensor(lens))
        checked = decode_attention(*args, D ** -0.5, size_limit=rows, num_splits=splits)
        with guard.unchecked():
            bare = decode_attention(*args, D ** -0.5, size_limit=rows, num_splits=splits)
        assert torch.equal(bare, checked)
    pre, ext = [70, 0, 5], [4, 3, 1]
    for mask, layout in [(None, "page1"), (TREE, "page16"), (None, "indptr")]:
        table, start, rows = make_table(layout, [p + e for p, e in zip(pre, ext)], g)
        kb, vb = kv_buffers(rows, hkv, D, dtype, g)
        q = torch.randn(sum(ext), H, D, generator=g).to(dtype)
        m = None if mask is None else mask.expand(3, 4, 4).clone().to(DEV)
        args = to_dev(q, kb, vb, table, start, torch.tensor(pre), torch.tensor(ext),
                      torch.tensor([0, 4, 7]))
        checked = extend_attention(*args, D ** -0.5, size_limit=rows, mask=m, max_extend=4)
        with guard.unchecked():
            bare = extend_attention(*args, D ** -0.5, size_limit=rows, mask=m, max_extend=4)
        assert torch.equal(bare, checked)
    assert guard.checks_enabled()
    assert kv_guard(DEV).err.tolist() == guard.fresh_error_buffer()


def test_unchecked_kernels_really_skip_the_check():
    """The switch is real: a slot at the size limit (inside the buffer) is refused by the
    checked kernel and read, unreported, by the unchecked one."""
    from eaglekv.kernels import guard
    H, hkv, D = 4, 4, 64
    g = torch.Generator().manual_seed(5)
    table, start, rows = make_table("page1", [9], g)
    kb, vb = kv_buffers(rows, hkv, D, torch.float32, g)
    q = torch.randn(1, H, D, generator=g)
    top = int(table[int(start[0]):int(start[0]) + 9].max())          # a slot it reads
    ref = decode_attention_torch(q, kb, vb, table, start, torch.tensor([9]), D ** -0.5,
                                 size_limit=rows)
    args = to_dev(q, kb, vb, table, start, torch.tensor([9]))
    with pytest.raises(KVIndexError, match="decode_attention"):
        decode_attention(*args, D ** -0.5, size_limit=top, num_splits=1)
    with guard.unchecked():
        bare = decode_attention(*args, D ** -0.5, size_limit=top, num_splits=1)
    close(bare, ref, torch.float32)
    assert kv_guard(DEV).err.tolist() == guard.fresh_error_buffer()


def test_extend_num_splits():
    """Split-K of an extend: only a short one (a verify, a draft's window extend) on a grid
    with fewer programs than SMs; up to 2 x the SMs in all, capped at MAX_EXTEND_SPLITS and by
    the keys a request can have; EXTEND_SPLITS forces a count."""
    from eaglekv.kernels import attention_triton as at
    cpu = torch.device("cpu")
    assert at.split_count(3, True, 2048, 132) == at.MAX_EXTEND_SPLITS == 8   # an H200's SMs
    assert at.split_count(3, True, None, 132) == 8
    assert at.split_count(3, True, 100, 132) == 2        # 100 keys: 2 splits of 64
    assert at.split_count(48, True, 2048, 132) == 6      # 264 / 48
    assert at.split_count(132, True, 2048, 132) == 1     # an SM each already
    assert at.split_count(3, False, 2048, 132) == 1      # a prefill
    assert at.extend_num_splits(3, True, 2048, cpu) == 1  # the interpreter: unless forced
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(at, "EXTEND_SPLITS", 1)
        assert at.extend_num_splits(3, True, 2048, cpu) == 1
        mp.setattr(at, "EXTEND_SPLITS", 5)
        assert at.extend_num_splits(300, False, 2048, cpu) == 5
    with pytest.raises(ValueError, match="num_splits=0"):
        extend_attention(torch.zeros(2, 9, 64), torch.zeros(8, 3, 64), torch.zeros(8, 3, 64),
                         torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64), 0.125, size_limit=8, num_splits=0)


@pytest.mark.parametrize("splits", [3, 8])
def test_extend_split_k_equals_reference(splits, monkeypatch):
    """The extend kernel with its prefix split over 3 and 8 programs a kv head (on a GPU the
    default splits a short extend of few requests 8 ways; the other tests run it unsplit under
    the interpreter): the reference's results (causal,
    tree masks, prefixes shorter than the splits, several query blocks); at 8 splits also rows
    outside every request untouched, a corrupt extend_len writing nothing of another
    request's, and bad slots and table positions reported once with the right count (the
    error paths do not depend on the split count: 3 splits leave them to 8, ~13 s under the
    interpreter)."""
    from eaglekv.kernels import attention_triton as at
    monkeypatch.setattr(at, "EXTEND_SPLITS", splits)
    test_tree_mask_and_untouched_rows()
    test_extend_matches_reference((9, 3, 64), torch.bfloat16)
    test_extend_several_query_blocks((9, 3, 64))
    if splits != 8:
        return
    test_extend_writes_only_its_own_rows()
    test_extend_bad_slot("limit", True)
    test_extend_table_position_outside("prefix_past_end", True)
    test_extend_table_position_outside("start_negative", False)


@pytest.mark.parametrize("fused", [False, True])
def test_decode_merge_in_the_decode_launch(fused, monkeypatch):
    """The split-K decode merged by the last split of each (sequence, kv head) in the decode
    launch itself (ticket counters) equals the separate merge kernel and the reference, for
    1-16 splits, empty splits and an empty sequence; every ticket is back to 0 after each
    launch (a graph replay starts from zeros)."""
    from eaglekv.kernels import attention_triton as at
    monkeypatch.setattr(at, "FUSED_DECODE_MERGE", fused)
    for splits in _decode_splits_equal_the_reference(41, [70, 1, 0, 5], (1, 2, 3, 16)):
        if fused and splits > 1:
            assert not at.decode_tickets(torch.device(DEV))[:4 * 3].any()
    test_decode_bad_slot("limit", 3)


def _decode_splits_equal_the_reference(seed, lens, split_counts):
    """SmolLM2's heads (9 query, 3 kv, 64 dims), fp32, one sequence a length of `lens`:
    the decode at each split count equals the reference (yields the count after each)."""
    g = torch.Generator().manual_seed(seed)
    H, hkv, D = 9, 3, 64
    table, start, rows = paged_table(lens, 1, g)
    kb, vb = kv_buffers(rows, hkv, D, torch.float32, g)
    q = torch.randn(len(lens), H, D, generator=g)
    kv_len = torch.tensor(lens)
    ref = decode_attention_torch(q, kb, vb, table, start, kv_len, 0.125, size_limit=rows)
    for splits in split_counts:
        out = decode_attention(*to_dev(q, kb, vb, table, start, kv_len), 0.125,
                               size_limit=rows, num_splits=splits)
        close(out, ref, torch.float32)
        yield splits


@pytest.mark.parametrize("tile", [(None, 4, 0), (32, 4, 64), (128, 8, 16), (16, 2, 40)],
                         ids=lambda t: f"n{t[0]}w{t[1]}c{t[2]}")
def test_decode_tiles_equal_the_reference(tile, monkeypatch):
    """The decode kernel's tile knobs (keys a tile, warps, the least keys a split, for
    bench/decode_tiles.py): the same outputs for every split count, splits left empty by the
    least chunk included, a sequence shorter than a split and an empty one; a bad slot is
    still refused."""
    from eaglekv.kernels import attention_triton as at
    block_n, warps, min_chunk = tile
    monkeypatch.setattr(at, "DECODE_BLOCK_N", block_n)
    monkeypatch.setattr(at, "DECODE_WARPS", warps)
    monkeypatch.setattr(at, "DECODE_MIN_CHUNK", min_chunk)
    assert list(_decode_splits_equal_the_reference(43, [150, 1, 0, 37], (1, 3, 8))) == [1, 3, 8]
    test_decode_bad_slot("limit", 3)
