"""store_cache (guard 1): scatter equals a naive loop; a bad index writes nothing and names itself.
"""

from __future__ import annotations

import pytest
import torch

from eaglekv.errors import KVIndexError
from eaglekv.kernels import default_num_split, store_cache, store_cache_torch
from eaglekv.memory import KVPool

# (num_tokens, heads, head_dim): rows of 64, 128, 576 and an odd 7 elements
SHAPES = [(3, 4, 16), (8, 2, 64), (1, 1, 576), (5, 7, 1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDX_DTYPES = [torch.int32, torch.int64]
PAD = 3  # canary rows at each end of the cache that no valid test index touches


# ---- helpers ------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for bit-identical comparison (tells -0.0 from 0.0)."""
    return t.contiguous().view(torch.uint8)


def make_caches(rows: int, heads: int, dim: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(rows, heads, dim, generator=g).to(dtype)
    vc = torch.randn(rows, heads, dim, generator=g).to(dtype)
    kc[:PAD] = kc[-PAD:] = 7.5   # canaries, exactly representable in every dtype
    vc[:PAD] = vc[-PAD:] = -7.5
    return kc, vc


def reference_store(k, v, k_cache, v_cache, indices) -> None:
    """Naive per-token Python loop: row i of k/v -> row indices[i] of the caches."""
    n = indices.numel()
    k2, v2 = k.reshape(n, -1), v.reshape(n, -1)
    kc2, vc2 = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    for i, slot in enumerate(indices.reshape(-1).tolist()):
        for j in range(k2.shape[1]):
            kc2[slot, j] = k2[i, j]
        for j in range(v2.shape[1]):
            vc2[slot, j] = v2[i, j]


def distinct_indices(n: int, rows: int, dtype, seed: int = 0) -> torch.Tensor:
    """n distinct shuffled slots in [PAD, rows - PAD) (canaries never targeted)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(rows - 2 * PAD, generator=g)[:n] + PAD).to(dtype)


def kv_rows(n, heads, dim, dtype, layout: str, seed: int = 1):
    """k and v as [n, heads, dim] or [n, heads * dim]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dim, generator=g).to(dtype)
    v = torch.randn(n, heads, dim, generator=g).to(dtype)
    if layout == "2d":
        k, v = k.reshape(n, heads * dim), v.reshape(n, heads * dim)
    return k, v


def run_both(k, v, kc, vc, idx, **kw):
    """store_cache on clones vs the naive reference on clones; returns both pairs."""
    got_k, got_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    store_cache(k, v, got_k, got_v, idx, **kw)
    reference_store(k, v, ref_k, ref_v, idx)
    return (got_k, got_v), (ref_k, ref_v)


# ---- equality with the reference -----------------------------------------------------------------
@pytest.mark.parametrize("layout", ["3d", "2d"])
@pytest.mark.parametrize("idx_dtype", IDX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1] * s[2]}")
def test_matches_reference(shape, dtype, idx_dtype, layout):
    """store_cache writes exactly what the naive loop writes, and nothing else."""
    n, heads, dim = shape
    rows = n + 2 * PAD + 4
    kc, vc = make_caches(rows, heads, dim, dtype)
    k, v = kv_rows(n, heads, dim, dtype, layout)
    idx = distinct_indices(n, rows, idx_dtype)
    (gk, gv), (rk, rv) = run_both(k, v, kc, vc, idx)
    assert torch.equal(bits(gk), bits(rk)) and torch.equal(bits(gv), bits(rv))
    # the rows written really hold k/v (the reference is not vacuous), canaries untouched
    assert torch.equal(bits(gk[idx.long()].reshape(n, -1)), bits(k.reshape(n, -1)))
    assert torch.equal(bits(gv[idx.long()].reshape(n, -1)), bits(v.reshape(n, -1)))
    for c, orig in ((gk, kc), (gv, vc)):
        assert torch.equal(bits(c[:PAD]), bits(orig[:PAD]))
        assert torch.equal(bits(c[-PAD:]), bits(orig[-PAD:]))


def test_torch_path_is_store_cache():
    """store_cache_torch and store_cache agree."""
    kc, vc = make_caches(16, 2, 8, torch.float32)
    k, v = kv_rows(4, 2, 8, torch.float32, "3d")
    idx = distinct_indices(4, 16, torch.int64)
    a_k, a_v, b_k, b_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    store_cache(k, v, a_k, a_v, idx)
    store_cache_torch(k, v, b_k, b_v, idx)
    assert torch.equal(a_k, b_k) and torch.equal(a_v, b_v)


def test_padding_slot_zero_is_writable():
    """Slot 0 (the padding page, where padded batch rows write) is inside [0, size_limit)."""
    kc, vc = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
    k, v = torch.ones(1, 1, 4), torch.full((1, 1, 4), 2.0)
    store_cache(k, v, kc, vc, torch.tensor([0]))
    assert torch.equal(kc[0], k[0]) and torch.equal(vc[0], v[0]) and not kc[1:].any()


def test_last_slot_below_limit_is_writable():
    """Index size_limit - 1 is accepted (the bound is exclusive at the top only)."""
    kc, vc = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
    store_cache(torch.ones(1, 1, 4), torch.ones(1, 1, 4), kc, vc, torch.tensor([5]), size_limit=6)
    assert kc[5].eq(1).all() and not kc[:5].any() and not kc[6:].any()


def test_empty_store_is_noop():
    """Zero tokens are a no-op (regression: `reshape(0, -1)` used to raise)."""
    kc, vc = make_caches(10, 2, 4, torch.float32)
    before_k, before_v = kc.clone(), vc.clone()
    store_cache(torch.empty(0, 2, 4), torch.empty(0, 2, 4), kc, vc,
                torch.empty(0, dtype=torch.int64))
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


# ---- non-contiguous k / v ------------------------------------------------------------------------
def _noncontig(kind: str, n: int, heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "slice_last":      # k = qkv[..., :dim] of a wider tensor
        x = torch.randn(n, heads, 3 * dim, generator=g)[..., dim:2 * dim]
    elif kind == "slice_heads":   # k = qkv[:, H:H+Hkv] (fused projection output)
        x = torch.randn(n, 3 * heads, dim, generator=g)[:, heads:2 * heads]
    elif kind == "row_step":      # every other token
        x = torch.randn(2 * n, heads, dim, generator=g)[::2]
    elif kind == "transposed":    # [heads, n, dim] transposed to [n, heads, dim]
        x = torch.randn(heads, n, dim, generator=g).transpose(0, 1)
    elif kind == "expanded":      # stride 0 over tokens
        x = torch.randn(1, heads, dim, generator=g).expand(n, heads, dim)
    else:
        raise AssertionError(kind)
    assert x.shape == (n, heads, dim)
    return x


@pytest.mark.parametrize("kind", ["slice_last", "slice_heads", "row_step", "transposed",
                                  "expanded"])
def test_noncontiguous_kv(kind):
    """Strided k and v (slices, transposes, broadcasts) are copied row for row."""
    n, heads, dim = 6, 4, 8
    k, v = _noncontig(kind, n, heads, dim, 1), _noncontig(kind, n, heads, dim, 2)
    assert not k.is_contiguous() and not v.is_contiguous()
    kc, vc = make_caches(20, heads, dim, torch.float32)
    idx = distinct_indices(n, 20, torch.int32)
    (gk, gv), (rk, rv) = run_both(k, v, kc, vc, idx)
    assert torch.equal(gk, rk) and torch.equal(gv, rv)
    assert torch.equal(gk[idx.long()], k.contiguous())
    assert torch.equal(gv[idx.long()], v.contiguous())


def test_noncontiguous_indices():
    """A strided index tensor is read in its logical order."""
    kc, vc = make_caches(20, 2, 4, torch.float32)
    k, v = kv_rows(4, 2, 4, torch.float32, "3d")
    idx = torch.tensor([5, 0, 9, 0, 4, 0, 12, 0])[::2]
    assert not idx.is_contiguous()
    (gk, gv), (rk, rv) = run_both(k, v, kc, vc, idx)
    assert torch.equal(gk, rk) and torch.equal(gv, rv)
    assert torch.equal(gk[12], k[3])


def test_2d_cache():
    """A 2-D cache [rows, heads * dim] receives 3-D k/v as rows."""
    kc, vc = torch.zeros(10, 12), torch.zeros(10, 12)
    k, v = kv_rows(2, 3, 4, torch.float32, "3d")
    store_cache(k, v, kc, vc, torch.tensor([7, 2]))
    assert torch.equal(kc[7], k[0].reshape(-1)) and torch.equal(vc[2], v[1].reshape(-1))


def test_different_k_and_v_row_widths():
    """K and V rows may differ in width (e.g. MLA 576 / 512) as long as each matches its cache."""
    kc, vc = torch.zeros(6, 576), torch.zeros(6, 512)
    k, v = torch.randn(2, 576), torch.randn(2, 512)
    store_cache(k, v, kc, vc, torch.tensor([1, 4]))
    assert torch.equal(kc[4], k[1]) and torch.equal(vc[1], v[0])


# ---- num_split ----------------------------------------------------------------------------------
@pytest.mark.parametrize("row_bytes,split", [(2048, 4), (4096, 4), (6144, 4), (1024, 2),
                                             (3072, 2), (512, 1), (1152, 1), (28, 1),
                                             (2304, 1), (1536, 1)])
def test_default_num_split(row_bytes, split):
    """4 if row_bytes % 2048 == 0, else 2 if % 1024 == 0, else 1."""
    assert default_num_split(row_bytes) == split


@pytest.mark.parametrize("num_split", [1, 2, 4, 8])
def test_explicit_num_split_same_result(num_split):
    """Any valid num_split gives the same cache contents."""
    kc, vc = make_caches(16, 2, 64, torch.float16)
    k, v = kv_rows(3, 2, 64, torch.float16, "3d")
    idx = distinct_indices(3, 16, torch.int64)
    (gk, gv), (rk, rv) = run_both(k, v, kc, vc, idx, num_split=num_split)
    assert torch.equal(bits(gk), bits(rk)) and torch.equal(bits(gv), bits(rv))


@pytest.mark.parametrize("num_split", [3, 5, -1])
def test_bad_num_split(num_split):
    """A num_split that does not divide the row raises ValueError naming it; nothing written."""
    kc, vc = make_caches(16, 2, 8, torch.float32)
    before = kc.clone(), vc.clone()
    k, v = kv_rows(2, 2, 8, torch.float32, "3d")
    with pytest.raises(ValueError, match=f"num_split={num_split}"):
        store_cache(k, v, kc, vc, torch.tensor([4, 5]), num_split=num_split)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


# ---- out-of-range indices ------------------------------------------------------------------------
ROWS = 16


@pytest.fixture
def caches():
    """(k_cache, v_cache, untouched clones) of ROWS rows with canaries at both ends."""
    kc, vc = make_caches(ROWS, 2, 8, torch.float16)
    return kc, vc, kc.clone(), vc.clone()


@pytest.mark.parametrize(
    "idx,idx_dtype,size_limit,first_bad,num_bad",
    [
        ([4, -1, 5], torch.int64, 0, -1, 1),                    # negative
        ([4, -1, 5], torch.int32, 0, -1, 1),
        ([ROWS, 4, 5], torch.int64, 0, ROWS, 1),                 # == size_limit (default)
        ([4, 5, ROWS], torch.int32, 0, ROWS, 1),                 # last position
        ([4, 2 ** 40, 5], torch.int64, 0, 2 ** 40, 1),           # huge, int64 only
        ([4, 2 ** 31 - 1, 5], torch.int32, 0, 2 ** 31 - 1, 1),   # int32 max
        ([4, 12, 5], torch.int64, 12, 12, 1),                    # size_limit < cache rows
        ([11, 13, 5], torch.int32, 12, 13, 1),
        ([3, 99, -7, 20, 6], torch.int64, 0, 99, 3),             # first bad in order, count 3
        ([-5, -6], torch.int64, 0, -5, 2),                       # all bad
    ])
def test_out_of_range_raises_and_writes_nothing(caches, idx, idx_dtype, size_limit, first_bad,
                                               num_bad):
    """A bad index raises KVIndexError (first bad, limit, counts) and both caches stay identical."""
    kc, vc, kc0, vc0 = caches
    n = len(idx)
    k, v = kv_rows(n, 2, 8, torch.float16, "3d")
    limit = size_limit or ROWS
    with pytest.raises(KVIndexError) as e:
        store_cache(k, v, kc, vc, torch.tensor(idx, dtype=idx_dtype), size_limit=size_limit)
    err = e.value
    assert (err.first_bad, err.limit, err.num_bad, err.num_total) == (first_bad, limit, num_bad, n)
    msg = str(err)
    assert f"slot {first_bad} " in msg and f"[0, {limit})" in msg
    assert f"{num_bad} of {n} indices bad" in msg and "store_cache" in msg
    assert isinstance(err, IndexError)
    assert torch.equal(bits(kc), bits(kc0)) and torch.equal(bits(vc), bits(vc0))


def test_size_limit_larger_than_cache(caches):
    """size_limit beyond the cache rows is a ValueError with both numbers."""
    kc, vc, kc0, _ = caches
    k, v = kv_rows(1, 2, 8, torch.float16, "3d")
    with pytest.raises(ValueError, match=f"size_limit={ROWS + 1}.*{ROWS} rows"):
        store_cache(k, v, kc, vc, torch.tensor([1]), size_limit=ROWS + 1)
    assert torch.equal(kc, kc0)


def test_v_cache_shorter_than_k_cache():
    """The default limit must fit both caches: a shorter v_cache is rejected, not overrun."""
    kc, vc = torch.zeros(10, 4), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="8 rows"):
        store_cache(torch.ones(1, 4), torch.ones(1, 4), kc, vc, torch.tensor([9]))
    assert not kc.any() and not vc.any()


# ---- argument errors -----------------------------------------------------------------------------
def _args(n=2, heads=2, dim=8, dtype=torch.float32):
    kc, vc = make_caches(12, heads, dim, dtype)
    k, v = kv_rows(n, heads, dim, dtype, "3d")
    return k, v, kc, vc, torch.arange(4, 4 + n)


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(which):
    """k or v in another dtype than its cache raises TypeError naming both dtypes."""
    k, v, kc, vc, idx = _args()
    kc0, vc0 = kc.clone(), vc.clone()
    if which == "k":
        k = k.half()
    else:
        v = v.half()
    msg = f"{which} dtype torch.float16 != cache dtype torch.float32"
    with pytest.raises(TypeError, match=msg):
        store_cache(k, v, kc, vc, idx)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("which", ["k", "v"])
def test_row_size_mismatch(which):
    """k or v rows of another width than the cache raise ValueError with both widths."""
    k, v, kc, vc, idx = _args()
    kc0, vc0 = kc.clone(), vc.clone()
    wrong = torch.randn(2, 2, 4)
    if which == "k":
        k = wrong
    else:
        v = wrong
    with pytest.raises(ValueError, match=f"{which} rows have 8 elements, cache rows 16"):
        store_cache(k, v, kc, vc, idx)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_token_count_mismatch():
    """k with another number of rows than there are indices raises ValueError with the shape."""
    k, v, kc, vc, _ = _args(n=3)
    with pytest.raises(ValueError, match=r"k has shape \(3, 2, 8\), expected 2 rows"):
        store_cache(k, v, kc, vc, torch.tensor([4, 5]))


def test_row_bytes_mismatch():
    """An explicit row_bytes that disagrees with the rows raises ValueError with both numbers."""
    k, v, kc, vc, idx = _args()   # 16 float32 = 64 bytes
    kc0 = kc.clone()
    with pytest.raises(ValueError, match="row_bytes=32 but rows are 64 bytes"):
        store_cache(k, v, kc, vc, idx, row_bytes=32)
    assert torch.equal(kc, kc0)
    store_cache(k, v, kc, vc, idx, row_bytes=64)   # the right value is accepted
    assert torch.equal(kc[4:6], k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_bad_index_dtype(dtype):
    """Indices that are not int32 / int64 raise TypeError naming the dtype."""
    k, v, kc, vc, _ = _args()
    with pytest.raises(TypeError, match=str(dtype)):
        store_cache(k, v, kc, vc, torch.tensor([4, 5]).to(dtype))


def test_noncontiguous_cache_rejected():
    """A non-contiguous cache (which a view would silently not write into) is rejected."""
    k, v, _, vc, idx = _args()
    kc = torch.zeros(2, 12, 8).transpose(0, 1)  # [12, 2, 8], strided
    with pytest.raises(ValueError, match="contiguous"):
        store_cache(k, v, kc, vc, idx)


# ---- KVPool.set_kv_buffer ------------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_kv_pool_size_limit(ps):
    """set_kv_buffer accepts slot size + ps - 1 and rejects size + ps naming the layer."""
    size = 4 * ps
    pool = KVPool(size, ps, num_layers=3, kv_heads=2, head_dim=8)
    assert pool.size_limit == size + ps
    assert pool.k_buffer[0].shape == (size + ps, 2, 8)
    k, v = torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0)
    pool.set_kv_buffer(1, torch.tensor([size + ps - 1]), k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert torch.equal(kb[-1], k[0]) and torch.equal(vb[-1], v[0])
    assert not pool.k_buffer[0].any() and not pool.k_buffer[2].any()  # other layers untouched
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    with pytest.raises(KVIndexError) as e:
        pool.set_kv_buffer(2, torch.tensor([1, size + ps], dtype=torch.int32), k.expand(2, 2, 8),
                           v.expand(2, 2, 8))
    err = e.value
    assert err.layer == 2 and err.first_bad == size + ps and err.limit == size + ps
    assert "(layer 2," in str(err) and f"slot {size + ps} out of range [0, {size + ps})" in str(err)
    assert "1 of 2 indices bad" in str(err)
    for b, b0 in zip(pool.k_buffer + pool.v_buffer, before):
        assert torch.equal(b, b0)


def test_kv_pool_negative_slot_names_layer():
    """A negative slot through the pool raises KVIndexError with the layer, nothing written."""
    pool = KVPool(8, 1, num_layers=2, kv_heads=1, head_dim=4)
    msg = r"slot -1 out of range \[0, 9\) in store_cache \(layer 0"
    with pytest.raises(KVIndexError, match=msg):
        pool.set_kv_buffer(0, torch.tensor([-1]), torch.ones(1, 1, 4), torch.ones(1, 1, 4))
    assert not any(b.any() for b in pool.k_buffer + pool.v_buffer)


def test_kv_pool_dtype():
    """The pool's buffers use its dtype and a matching store succeeds."""
    pool = KVPool(8, 4, num_layers=1, kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert pool.k_buffer[0].dtype == torch.bfloat16
    k = torch.randn(2, 2, 8).bfloat16()
    pool.set_kv_buffer(0, torch.tensor([4, 11]), k, k)
    assert torch.equal(pool.v_buffer[0][11], k[1])
    assert KVPool.bytes_per_slot(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2


@pytest.mark.parametrize("layer", [-1, 2])
def test_kv_pool_rejects_layer_out_of_range(layer):
    """A negative layer would wrap to the last one in Python; it raises instead."""
    from eaglekv.memory import KVPool
    pool = KVPool(8, 1, 2, 1, 4)
    k = torch.ones(1, 1, 4)
    with pytest.raises(KVIndexError, match=f"slot {layer} out of range \\[0, 2\\) in kv_pool layer"):
        pool.set_kv_buffer(layer, torch.tensor([1]), k, k)
    assert all(not b.any() for b in pool.k_buffer + pool.v_buffer)


def test_tensors_on_different_devices_rejected():
    """A cache on another device would make the slot an address in the wrong memory."""
    k = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"different devices: k on cpu, v on cpu, "
                                         r"k_cache on meta"):
        store_cache(k, k, torch.zeros(8, 4, device="meta"), torch.zeros(8, 4),
                    torch.tensor([0, 1]))


def test_unchecked_switch_is_scoped():
    """`guard.unchecked()` (measurement only) lets the host checks and the torch-op guards
    pass a bad index through, and only inside it: the switch is back on after the block,
    also when the block raises."""
    from eaglekv.kernels import guard
    bad = torch.tensor([0, 9])
    with guard.unchecked():
        assert not guard.checks_enabled()
        guard.check_indices(bad, 5, "test")                           # no raise
        assert guard.guard_indices(bad, 5, "test") is bad
        assert guard.guard_segments(torch.tensor([0, 7]), (3, 2), 4, "test")[1] == 7
    assert guard.checks_enabled()
    with pytest.raises(KVIndexError):
        guard.check_indices(bad, 5, "test")
    with pytest.raises(RuntimeError), guard.unchecked():
        raise RuntimeError("inside")
    assert guard.checks_enabled()


@pytest.mark.parametrize("starts,lens,width,ok", [
    ([0, 3, 5], (3, 2, 1), 6, True),          # packed
    ([0, 2], (3, 2), 8, False),               # overlaps the segment before
    ([0, 4], (3, 2), 8, False),               # a gap with no empty segment before it
    ([0, 3, 5], (3, 0, 2), 8, True),          # a frozen row's 2 entries left in place
    ([0, 9, 3], (3, 0, 2), 8, True),          # an empty segment's own offset is never read
    ([0, 3, 2], (3, 0, 2), 8, False),         # after an empty one, still not before the end
    ([0, 3, 7], (3, 0, 2), 8, False),         # nor past the buffer
])
def test_draft_segments_on_cpu(starts, lens, width, ok):
    """`guard_segments` on the CPU: each non-empty segment starts where the one before ended,
    or, after an empty segment (a padded row, or a row frozen inside a chain whose list keeps
    the entries its writer laid out), anywhere from there on; never overlapping, never past
    the buffer."""
    from eaglekv.kernels import guard
    t = torch.tensor(starts)
    if ok:
        assert guard.guard_segments(t, lens, width, "draft kv_indptr") is t
    else:
        with pytest.raises(KVIndexError, match="draft kv_indptr"):
            guard.guard_segments(t, lens, width, "draft kv_indptr")
