"""The once-a-forward check of the slots attention reads (`table_guard.guard_table_rows`):
the Triton kernel equals its torch-op reference (the copy, the clamped lengths, the error
count and first key) over shapes across the block edge, index dtypes, decode and extend, and
every corruption (a bad slot, a row past the table or before it, a key count past the copy, a
negative length, several at once, an error buffer already holding one); the guard names each
at the sync; and attention over the checked copy, unchecked, equals checked attention over
req_to_token. Runs on the GPU when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_here import DEV, GPU_MARK  # noqa: I001  (before the kernel modules)

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels import guard  # noqa: E402
from eaglekv.kernels.table_guard import (  # noqa: E402
    GuardedRows, guard_table_rows, guard_table_rows_torch)
from eaglekv.kernels.table_guard_triton import (  # noqa: E402
    BLOCK, MAX_SPLIT, guard_table_rows_triton)

pytestmark = GPU_MARK
ROWS, LIMIT = 5, 300          # table (ROWS, width) of slots in [0, LIMIT)


def _table(width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LIMIT, (ROWS * width,), generator=g).to(torch.int32)


def _both(table, start, pre, ext, W, err0=(0, guard.NO_ERROR), call_id=3):
    """(reference, triton) results: the GuardedRows (on CPU) and the error buffer."""
    out = []
    for fn in (guard_table_rows_torch, guard_table_rows_triton):
        err = torch.tensor(list(err0), dtype=torch.int64, device=DEV)
        dev = lambda x: None if x is None else x.to(DEV)               # noqa: E731
        g = fn(dev(table), dev(start), dev(pre), dev(ext), W, LIMIT, err, call_id)
        g = g if isinstance(g, GuardedRows) else GuardedRows(*g, W)
        out.append((g, err.cpu()))
    return out


def _same(ref, tri):
    (r, re), (t, te) = ref, tri
    assert torch.equal(re, te), (re, te)
    B, W = r.kv_start.shape[0], r.width
    for name in ("kv_start", "extend_len", "keys"):
        assert torch.equal(getattr(r, name).cpu(), getattr(t, name).cpu()), name
    assert (r.prefix_len is None) == (t.prefix_len is None)
    if r.prefix_len is not None:
        assert torch.equal(r.prefix_len.cpu(), t.prefix_len.cpu())
    n = r.extend_len.cpu() + (0 if r.prefix_len is None else r.prefix_len.cpu())
    live = torch.arange(W)[None, :] < n[:, None]                          # (B, W)
    rr, tt = r.rows.cpu().view(B, W), t.rows.cpu().view(B, W)
    assert torch.equal(rr[live], tt[live])
    assert int(n.max()) <= W


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [7, BLOCK, BLOCK + 5, BLOCK * MAX_SPLIT + 5])
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_valid_rows_are_copied_with_no_error(dtype, W, kind):
    """... a row of W keys past BLOCK * MAX_SPLIT (a program copies more than one block)."""
    table = _table(W)
    start = (torch.tensor([0, 2, 4, 1]) * W).to(dtype)
    ext = torch.tensor([1, W, 3, 0]).to(dtype) if kind == "decode" else torch.tensor(
        [1, 2, 3, 0]).to(dtype)
    pre = None if kind == "decode" else torch.tensor([0, W - 2, 1, 5]).to(dtype)
    ref, tri = _both(table, start, pre, ext, W)
    _same(ref, tri)
    g, err = tri
    assert err.tolist() == [0, guard.NO_ERROR]
    assert g.kv_start.cpu().tolist() == [0, W, 2 * W, 3 * W]
    n = (ext if pre is None else pre + ext).tolist()
    for b in range(4):      # the copy is the table's row, slot for slot
        got = g.rows.cpu()[b * W: b * W + n[b]]
        want = table[int(start[b]): int(start[b]) + n[b]]
        assert torch.equal(got, want)


CORRUPTIONS = {
    # name -> (edit of (table, start, pre, ext), the call that must name it, the value named)
    "slot_past_limit": (lambda t, s, p, e: t.__setitem__(int(s[1]) + 1, LIMIT), 1, LIMIT),
    "slot_negative": (lambda t, s, p, e: t.__setitem__(int(s[2]), -4), 1, -4),
    "row_past_table": (lambda t, s, p, e: s.__setitem__(3, t.numel() - 2), 0, None),
    "row_before_table": (lambda t, s, p, e: s.__setitem__(0, -3), 0, -1),
    "keys_past_width": (lambda t, s, p, e: e.__setitem__(1, 10_000), 2, None),
    "negative_extend": (lambda t, s, p, e: e.__setitem__(2, -5), 2, -5),
    "negative_prefix": (lambda t, s, p, e: p is not None and p.__setitem__(3, -7), 2, None),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [9, BLOCK * MAX_SPLIT + 5])
@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS) + ["several"])
def test_corruptions_equal_the_reference(dtype, W, kind, corrupt):
    table = _table(W, seed=W)
    start = torch.tensor([0, 1, 3, 4]) * W
    ext = torch.tensor([3, 4, 2, 5]) if kind == "decode" else torch.tensor([2, 1, 3, 2])
    pre = None if kind == "decode" else torch.tensor([1, 2, 0, 3])
    if W > BLOCK * MAX_SPLIT:     # row 0 full: its program wraps round to a second block
        ext[0] = W - (0 if pre is None else int(pre[0]))
    names = sorted(CORRUPTIONS) if corrupt == "several" else [corrupt]
    if corrupt == "several" and W > BLOCK * MAX_SPLIT:
        table[W - 1] = LIMIT + 1                    # in the wrapped block
    for name in names:
        CORRUPTIONS[name][0](table, start, pre, ext)
    start, ext = start.to(dtype), ext.to(dtype)
    pre = None if pre is None else pre.to(dtype)
    for err0, cid in (((0, guard.NO_ERROR), 3), ((2, (1 << 32) + 9), 5)):
        ref, tri = _both(table, start, pre, ext, W, err0, cid)
        _same(ref, tri)
        if corrupt == "negative_prefix" and kind == "decode":
            assert tri[1].tolist() == list(err0)          # nothing to corrupt: no error
        else:
            assert tri[1][0] > err0[0]


@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_the_sync_names_the_value_and_the_limit(kind, corrupt):
    """`guard_table_rows` registers three calls; the step's sync raises KVIndexError naming
    the op, the bad value and its limit."""
    if corrupt == "negative_prefix" and kind == "decode":
        pytest.skip("a decode has no prefix")
    W = 9
    table, start = _table(W), torch.tensor([0, 1, 3, 4]) * W
    ext = torch.tensor([3, 4, 2, 5]) if kind == "decode" else torch.tensor([2, 1, 3, 2])
    pre = None if kind == "decode" else torch.tensor([1, 2, 0, 3])
    edit, which, value = CORRUPTIONS[corrupt]
    edit(table, start, pre, ext)
    op = f"{kind}_attention"
    name = [f"{op} table position", op, f"{op} key count"][which]
    limit = [table.numel(), LIMIT, W + 1][which]
    if corrupt == "row_past_table":
        value = table.numel()           # the first position past the end
    if corrupt == "keys_past_width":
        value = 10_000 + (0 if pre is None else int(pre[1]))
    if corrupt == "negative_prefix":
        value = -7
    g = guard.kv_guard(DEV)
    d = lambda x: None if x is None else x.to(DEV)                        # noqa: E731
    with g.step(), pytest.raises(KVIndexError) as e:
        guard_table_rows(d(table), d(start), d(pre), d(ext), W, LIMIT, op)
        g.raise_if_error()
    assert e.value.op == name and e.value.first_bad == value and e.value.limit == limit
    assert g.err.tolist() == guard.fresh_error_buffer()     # read and reset


def test_unchecked_attention_over_the_copy_equals_checked_attention():
    """What the Triton backend does a forward: decode and tree extend read the checked copy
    with the unchecked kernels and give the checked kernels' output over req_to_token."""
    from eaglekv.kernels.attention import decode_attention, extend_attention
    torch.manual_seed(0)
    W, H, Hkv, D = 40, 4, 2, 16
    dt = torch.float32
    kb = torch.randn(LIMIT, Hkv, D, dtype=dt, device=DEV)
    vb = torch.randn(LIMIT, Hkv, D, dtype=dt, device=DEV)
    table = torch.randperm(LIMIT)[:ROWS * W].to(torch.int32).to(DEV)
    start = (torch.tensor([3, 0, 2]) * W).to(DEV)
    pre, ext = torch.tensor([17, 30, 5], device=DEV), torch.tensor([4, 4, 4], device=DEV)
    kv_len = pre + 1
    q = torch.randn(3, H, D, dtype=dt, device=DEV)
    want = decode_attention(q, kb, vb, table, start, kv_len, 0.25, size_limit=LIMIT)
    g = guard_table_rows(table, start, None, kv_len, W, LIMIT, "decode_attention")
    got = decode_attention(q, kb, vb, g.rows, g.kv_start, g.extend_len, 0.25,
                           size_limit=LIMIT, checked=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    T = int(ext.sum())
    q = torch.randn(T, H, D, dtype=dt, device=DEV)
    qs = torch.tensor([0, 4, 8], device=DEV)
    mask = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(1)).lt(0.5).to(DEV)
    want = extend_attention(q, kb, vb, table, start, pre, ext, qs, 0.25, size_limit=LIMIT,
                            mask=mask, max_extend=4)
    g = guard_table_rows(table, start, pre, ext, W, LIMIT, "extend_attention")
    got = extend_attention(q, kb, vb, g.rows, g.kv_start, g.prefix_len, g.extend_len, qs,
                           0.25, size_limit=LIMIT, mask=mask, max_extend=4, checked=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
