"""Triton paged attention: split-K decode and extend (causal or tree mask); references and
argument checks in `attention.py`.

Keys of sequence b are the slots `table[kv_start[b] + j]`, j < kv_len[b] (decode) or
j < prefix_len[b] + extend_len[b] (extend). Every slot is checked against `[0, size_limit)`
before it becomes an address: a bad one reads nothing (its key is masked out) and is recorded
in the device error buffer of `eaglekv.kernels.guard`, keyed `(call_id + 1) * 2**32 + flat
table position`, by exactly one program (each key counts once). A table position outside
`[0, table.numel())` (a corrupt kv_start / kv_len / prefix_len / extend_len: a request row past
req_to_token, a segment past the draft's kv_indices) is never read: the loops run over the
positions inside the table only (a huge kv_len costs nothing), and the reporting program counts
the positions outside arithmetically and records them under the call's own id `call_id`, keyed
by `_outside` (decoded on the host by `TablePositions`), so the step's sync raises KVIndexError
naming "<op> table position", the position and the table size. An extend query row outside
`[0, T)` of q / out is never read or written (not reported: q_start is host-built, and those
rows stay unwritten).

Graph-ready: no host sync (outside a guard step `guard.after_launch()` checks at once, as in
`store_cache`), no device value read on the host; grids and scratch shapes come from host
ints. Softmax runs in fp32 in base 2: `p = 2**(s*scale*log2(e) - m)`, so `lse2 = m + log2(l)`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from eaglekv.kernels import pdl
from eaglekv.kernels.guard import checks_enabled, kv_guard
from eaglekv.kernels.pdl import gdc_launch_dependents, gdc_wait
from eaglekv.kernels.table_guard import TablePositions

_BIG = tl.constexpr(2**62)      # larger than any flat table position: neutral for min
_NEG = tl.constexpr(-1.0e30)    # running max before any visible key (finite: no inf - inf)
_LOG2E = 1.4426950408889634
_HALF = tl.constexpr(2**31)     # table-position keys: [0, HALF) past the end, [HALF, 2**32) < 0
_MAX_CALL_ID = 2**31 - 2        # call_id and call_id + 1 are passed as i32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The check variant (exploring, EAGLEKV_ATTN_CHECK_LEVEL): 1 rows read only through good
# slots; 2 rows read through the clamped slot, bad keys masked from the scores; 3 is 2 without
# recording (measurement only). 0 is the unchecked kernel (`guard.unchecked`).
CHECK_LEVEL = int(os.environ.get("EAGLEKV_ATTN_CHECK_LEVEL", "1"))
if CHECK_LEVEL not in (1, 2):     # 3 does not record: set only by bench/attention_checks.py
    raise ValueError(f"EAGLEKV_ATTN_CHECK_LEVEL={CHECK_LEVEL}: 1 or 2 (both check every slot)")
# Software pipelining of the key loop. Compiled for sm_90 (Triton 3.9, `triton.compile` on the
# CPU), the checked kernels' loops were pipelined (cp.async of the slot and K/V tiles, 6 async
# copies in the extend kernel) and the unchecked ones were not; on the H200 the unchecked
# extend ran 6.4 us a launch against the checked 10.2 (S5 verify, batch 1: 6 queries over ~300
# keys, 5 tiles a program) and decode 3.2 against 3.9 (2026-12-04, `kernel_top`). Loops of a
# few tiles do not fill a pipeline, so decode and short extends (verify windows, draft
# extends) run unpipelined, as the unchecked kernels always did; a prefill keeps Triton's
# default. Not yet timed on the H200 this way (`bench/attention_checks.py` does).
# Since the once-a-forward check (2026-12-05) the target's layers run the unchecked kernels,
# and on the H200 those ran faster at Triton's default stages than unpipelined
# (`bench/attention_checks.py`, variants "0p" / "0", one process, 2026-12-05 04:36,
# bench/results/attention_checks_h200_20261205.json): extend 10.2 / 11.6 us a launch at batch
# 1 (an S5 verify) and 12.2 / 13.4 at 64, decode 4.35 / 4.43 and 8.74 / 9.14. So the unchecked
# kernels take `UNCHECKED_STAGES`; the checked ones (a draft's attention, `layer_checks()`)
# stay unpipelined (`key_loop_stages`).
DECODE_STAGES = 1
SHORT_EXTEND = 64
DEFAULT_STAGES = 3
UNCHECKED_STAGES = DEFAULT_STAGES


def key_loop_stages(check: int, short: bool) -> int:
    """num_stages of a decode (`short`) or extend kernel's key loop at check level `check`:
    unchecked, UNCHECKED_STAGES; checked, DECODE_STAGES (1: unpipelined) for a decode or a
    short extend, Triton's default for a long one (a prefill)."""
    if check == 0:
        return UNCHECKED_STAGES
    return DECODE_STAGES if short else DEFAULT_STAGES
# The tile of a short extend (exploring, bench/attention_checks.py): a program holds at least
# SHORT_MIN_ROWS rows of queries x heads (None: at least 16 queries, whatever the group) and
# keys in tiles of SHORT_BLOCK_N. Compiled for sm_90, SmolLM2's verify tile (16 queries x 4
# heads against 64 keys) uses 255 registers and spills 36 bytes unchecked and 224 checked;
# 8 x 4 against 32 keys uses 168-212 and spills none.
SHORT_MIN_ROWS: int | None = None
SHORT_BLOCK_N = 64


@triton.jit
def _record_one(err_ptr, n, key):
    """err[0] += n; err[1] = min(err[1], key) (only if n > 0): scalars."""
    if n > 0:
        tl.atomic_add(err_ptr, n, sem="relaxed")
        tl.atomic_min(err_ptr + 1, key, sem="relaxed")


@triton.jit
def _outside(base, lo, hi, n_table):
    """Table positions `base + j`, lo <= j < hi, outside [0, n_table): (count, 32-bit key).
    The key is `pos - n_table` of the first position past the end, else HALF + (-pos - 1) of
    the negative position nearest 0, each clamped below HALF (so min() over programs prefers a
    read past the end; `TablePositions` decodes it); _BIG when none is outside."""
    n_neg = tl.maximum(tl.minimum(hi, -base) - lo, 0)                 # j < -base: pos < 0
    n_past = tl.maximum(hi - tl.maximum(lo, n_table - base), 0)       # pos >= n_table
    k_past = tl.minimum(tl.maximum(base + lo - n_table, 0), _HALF - 1)
    k_neg = _HALF + tl.minimum(-tl.minimum(base + hi - 1, -1) - 1, _HALF - 1)
    key = tl.where(n_past > 0, k_past, tl.where(n_neg > 0, k_neg, _BIG))
    return n_neg + n_past, key


@triton.jit
def _in_table(base, lo, hi, n_table, CHECK: tl.constexpr):
    """The j range [jlo, jhi) of [lo, hi) whose positions base + j lie in [0, n_table)
    ([lo, hi) itself unchecked)."""
    if CHECK:
        jlo = tl.maximum(lo, -base)
        jhi = tl.maximum(tl.minimum(hi, n_table - base), jlo)
    else:
        jlo = lo
        jhi = hi
    return jlo, jhi


@triton.jit
def _load_slots(table_ptr, base, j, live, n_table, size_limit, report, err_ptr, key_base,
                CHECK: tl.constexpr):
    """Slots `table[base + j]` for the live lanes (BLOCK_N,): returns (slot or 0, ok). A bad
    slot of a lane this program reports (`report`: a (BLOCK_N,) bool) is recorded at once by
    that lane's own atomics (masked off on every good lane: no counters carried through the
    loop, no reduction at the end), keyed `key_base + table position`.
    CHECK=False (measurement only, `guard.unchecked`): the slots as they are."""
    tpos = base + j                                                    # (BLOCK_N,) int64
    if CHECK > 0:
        in_table = live & (tpos >= 0) & (tpos < n_table)
        slot = tl.load(table_ptr + tpos, mask=in_table, other=0).to(tl.int64)
        ok = in_table & (slot >= 0) & (slot < size_limit)
        bad = in_table & (~ok) & report
        if CHECK != 3:
            zero = tpos * 0
            tl.atomic_add(err_ptr + zero, zero + 1, mask=bad, sem="relaxed")
            tl.atomic_min(err_ptr + 1 + zero, key_base + tpos, mask=bad, sem="relaxed")
        slot = tl.where(ok, slot, 0)
        if CHECK == 1:
            load = ok
        else:
            load = in_table
    else:
        slot = tl.load(table_ptr + tpos, mask=live, other=0).to(tl.int64)
        ok = live
        load = live
    return slot, load, ok


@triton.jit
def _attend(q, k_ptr, v_ptr, slot, load, ok, visible, kvh, k_s0, k_s1, v_s0, v_s1, d, dmask,
            m_i, l_i, acc, qk_scale, F32DOT: tl.constexpr):
    """One key tile, online softmax. q (M, DP); slot/load/ok (N,): the rows read, the keys
    that count; visible (M, N) or (1, N). Offsets are int64: slot * row stride passes 2**31
    on large pools."""
    k, v = _load_kv(k_ptr, v_ptr, slot, load, kvh, k_s0, k_s1, v_s0, v_s1, d, dmask)
    return _attend_kv(q, k, v, ok, visible, m_i, l_i, acc, qk_scale, F32DOT)


@triton.jit
def _load_kv(k_ptr, v_ptr, slot, load, kvh, k_s0, k_s1, v_s0, v_s1, d, dmask):
    """The K and V rows (N, DP) of kv head kvh at `slot` where `load` (else 0)."""
    kv_mask = load[:, None] & dmask[None, :]                           # (N, DP)
    k = tl.load(k_ptr + slot[:, None] * k_s0 + kvh * k_s1 + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * v_s0 + kvh * v_s1 + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_kv(q, k, v, ok, visible, m_i, l_i, acc, qk_scale, F32DOT: tl.constexpr):
    """`_attend` over K and V rows already loaded."""
    if F32DOT:   # fp32 products, not tf32 (fp32 inputs; bf16 under the interpreter)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible & ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                              # (M,) >= _NEG, finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                    # 0 where not visible
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["call_id", "size_limit", "n_table"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, start_ptr, len_ptr, out_ptr, mid_o_ptr,
                   mid_lse_ptr, err_ptr, ticket_ptr, call_id, size_limit, n_table, qk_scale,
                   q_s0, q_s1, q_s2, o_s0, o_s1, o_s2, k_s0, k_s1, v_s0, v_s1,
                   H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   DP: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   SP: tl.constexpr, FUSED_MERGE: tl.constexpr, F32DOT: tl.constexpr,
                   CHECK: tl.constexpr, USE_GDC: tl.constexpr = False,
                   MIN_CHUNK: tl.constexpr = 0, PREFETCH: tl.constexpr = False):
    """Program (b, kv head, split): the G query heads of one kv head (rows padded to GP) over
    keys [lo, hi), lo = split * chunk, hi = min(lo + chunk, kv_len), chunk = cdiv(kv_len,
    SPLITS) (at least MIN_CHUNK: the splits past kv_len are empty). SPLITS == 1 writes the
    output; else the partial output o = acc / l and
    lse2 = m + log2(l) (-inf for an empty split) go to mid_o (B, H, SPLITS, DP) and
    mid_lse (B, H, SPLITS), merged by `_merge_kernel`, or (FUSED_MERGE) by the last of the
    (b, kv head)'s splits to finish, in this launch: each split takes a ticket (an atomic add
    on ticket[b, kv head], release after its partials are stored, acquire for the one that
    draws SPLITS - 1), and the last one merges its G heads (`_merge_row`) and puts the ticket
    back to 0 for the next launch. Bad slots and positions outside the table are reported by
    kv head 0 (each key is in one split). USE_GDC (PDL, kernels/pdl.py): every input is an
    earlier kernel's output (q, the K/V just stored, the table), so the wait comes first.
    PREFETCH (a one-token-per-request target decode whose table was checked and copied at the
    forward's start, CHECK == 0; `DECODE_PREFETCH`): the lengths, the first key tile's slots
    and the K/V of its keys before the last one come BEFORE the wait, since no kernel still
    running writes them (the table copy and the lengths are made at the forward's start; the
    earlier keys' K/V in earlier forwards; and a kernel that may start early has the one
    before it past its own wait, so every kernel before that one is done); only q and the
    last key's K/V (this forward's store, the kernel just before) are read after it. The
    same tiles in the same order as without it: the same output bit for bit."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2).to(tl.int64)
    if USE_GDC and not PREFETCH:
        gdc_wait()
    kv_len = tl.load(len_ptr + b).to(tl.int64)
    base = tl.load(start_ptr + b).to(tl.int64)
    chunk = (kv_len + SPLITS - 1) // SPLITS
    if MIN_CHUNK > 0:         # short contexts: fewer, fuller splits (the rest are empty)
        chunk = tl.maximum(chunk, MIN_CHUNK)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    g = tl.arange(0, GP)
    h = kvh * G + g                                                    # (GP,) query heads
    hmask = g < G
    d = tl.arange(0, DP)
    dmask = d < D
    m_i = tl.full([GP], _NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    report = (tl.zeros([BLOCK_N], tl.int32) + (kvh == 0).to(tl.int32)) != 0
    cid = call_id.to(tl.int64)
    every = tl.full([1, BLOCK_N], 1, tl.int1)                          # no causal mask
    jlo, jhi = _in_table(base, lo, hi, n_table, CHECK)                 # the rest: not read
    q_at = q_ptr + b * q_s0 + h[:, None] * q_s1 + d[None, :] * q_s2
    q_mask = hmask[:, None] & dmask[None, :]
    if PREFETCH:                      # CHECK == 0: the table's slots as they are
        j = jlo + tl.arange(0, BLOCK_N).to(tl.int64)
        live = j < jhi
        slot = tl.load(table_ptr + base + j, mask=live, other=0).to(tl.int64)
        k, v = _load_kv(k_ptr, v_ptr, slot, live & (j < kv_len - 1), kvh, k_s0, k_s1, v_s0,
                        v_s1, d, dmask)                                 # the earlier keys
        if USE_GDC:
            gdc_wait()
        last = live & (j == kv_len - 1)                                 # this forward's key
        k_new, v_new = _load_kv(k_ptr, v_ptr, slot, last, kvh, k_s0, k_s1, v_s0, v_s1, d,
                                dmask)
        k = tl.where(last[:, None], k_new, k)
        v = tl.where(last[:, None], v_new, v)
        q = tl.load(q_at, mask=q_mask, other=0.0)                       # (GP, DP)
        m_i, l_i, acc = _attend_kv(q, k, v, live, every, m_i, l_i, acc, qk_scale, F32DOT)
        first = jlo + BLOCK_N
    else:
        q = tl.load(q_at, mask=q_mask, other=0.0)                       # (GP, DP)
        first = jlo
    for n0 in range(first, jhi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N).to(tl.int64)                    # (BLOCK_N,) key index
        slot, load, ok = _load_slots(table_ptr, base, j, j < jhi, n_table, size_limit, report,
                               err_ptr, (cid + 1) << 32, CHECK)
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slot, load, ok, every, kvh, k_s0, k_s1, v_s0, v_s1,
                                d, dmask, m_i, l_i, acc, qk_scale, F32DOT)
    if USE_GDC:
        gdc_launch_dependents()
    if CHECK:
        if kvh == 0:                                                   # each split its keys
            n_out, key = _outside(base, lo, hi, n_table)
            _record_one(err_ptr, n_out, (cid << 32) + key)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                     # empty: acc = 0 -> 0
    if SPLITS == 1:
        tl.store(out_ptr + b * o_s0 + h[:, None] * o_s1 + d[None, :] * o_s2,
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        row = (b * H + h) * SPLITS + sp                                # (GP,) into (B, H, S)
        tl.store(mid_o_ptr + row[:, None] * DP + d[None, :], o, mask=hmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=hmask)
        if FUSED_MERGE:
            tl.debug_barrier()                        # every thread's partials stored
            tk = ticket_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(tk, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for gi in tl.static_range(G):         # the last split: merge the G heads
                    hg = kvh * G + gi
                    _merge_row(mid_o_ptr, mid_lse_ptr, (b * H + hg) * SPLITS,
                               out_ptr + b * o_s0 + hg * o_s1, o_s2, SPLITS, D, DP, SP,
                               FRESH=True)
                tl.atomic_xchg(tk, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_row(mid_o_ptr, mid_lse_ptr, row0, out_addr, o_s2, splits, D: tl.constexpr,
               DP: tl.constexpr, SP: tl.constexpr, FRESH: tl.constexpr = False):
    """out = sum_s w_s o_s / sum_s w_s over the partial rows row0 + s of mid (s < splits),
    w_s = 2**(lse2_s - max lse2); empty splits (lse2 = -inf) weigh 0, and a row with no keys
    gets zeros. FRESH: the partials were written by other programs of this launch, read
    from L2 (`.cg`: past this SM's L1)."""
    s = tl.arange(0, SP)
    smask = s < splits
    d = tl.arange(0, DP)
    row = row0 + s                                                     # (SP,)
    if FRESH:
        lse = tl.load(mid_lse_ptr + row, mask=smask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(mid_o_ptr + row[:, None] * DP + d[None, :], mask=smask[:, None],
                    other=0.0, cache_modifier=".cg")
    else:
        lse = tl.load(mid_lse_ptr + row, mask=smask, other=float("-inf"))
        o = tl.load(mid_o_ptr + row[:, None] * DP + d[None, :], mask=smask[:, None], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                                               # (SP,) 0 if empty
    den = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)                                    # (DP,)
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(out_addr + d * o_s2, res.to(out_addr.dtype.element_ty), mask=d < D)


@triton.jit
def _merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, o_s0, o_s1, o_s2, H: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                  USE_GDC: tl.constexpr = False):
    """Program (b, h): the split-K partials of decode query b, head h, merged into out."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()
    _merge_row(mid_o_ptr, mid_lse_ptr, (b * H + h) * SPLITS, out_ptr + b * o_s0 + h * o_s1,
               o_s2, SPLITS, D, DP, SP)


@triton.jit
def _own_rows(qstart_ptr, b, t, q0, ext, n_q, n_req, max_ext):
    """The query rows t of request b (queries q0 + t) that it may read and write: t < ext,
    t < max_ext, and q0 + t in [0, q_end), q_end the next request's q_start when q_start
    increases there (as a flat batch's does) or n_q: a corrupt extend_len cannot reach another
    request's rows."""
    q_next = tl.load(qstart_ptr + tl.minimum(b + 1, n_req - 1)).to(tl.int64)
    q_end = tl.where((b + 1 < n_req) & (q_next > q0), tl.minimum(q_next, n_q), n_q)
    return (q0 + t >= 0) & (q0 + t < q_end) & (t < max_ext) & (t < ext)


@triton.jit(do_not_specialize=["n_q", "n_req", "max_ext", "n_splits"])
def _extend_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, qstart_ptr, ext_ptr, o_s0, o_s1,
                         o_s2, n_q, n_req, max_ext, n_splits, H: tl.constexpr,
                         D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
                         USE_GDC: tl.constexpr = False):
    """Program (b, t, h): query t of request b, head h, its n_splits (<= SP) partials merged
    into out; only the rows the extend kernel wrote partials for (`_own_rows`). USE_GDC (PDL):
    every input is an earlier kernel's output, so the wait comes first."""
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    ext = tl.load(ext_ptr + b).to(tl.int64)
    q0 = tl.load(qstart_ptr + b).to(tl.int64)
    if _own_rows(qstart_ptr, b, t, q0, ext, n_q, n_req, max_ext):
        row = q0 + t
        _merge_row(mid_o_ptr, mid_lse_ptr, (row * H + h) * n_splits,
                   out_ptr + row * o_s0 + h * o_s1, o_s2, n_splits, D, DP, SP)


@triton.jit(do_not_specialize=["call_id", "size_limit", "n_table", "n_mask", "n_q", "n_req",
                                "max_ext", "n_splits"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, start_ptr, prefix_ptr, ext_ptr,
                   qstart_ptr, mask_ptr, err_ptr, mid_o_ptr, mid_lse_ptr, call_id, size_limit,
                   n_table, qk_scale, q_s0, q_s1, q_s2, o_s0, o_s1, o_s2, k_s0, k_s1, v_s0,
                   v_s1, m_s0, m_s1, m_s2, n_mask, n_q, n_req, max_ext, n_splits,
                   H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CUSTOM: tl.constexpr, F32DOT: tl.constexpr, CHECK: tl.constexpr,
                   USE_GDC: tl.constexpr = False):
    """Program (b, query block, kv head x split): rows r = (t, g) of BLOCK_M queries x GP
    heads. Query t sits at position prefix + t and sees keys pos < prefix, and window keys
    j = pos - prefix (j < extend_len) with j <= t (causal) or mask[b, t, j] | (j == t).
    Split-K (n_splits > 1, short extends: a verify of a few requests): split sp reads the
    prefix keys [sp * chunk, min((sp + 1) * chunk, prefix)), chunk = cdiv(prefix, n_splits),
    and the last split the window too; each writes its partial o and lse2 to mid_o
    (T, H, n_splits, DP) and mid_lse (T, H, n_splits), merged by `_extend_merge_kernel`;
    n_splits == 1 writes out. n_splits is a runtime value: an eager batch of any size runs
    the one compiled kernel (as a constexpr, each count compiled anew, ~1 s, mid-step).
    Bad slots and positions outside the table are reported by kv head 0 of the request's last
    query block in the grid (each split its own keys), which reads every key any of its blocks
    reads (all of pos < prefix + extend_len, unless a corrupt extend_len passes the grid's
    max_extend). A request reads and writes only its own query rows (`_own_rows`), so a
    corrupt extend_len cannot write another request's output. USE_GDC (PDL, EXTEND_PDL):
    every input (the lengths included) may be an earlier kernel's output, so every program
    waits first, before its early exit; the next kernel may launch once the key loops are
    issued."""
    if USE_GDC:
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    mb = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2).to(tl.int64) // n_splits
    sp = tl.program_id(2).to(tl.int64) % n_splits
    ext = tl.load(ext_ptr + b).to(tl.int64)
    if mb * BLOCK_M >= ext:
        return
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    base = tl.load(start_ptr + b).to(tl.int64)
    q0 = tl.load(qstart_ptr + b).to(tl.int64)
    r = tl.arange(0, BLOCK_M * GP)
    t = mb * BLOCK_M + r // GP                                         # (M,) query in request
    g = r % GP
    h = kvh * G + g
    rmask = _own_rows(qstart_ptr, b, t, q0, ext, n_q, n_req, max_ext) & (g < G)
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(q_ptr + (q0 + t)[:, None] * q_s0 + h[:, None] * q_s1 + d[None, :] * q_s2,
                mask=rmask[:, None] & dmask[None, :], other=0.0)       # (M, DP)
    m_i = tl.full([BLOCK_M * GP], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, DP], tl.float32)
    is_rep = (kvh == 0) & (mb == tl.minimum((ext - 1) // BLOCK_M, tl.num_programs(1) - 1))
    report = (tl.zeros([BLOCK_N], tl.int32) + is_rep.to(tl.int32)) != 0
    cid = call_id.to(tl.int64)
    every = tl.full([1, BLOCK_N], 1, tl.int1)
    # 1. the cached prefix (this split's part): visible to every query (positions outside the
    # table: not read)
    chunk = (prefix + n_splits - 1) // n_splits
    p_lo = sp * chunk
    p_hi = tl.minimum(p_lo + chunk, prefix)
    plo, phi = _in_table(base, p_lo, p_hi, n_table, CHECK)
    for n0 in range(plo, phi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        slot, load, ok = _load_slots(table_ptr, base, j, j < phi, n_table, size_limit, report,
                               err_ptr, (cid + 1) << 32, CHECK)
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slot, load, ok, every, kvh, k_s0, k_s1, v_s0, v_s1,
                                d, dmask, m_i, l_i, acc, qk_scale, F32DOT)
    # 2. the extend window (the last split's): causal stops after this block's last query; a
    # tree mask may look anywhere in the window
    if CUSTOM:
        hi = ext
    else:
        hi = tl.minimum(ext, (mb + 1) * BLOCK_M)
    hi = tl.where(sp == n_splits - 1, hi, 0)
    wlo, whi = _in_table(base + prefix, 0, hi, n_table, CHECK)
    for n0 in range(wlo, whi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N).to(tl.int64)                    # (N,) window index
        live = j < whi
        slot, load, ok = _load_slots(table_ptr, base + prefix, j, live, n_table, size_limit, report,
                               err_ptr, (cid + 1) << 32, CHECK)
        if CUSTOM:
            mm = (t < n_mask)[:, None] & ((j < n_mask) & live)[None, :]
            tree = tl.load(mask_ptr + b * m_s0 + t[:, None] * m_s1 + j[None, :] * m_s2,
                           mask=mm, other=0)                           # (M, N) uint8
            visible = (tree != 0) | (j[None, :] == t[:, None])
        else:
            visible = j[None, :] <= t[:, None]
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slot, load, ok, visible, kvh, k_s0, k_s1, v_s0,
                                v_s1, d, dmask, m_i, l_i, acc, qk_scale, F32DOT)
    if CHECK:
        if is_rep:
            n_pre, k_pre = _outside(base, p_lo, p_hi, n_table)
            n_win, k_win = _outside(base + prefix, 0, hi, n_table)
            _record_one(err_ptr, n_pre + n_win, (cid << 32) + tl.minimum(k_pre, k_win))
    if USE_GDC:
        gdc_launch_dependents()
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if n_splits == 1:
        tl.store(out_ptr + (q0 + t)[:, None] * o_s0 + h[:, None] * o_s1 + d[None, :] * o_s2,
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    else:
        row = ((q0 + t) * H + h) * n_splits + sp                       # (M,) into (T, H, S)
        tl.store(mid_o_ptr + row[:, None] * DP + d[None, :], o, mask=rmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=rmask)


def _f32_dot(dtype: torch.dtype) -> bool:
    """tl.dot in fp32 (ieee): for fp32 inputs (not tf32), and for bf16 under the interpreter,
    whose dot multiplies bf16's raw uint16 bits (Triton 3.9's `create_dot`)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRET)


def _register(op: str, size_limit: int, table: torch.Tensor, layer: int | None, check: int):
    """Two guard calls a launch: `call_id` for table positions outside the table (limit
    table.numel()), `call_id + 1` for slots outside [0, size_limit) (the table's entries);
    none for an unchecked launch (call_id 0 unused)."""
    guard = kv_guard(table.device)
    if not check:
        return guard, 0
    call_id = guard.register(f"{op} table position", table.numel(),
                             TablePositions(table.numel()), layer, dense=False)
    guard.register(op, size_limit, table, layer, dense=False)
    if call_id > _MAX_CALL_ID:
        raise RuntimeError(f"{op}: {call_id} guarded calls in one step without a check")
    return guard, call_id


def _check_level(checked: bool) -> int:
    return CHECK_LEVEL if checked and checks_enabled() else 0


def decode_attention_triton(q, k_buffer, v_buffer, table, kv_start, kv_len, scale: float,
                            size_limit: int, num_splits: int, layer, out, checked=True,
                            defer_merge=False, one_token=False):
    """Arguments checked by `attention.decode_attention`; writes and returns `out` (B, H, D).
    checked=False: the table was checked before (`table_guard`), the kernel reads it as is.
    defer_merge: with split-K (and the merge not fused), skip the merge launch and return the
    partials (`attention.DecodePartials`) for the consumer to merge (`fused.gemv_merge`).
    one_token: a target forward of one new token per request (only each request's last key
    was stored by this forward): with `DECODE_PREFETCH` and the table checked before, the
    kernel reads the earlier keys before its PDL wait."""
    B, H, D = q.shape
    hkv = k_buffer.shape[1]
    if B == 0:
        return out
    G = H // hkv
    GP, DP = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    block_n = DECODE_BLOCK_N or (64 if DP <= 128 else 32)
    if num_splits > 1:   # scratch shapes from host ints only (graph capture allocates them once)
        mid_o = torch.empty(B, H, num_splits, DP, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out                                          # unused
    check = _check_level(checked)
    guard, call_id = _register("decode_attention", size_limit, table, layer, check)
    tickets = decode_tickets(q.device) if num_splits > 1 and FUSED_DECODE_MERGE else None
    fused = tickets is not None and B * hkv <= tickets.numel()
    sp = triton.next_power_of_2(num_splits)
    use_pdl = pdl.enabled(q.device)
    _decode_kernel[(B, hkv, num_splits)](
        q, k_buffer, v_buffer, table, kv_start, kv_len, out, mid_o, mid_lse, guard.err,
        tickets if fused else guard.err, call_id, size_limit, table.numel(), scale * _LOG2E,
        *q.stride(), *out.stride(), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), H=H, G=G, GP=GP, D=D, DP=DP,
        BLOCK_N=block_n, SPLITS=num_splits, SP=sp, FUSED_MERGE=fused,
        F32DOT=_f32_dot(q.dtype), CHECK=check, USE_GDC=use_pdl, MIN_CHUNK=DECODE_MIN_CHUNK,
        PREFETCH=DECODE_PREFETCH and one_token and check == 0,
        num_warps=DECODE_WARPS, num_stages=key_loop_stages(check, True),
        **pdl.launch_options(use_pdl))
    if num_splits > 1 and not fused:
        if defer_merge:
            guard.after_launch()
            from eaglekv.kernels.attention import DecodePartials
            return DecodePartials(out, mid_o, mid_lse, D)
        merge_decode_partials(mid_o, mid_lse, out)
    guard.after_launch()
    return out


def merge_decode_partials(mid_o, mid_lse, out):
    """`_decode_kernel`'s split-K partials (B, H, S, DP) / (B, H, S) merged into out (B, H, D)."""
    B, H, S, DP = mid_o.shape
    use_pdl = pdl.enabled(out.device)
    _merge_kernel[(B, H)](mid_o, mid_lse, out, *out.stride(), H=H, D=out.shape[2], DP=DP,
                          SPLITS=S, SP=triton.next_power_of_2(S), USE_GDC=use_pdl,
                          num_warps=1 if DP <= 64 else 2, **pdl.launch_options(use_pdl))
    return out


# The decode kernel's tile (exploring, bench/decode_tiles.py): keys in tiles of DECODE_BLOCK_N
# (None: 64, 32 past 128 dims), DECODE_WARPS warps a program, and at least DECODE_MIN_CHUNK
# keys a split (0: cdiv(kv_len, splits), so a graph captured for long contexts spreads a
# short one over all its splits, ~19 keys each at 300 keys and 16 splits).
DECODE_BLOCK_N: int | None = None
DECODE_WARPS = 4
DECODE_MIN_CHUNK = 0
# A one-token decode's first key tile (its slots and the K/V of every key but the last) read
# before the kernel's PDL wait (`_decode_kernel`'s PREFETCH), so the table -> K/V chain of
# dependent loads overlaps the kernel before it (qkv + RoPE + store) instead of following it:
# at batch 1 on the H200 each of the 30 decode launches took 3.3 us a token (2026-12-06). Built
# 2026-12-07 on the CPU (bit for bit the same output under the interpreter), not yet timed:
# off until it is (EAGLEKV_DECODE_PREFETCH=1, the bench's `*_dpf` modes).
DECODE_PREFETCH = os.environ.get("EAGLEKV_DECODE_PREFETCH", "0") == "1"
# The split-K decode's merge inside the decode launch (`_decode_kernel`'s FUSED_MERGE): the
# separate merge kernel ran 1.33 us a launch at batch 1 on the H100, once a layer (2026-12-05:
# plain's decode 3.25 us + merge 1.33 us of the ~23 us a layer). Built on the CPU (interpreter,
# and compiled for sm_90) 2026-12-05 evening, neither run nor timed on a GPU: off until it is
# (EAGLEKV_FUSED_DECODE_MERGE=1 or the bench's `*_fmerge` modes turn it on).
FUSED_DECODE_MERGE = os.environ.get("EAGLEKV_FUSED_DECODE_MERGE", "0") == "1"
# Programmatic dependent launch for the extend kernel and its merge too (with PDL on: a
# verify's layers then chain Triton to Triton where its matmuls run in the gemv kernel, the
# bench's `*_gemv8_gt1k_xpdl`). Measured on an H100 2026-12-05 (18:50): the S5 step runs
# 3766 kernels an engine step in 9.19 ms of kernel time and 11.66 ms of wall, ~0.65 us idle a
# kernel boundary, as plain decoding had without PDL (0.62 us) and not with it (0.07 us).
# Built without a GPU that night: off until measured (EAGLEKV_EXTEND_PDL=1 turns it on).
EXTEND_PDL = os.environ.get("EAGLEKV_EXTEND_PDL", "0") == "1"
_TICKETS: dict[torch.device, torch.Tensor] = {}
TICKETS = 1 << 16      # (b, kv head) pairs of one decode launch that can merge in it


def decode_tickets(device: torch.device) -> torch.Tensor | None:
    """The device's ticket counters of the fused merge (int32 zeros, each put back to 0 by the
    launch that used it). Made outside graph capture (the attention backend makes it at
    construction); None while capturing before it exists (the launch merges separately)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _TICKETS.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _TICKETS[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def extend_tile(max_extend: int, GP: int, DP: int) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_N, short) of an extend: rows = BLOCK_M * GP queries x heads per
    program, ~64-128 (at least 16 queries; a short extend: at least SHORT_MIN_ROWS rows where
    set, tl.dot's 16 at the least), keys in tiles of 64 (32 past 64 dims; a short extend's at
    most SHORT_BLOCK_N)."""
    short = max_extend <= SHORT_EXTEND
    least = 16 if not short or SHORT_MIN_ROWS is None else -(-max(16, SHORT_MIN_ROWS) // GP)
    block_m = max(least, min(triton.next_power_of_2(max_extend), 128 // GP))
    block_n = 64 if DP <= 64 else 32
    if short:
        block_n = min(block_n, SHORT_BLOCK_N)
    return block_m, block_n, short


def extend_attention_triton(q, k_buffer, v_buffer, table, kv_start, prefix_len, extend_len,
                            q_start, scale: float, size_limit: int, mask, max_extend: int,
                            layer, out, checked=True, num_splits: int | None = None,
                            max_keys: int | None = None):
    """Arguments checked by `attention.extend_attention`; writes and returns `out` (T, H, D).
    checked=False as in `decode_attention_triton`. num_splits None: `extend_num_splits`."""
    T, H, D = q.shape
    B, hkv = kv_start.shape[0], k_buffer.shape[1]
    if B == 0 or max_extend == 0 or T == 0:
        return out
    G = H // hkv
    GP, DP = triton.next_power_of_2(G), max(16, triton.next_power_of_2(D))
    block_m, block_n, short = extend_tile(max_extend, GP, DP)
    blocks = triton.cdiv(max_extend, block_m)
    if num_splits is None:
        num_splits = extend_num_splits(B * blocks * hkv, short, max_keys, q.device)
    if num_splits > 1:   # scratch shapes from host ints only, as decode's
        mid_o = torch.empty(T, H, num_splits, DP, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(T, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out                                          # unused
    custom = mask is not None
    mk = mask.view(torch.uint8) if custom else table                   # bool read as bytes
    ms = mk.stride() if custom else (0, 0, 0)
    check = _check_level(checked)
    guard, call_id = _register("extend_attention", size_limit, table, layer, check)
    use_pdl = EXTEND_PDL and pdl.enabled(q.device)
    _extend_kernel[(B, blocks, hkv * num_splits)](
        q, k_buffer, v_buffer, out, table, kv_start, prefix_len, extend_len, q_start, mk,
        guard.err, mid_o, mid_lse, call_id, size_limit, table.numel(), scale * _LOG2E,
        *q.stride(), *out.stride(), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), *ms, mask.shape[1] if custom else 0, T, B,
        max_extend, num_splits, H=H, G=G, GP=GP, D=D, DP=DP, BLOCK_M=block_m,
        BLOCK_N=block_n, CUSTOM=custom, F32DOT=_f32_dot(q.dtype), CHECK=check,
        USE_GDC=use_pdl, num_warps=8 if block_m * GP >= 128 else 4,
        num_stages=key_loop_stages(check, short), **pdl.launch_options(use_pdl))
    if num_splits > 1:
        _extend_merge_kernel[(B, max_extend, H)](
            mid_o, mid_lse, out, q_start, extend_len, *out.stride(), T, B, max_extend,
            num_splits, H=H, D=D, DP=DP,
            SP=max(MAX_EXTEND_SPLITS, triton.next_power_of_2(num_splits)), USE_GDC=use_pdl,
            num_warps=1 if DP <= 64 else 2, **pdl.launch_options(use_pdl))
    guard.after_launch()
    return out


# Split-K of a short extend (a verify, a draft's window extend) whose grid leaves most SMs
# idle: at batch 1 SmolLM2's S5 verify ran 3 programs (one a kv head), each over every key
# of the ~300 in turn, 12.2 us a launch and 22% of the step's device time on the H100
# (2026-12-05). EXTEND_SPLITS (EAGLEKV_EXTEND_SPLITS) forces a count: 1 is the kernel without.
MAX_EXTEND_SPLITS = 8
EXTEND_SPLITS: int | None = (int(os.environ["EAGLEKV_EXTEND_SPLITS"])
                             if os.environ.get("EAGLEKV_EXTEND_SPLITS") else None)


def extend_num_splits(programs: int, short: bool, max_keys: int | None,
                      device: torch.device) -> int:
    """Splits of a short extend's prefix so that its `programs` (requests x query blocks x kv
    heads) times the splits reach 2 x the SMs, capped at MAX_EXTEND_SPLITS and at
    cdiv(max_keys, MIN_KEYS_PER_SPLIT) (a host bound; None: no bound); 1 for a long extend (a
    prefill fills the GPU with query blocks) or a grid that has an SM each already. Under the
    interpreter (a CPU device: tests only) 1 unless EXTEND_SPLITS says otherwise: each split
    is a program it runs in turn (the split tests set it)."""
    from eaglekv.kernels.attention import _sm_count
    if EXTEND_SPLITS is not None:
        return max(1, EXTEND_SPLITS)
    if device.type != "cuda":
        return 1
    return split_count(programs, short, max_keys, _sm_count(device))


def split_count(programs: int, short: bool, max_keys: int | None, sms: int) -> int:
    """`extend_num_splits` for a GPU of `sms` SMs."""
    from eaglekv.kernels.attention import MIN_KEYS_PER_SPLIT
    if not short or programs >= sms:
        return 1
    want = -(-2 * sms // max(1, programs))
    by_len = MAX_EXTEND_SPLITS if max_keys is None else -(-max(1, max_keys) // MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_EXTEND_SPLITS, want, by_len))
