"""Triton kernels of `fused.py` (formulas and references there). The wrappers take checked
arguments, allocate the outputs and launch once: no host sync, shapes from host ints only, so
every launch can be captured in a CUDA graph. Integer strides are passed as they are: Triton
specializes a stride of 1, so a contiguous tensor costs nothing extra.

Launch cost. Triton's dispatch costs ~16 us of host time a call on the H200 host (measured:
add_rms_norm 35.5 -> 19.5 us, silu_and_mul 23.8 -> 15.0 us an eager call at T=1 with the
cached launcher below; torch's add + rms_norm took 21.9, silu * up 18.6), more than the kernel
runs at decode sizes (1.0-2.4 us in a graph replay). So each kernel keeps, per launch
signature (shapes, strides, dtypes, devices, 16-byte alignment of every pointer, the flags),
the CompiledKernel's launcher: the first call of a signature runs the host checks and Triton's
dispatch, later ones skip both (the signature holds everything the checks read) and call the
launcher with the same positional arguments. `EAGLEKV_TRITON_FAST_LAUNCH=0`, a launch hook (a
profiler) or an older Triton without a launcher take the full path always.

rope_store_qkv's guard is store_cache's: a slot outside [0, size_limit) (or a position outside
the cos/sin tables) is never dereferenced and is recorded in the device error buffer of
`eaglekv.kernels.guard`: err[0] += 1 once per bad token, err[1] = min(err[1],
call_id * 2**32 + token). Relaxed atomics, predicated off on the normal path (see
store_cache_triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from eaglekv.kernels import store_cache_triton as sct   # its launch-hook check, raw stream
from eaglekv.kernels import pdl
from eaglekv.kernels.guard import FLAGS, kv_guard
from eaglekv.kernels.pdl import gdc_launch_dependents, gdc_wait

MAX_HIDDEN = 8192            # add_rms_norm's kernel holds one whole row in registers
MAX_CALL_ID = 2**31 - 1      # call ids are passed as i32
MAX_LAUNCHES = 1024          # cached signatures per kernel (token counts vary): then start over
ROPE_TILE = 2048             # (heads x pairs) elements per rope_store_qkv program
ROPE_MIN_PROGRAMS = 8        # rope_store_qkv programs wanted for a small batch
SILU_BLOCK = 1024            # columns per silu_and_mul program


def _pow2(n: int) -> int:
    """Smallest power of 2 >= n (n >= 1); plain Python: `triton.next_power_of_2` and
    `triton.cdiv` go through Triton's constexpr-function wrapper, ~4 us a call on the H200
    host."""
    return 1 << (n - 1).bit_length()


def _sig(t: torch.Tensor) -> tuple:
    """What a launch depends on of one tensor: shape, strides, dtype, device, alignment."""
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0


class CachedLaunch:
    """One kernel's launches by signature (module docstring): `lookup` gives the cached
    launcher or None; `launch` runs it, or goes through Triton's dispatch and caches the
    result. Both paths pass the same positional arguments (constexprs included), and the
    outputs are fresh allocations (always aligned), so the signature covers them."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict[tuple, tuple] = {}

    def lookup(self, key: tuple):
        if not FLAGS.fast_launch or sct._RAW_STREAM is None or sct._hooks_set():
            return None
        return self.cache.get(key)

    def launch(self, hit, key: tuple, grid: tuple, args: tuple, device: int, **options):
        if hit is not None:
            run, function, metadata = hit
            run(grid[0], grid[1], 1, sct._RAW_STREAM(device), function, metadata, None, None,
                None, *args)
            return
        compiled = self.full_launch(grid, args, options)
        if FLAGS.fast_launch and compiled is not None and all(
                hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            if len(self.cache) >= MAX_LAUNCHES:
                self.cache.clear()
            self.cache[key] = (compiled.run, compiled.function, compiled.packed_metadata)

    def full_launch(self, grid: tuple, args: tuple, options: dict):
        """Triton's dispatch; returns the CompiledKernel (None under the interpreter)."""
        return self.kernel[grid](*args, **options)


@triton.jit
def _round(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 x -> dtype, rounded to nearest even. BY_HAND (the CPU interpreter, whose fp32 ->
    bf16 cast truncates): bf16 = high half of `bits + 0x7FFF + lsb`, lsb = bit 16 of bits."""
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, x_s0, x_s1, r_s0, r_s1, w_s0,
                         H, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         BY_HAND: tl.constexpr):
    """Program t: row t. s = round(x + r) (as torch's `residual + x`; rounded to the
    residual's dtype, which an fp32 x beside it does not change), out = s * rsqrt(mean(s^2)
    + eps) * w in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)                                           # (BLOCK,)
    m = cols < H
    s = tl.load(x_ptr + t * x_s0 + cols * x_s1, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + t * r_s0 + cols * r_s1, mask=m, other=0.0)
        s = _round(s.to(tl.float32) + r.to(tl.float32), res_ptr.dtype.element_ty, BY_HAND)
        tl.store(res_ptr + t * H + cols, s, mask=m)
    s = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(w_ptr + cols * w_s0, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, _round(s * inv * w, out_ptr.dtype.element_ty, BY_HAND),
             mask=m)


def add_rms_norm_triton(x, residual, weight, eps: float, check):
    """`check(x, residual, weight)`: the host checks, run on a new signature only."""
    r = x if residual is None else residual
    key = (_sig(x), residual is None, _sig(r), _sig(weight))
    hit = _ADD_RMS_NORM.lookup(key)
    if hit is None:
        check(x, residual, weight)
        if x.shape[1] > MAX_HIDDEN:
            raise ValueError(f"add_rms_norm: hidden size {x.shape[1]} > {MAX_HIDDEN}, the "
                             f"largest row the Triton kernel holds")
    T, H = x.shape
    dt = x.dtype if residual is None else residual.dtype  # x may be the fp32 accumulator
    out = torch.empty((T, H), dtype=dt, device=x.device)
    new_res = x if residual is None else torch.empty((T, H), dtype=dt, device=x.device)
    if T:
        block = _pow2(H)
        args = (x, r, weight, out, new_res, x.stride(0), x.stride(1), r.stride(0), r.stride(1),
                weight.stride(0), H, eps, residual is not None, block, not x.is_cuda)
        _ADD_RMS_NORM.launch(hit, key, (T, 1), args, x.get_device(),
                             num_warps=min(16, max(4, block // 512)))
    return out, new_res


_ADD_RMS_NORM = CachedLaunch(_add_rms_norm_kernel)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, s0, s1, I, BLOCK: tl.constexpr,
                         BY_HAND: tl.constexpr):
    """Program (t, j): out[t, c] = silu(g) * u = g * sigmoid(g) * u with g = gate_up[t, c],
    u = gate_up[t, I + c], for the columns c of block j; fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                # (BLOCK,)
    m = cols < I
    g = tl.load(gu_ptr + t * s0 + cols * s1, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * s0 + (cols + I) * s1, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + t * I + cols, _round(y, out_ptr.dtype.element_ty, BY_HAND), mask=m)


def silu_and_mul_triton(gate_up, check):
    key = _sig(gate_up)
    hit = _SILU_AND_MUL.lookup(key)
    if hit is None:
        check(gate_up)
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T and I:
        block = min(SILU_BLOCK, _pow2(I))
        args = (gate_up, out, gate_up.stride(0), gate_up.stride(1), I, block, not gate_up.is_cuda)
        _SILU_AND_MUL.launch(hit, key, (T, -(-I // block)), args, gate_up.get_device())
    return out


_SILU_AND_MUL = CachedLaunch(_silu_and_mul_kernel)


@triton.jit
def _norm_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, kk, km, x_s0, r_s0, K, inv,
               HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL, BY_HAND: tl.constexpr):
    """Columns kk of rows: s = round(x + r) (stored as the new residual when asked), then
    round(s * inv * w), the matmul's input tile (BLOCK_M, BLOCK_K) in the norm weight's dtype.
    The sum rounds to the residual's dtype: x may be fp32 (the fused MLP's accumulator,
    `_mlp_kernel`) beside a bf16 residual; otherwise all three share one dtype."""
    m2 = rm[:, None] & km[None, :]
    s = tl.load(x_ptr + rows[:, None] * x_s0 + kk[None, :], mask=m2, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * r_s0 + kk[None, :], mask=m2, other=0.0)
        s = _round(s.to(tl.float32) + r.to(tl.float32), r_ptr.dtype.element_ty, BY_HAND)
        if STORE_RESIDUAL:
            tl.store(res_ptr + rows[:, None] * K + kk[None, :], s, mask=m2)
    w = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    return _round(s.to(tl.float32) * inv[:, None] * w[None, :], nw_ptr.dtype.element_ty,
                  BY_HAND)


@triton.jit
def _norm_matmul_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, res_ptr, M, K, N_OUT, x_s0,
                        r_s0, w_s0, eps, HAS_RESIDUAL: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr, BY_HAND: tl.constexpr):
    """Program (i, j): rows block i, output columns block j of
        s = round(x + r); h = round(s * rsqrt(mean(s^2) + eps) * nw); y = round(h @ W)
    (SILU: W = [gate | up] (K, 2 N_OUT) and y = round(silu(g) * u), g and u rounded first, as
    add_rms_norm -> matmul -> silu_and_mul round). A first pass over the row gives rsqrt, the
    second streams W once; programs j == 0 write the new residual s."""
    i, j = tl.program_id(0), tl.program_id(1)
    rows = (i * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rm = rows < M
    ks = tl.arange(0, BLOCK_K)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                                       # pass 1: mean(s^2)
        kk = k0 + ks
        m2 = rm[:, None] & (kk < K)[None, :]
        s = tl.load(x_ptr + rows[:, None] * x_s0 + kk[None, :], mask=m2, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + rows[:, None] * r_s0 + kk[None, :], mask=m2, other=0.0)
            s = _round(s.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, BY_HAND)
        s = s.to(tl.float32)
        sq += tl.sum(s * s, axis=1)
    inv = tl.rsqrt(sq / K + eps)                                          # (BLOCK_M,)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N_OUT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                                       # pass 2: h @ W
        kk = k0 + ks
        km = kk < K
        h = _norm_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, kk, km, x_s0, r_s0, K, inv,
                       HAS_RESIDUAL, j == 0, BY_HAND)
        wm = km[:, None] & cm[None, :]
        w_at = w_ptr + kk.to(tl.int64)[:, None] * w_s0 + cols[None, :]
        w = tl.load(w_at, mask=wm, other=0.0)
        if IEEE:   # fp32 (not tf32), or bf16 under the interpreter (see attention_triton)
            acc += tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(h, w)
        if SILU:
            u = tl.load(w_at + N_OUT, mask=wm, other=0.0)
            if IEEE:
                acc2 += tl.dot(h.to(tl.float32), u.to(tl.float32), input_precision="ieee")
            else:
                acc2 += tl.dot(h, u)
    dt = out_ptr.dtype.element_ty
    y = _round(acc, dt, BY_HAND)
    if SILU:
        g = y.to(tl.float32)
        u = _round(acc2, dt, BY_HAND).to(tl.float32)
        y = _round(g * tl.sigmoid(g) * u, dt, BY_HAND)
    tl.store(out_ptr + rows[:, None] * N_OUT + cols[None, :], y,
             mask=rm[:, None] & cm[None, :])


def norm_matmul_triton(x, residual, norm_weight, eps: float, w, silu_mul: bool, check):
    """x, residual (M, K), w (K, N), each contiguous along its last dimension -> (y (M, N or
    N/2), new residual (M, K) contiguous); one launch."""
    r = x if residual is None else residual
    key = (_sig(x), residual is None, _sig(r), _sig(norm_weight), _sig(w), silu_mul)
    hit = _NORM_MATMUL.lookup(key)
    if hit is None:
        check(x, residual, norm_weight, w, silu_mul)
    M, K = x.shape
    n_out = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    new_res = x if residual is None else torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M:
        bm = min(64, max(16, _pow2(M)))
        bn = 32 if n_out <= 2048 else 64
        bk = min(128, max(16, _pow2(K)))
        args = (x, r, norm_weight, w, out, new_res, M, K, n_out, x.stride(0), r.stride(0),
                w.stride(0), eps, residual is not None, silu_mul, bm, bn, bk,
                x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not x.is_cuda),
                not x.is_cuda)
        _NORM_MATMUL.launch(hit, key, (-(-M // bm), -(-n_out // bn)), args, x.get_device(),
                            num_warps=4, num_stages=3)
    return out, new_res


_NORM_MATMUL = CachedLaunch(_norm_matmul_kernel)


# the bare kernel's best tiling at M = 1 on an H100 (bench/explore_h200.py --parts gemv2,
# 2026-12-05: 4 weight rows a program, K in one 1024-wide tile, 4 warps; it ties cuBLAS on
# SmolLM2's four matmuls); was 8 / 256 / 4 (5.1-9.6 us against cuBLAS's 3.3-5.1 on the H200).
# EAGLEKV_GEMV_CONFIG="block_n,block_k,num_warps" overrides it (read at import)
GEMV_CONFIG = dict(zip(("block_n", "block_k", "num_warps"),
                       (int(v) for v in os.environ.get("EAGLEKV_GEMV_CONFIG", "4,1024,4")
                        .split(","))))
# "max_tile": a cap on BLOCK_M * BLOCK_K (0: none, the default until measured on a GPU). The
# (BLOCK_M, BLOCK_N, BLOCK_K) product tile lives in registers: compiled for sm_90 (ptxas, 4
# warps, bench/gemv_regs.py) the qkv form takes 80 registers a thread at M = 1, 128 at 4 and
# 214 at 8 (gate_up with SiLU: 128 / 205 / 254), so at 8 rows two programs fit an SM where
# six did at one row, and S5's 6-row verify in the kernel ran slower than cuBLAS
# (gemv8: 1743 against 2215 tok/s, H100). Capped at 1024 the 8-row tile is BLOCK_K = 128:
# 64 / 80 registers, the occupancy of one row (EAGLEKV_GEMV_MAX_TILE, the bench's `_gt1k`)
GEMV_CONFIG["max_tile"] = int(os.environ.get("EAGLEKV_GEMV_MAX_TILE", "0"))
# Rows of K >= GEMV_WIDE_K (an 8B's 4096 and 14336; SmolLM2's are 576 and 1536) take
# GEMV_WIDE_BLOCK_N weight rows a program. Measured in the Llama-3.1-8B decode step replayed
# at batch 1 on an H100 (2026-12-06 16:10, one process, every matmul of the step in the kernel
# under PDL; bench/results/llama8b_variants_h100_20261206c.json): 4 / 1024 / 4 ran the step in
# 6.07 ms (82.3% of the weight-streaming roofline, 6.06 again after the variants), 8 rows a
# program 5.89 ms (84.8%); 2 warps 83.5%, K tiles of 2048 83.5%, 2 rows 79.9%, 8 warps 72.4%,
# K tiles of 512 74.7% (and 8 rows with 2 warps 83.1%, `..._bn8nw2_...json`). One row of x
# only, the case measured: with 2-4 rows the (rows, 8, BLOCK_K) product tile is the register
# load of 4-8 rows at 4 (205-254 registers a thread for gate_up, bench/gemv_regs.py). An
# explicit block_n (or EAGLEKV_GEMV_WIDE=0: off) wins.
GEMV_WIDE_K = 4096 if os.environ.get("EAGLEKV_GEMV_WIDE", "1") != "0" else None
GEMV_WIDE_BLOCK_N = 8


def gemv_block_k(M: int, K: int, block_k: int | None = None) -> int:
    """The gemv's BLOCK_K for M rows of K: `block_k`, else the configured one capped by
    `max_tile` / BLOCK_M (at least 128); never more than K's power of two (at least 16)."""
    bk = block_k or GEMV_CONFIG["block_k"]
    tile = GEMV_CONFIG.get("max_tile", 0)
    if block_k is None and tile:
        bk = min(bk, max(128, tile // _pow2(M)))
    return min(bk, max(16, _pow2(K)))


# The tensor-core tile, for 5-16 rows (a verify window of 5-16 tokens at batch 1, a decode
# batch of 5-16): rows padded to BLOCK_M = 16 and the products by tl.dot (`_gemv_acc`), where
# the register tile above needs (BLOCK_M, BLOCK_N, BLOCK_K) fp32 products (214-254 registers a
# thread at 8 rows: S5's verify in it ran 2.5x the device time of cuBLAS). BLOCK_N even and
# dividing head_dim keeps the RoPE epilogue's whole pairs. EAGLEKV_GEMV_DOT_CONFIG=
# "block_n,block_k,num_warps" overrides it (read at import).
GEMV_BCAST_MAX_ROWS = 4
GEMV_DOT_CONFIG = dict(zip(("block_n", "block_k", "num_warps"),
                           (int(v) for v in os.environ.get("EAGLEKV_GEMV_DOT_CONFIG",
                                                           "16,128,4").split(","))))


def gemv_tiling(M: int, K: int, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, DOT) of the gemv for M rows of K: the register
    tile up to GEMV_BCAST_MAX_ROWS rows (and up to fused.GEMV_GROUP_MAX_ROWS in row groups of
    GEMV_BCAST_MAX_ROWS: `gemv_row_groups`), the tensor-core tile (GEMV_DOT_CONFIG) above."""
    from eaglekv.kernels import fused
    if M <= max(GEMV_BCAST_MAX_ROWS, fused.GEMV_GROUP_MAX_ROWS):
        bm = min(_pow2(M), GEMV_BCAST_MAX_ROWS)
        wide = M == 1 and GEMV_WIDE_K is not None and K >= GEMV_WIDE_K
        return (bm, block_n or (GEMV_WIDE_BLOCK_N if wide else GEMV_CONFIG["block_n"]),
                gemv_block_k(bm, K, block_k), num_warps or GEMV_CONFIG["num_warps"], False)
    bk = min(block_k or GEMV_DOT_CONFIG["block_k"], max(16, _pow2(K)))
    return (max(16, _pow2(M)), block_n or GEMV_DOT_CONFIG["block_n"], bk,
            num_warps or GEMV_DOT_CONFIG["num_warps"], True)


def gemv_row_groups(M: int, bm: int, dot: bool) -> int:
    """Row groups of a gemv launch (its grid's second dimension): M rows in tiles of bm."""
    return 1 if dot else -(-M // bm)


@triton.jit
def _row_group(x_ptr, r_ptr, res_ptr, o_ptr, M, x_s0, r_s0, o_s0, BLOCK_M: tl.constexpr):
    """Row group g = program_id(1) of a launch in row groups (`gemv_row_groups`): the
    pointers of its first row (input, residual, new residual, output of row stride o_s0), its
    row count and its first row's index in the call -> (x, r, res, o, M, row0)."""
    row0 = tl.program_id(1) * BLOCK_M
    return (x_ptr + row0 * x_s0, r_ptr + row0 * r_s0, res_ptr + row0 * r_s0,
            o_ptr + row0 * o_s0, M - row0, row0)


@triton.jit
def _gemv_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, kk, km, x_s0, r_s0, K, inv,
               STORE_RESIDUAL, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               BY_HAND: tl.constexpr):
    """The gemv's input tile, columns kk: the normed rows (`_norm_rows`) or x as it is,
    (BLOCK_M, BLOCK_K) in x's dtype."""
    if NORM:
        h = _norm_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, kk, km, x_s0, r_s0, K, inv,
                       HAS_RESIDUAL, STORE_RESIDUAL, BY_HAND)
    else:
        h = tl.load(x_ptr + rows[:, None] * x_s0 + kk[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0)
    return h


# `_gemv_acc`'s one-row form (ROW2, see there) for the gemv, gemv + RoPE and MLP kernels at
# M = 1: compiled for sm_90 (bench's PTX counts, 2026-12-07) it takes the bare gemv from 27
# CTA barriers to 5 and 24 shared-memory vector stores to 2, gate_up with SiLU*mul from 38
# to 12 and 24 to 4, the fused MLP from 58 to 12 and 50 to 10: the 3-D form moved the weight
# tile through shared memory. Built 2026-12-07 without a GPU (no machine came for the call
# that was to time it): off until timed (EAGLEKV_GEMV_ONE_ROW_2D=1, the bench's `_r2d` modes).
# Read at each launch (graphs capture it).
GEMV_ONE_ROW_2D = os.environ.get("EAGLEKV_GEMV_ONE_ROW_2D", "0") == "1"


@triton.jit
def _gemv_acc(acc, h, w, DOT: tl.constexpr, IEEE: tl.constexpr, ROW2: tl.constexpr = False):
    """acc (BLOCK_M, BLOCK_N) fp32 += h (BLOCK_M, BLOCK_K) @ w (BLOCK_N, BLOCK_K)^T: fp32
    products summed in fp32 either way. DOT: on the tensor cores (BLOCK_M >= 16; IEEE: fp32
    inputs, or the CPU interpreter, in full fp32 rather than tf32); else broadcast and sum in
    registers (the one-row tile: no padding to 16 rows)."""
    if DOT:
        if IEEE:
            acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w.to(h.dtype)))
    elif ROW2 and h.shape[0] == 1:
        # one row: the products in w's own (BLOCK_N, BLOCK_K) layout, h broadcast along n,
        # summed along k; the 3-D form below moved the weight tile through shared memory
        hv = tl.reshape(h.to(tl.float32), (h.shape[1],))
        acc += tl.reshape(tl.sum(hv[None, :] * w.to(tl.float32), axis=1), (1, w.shape[0]))
    else:
        acc += tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, res_ptr, M, K, N_OUT, x_s0, r_s0,
                 w_sk, w_sn, eps, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BY_HAND: tl.constexpr, USE_GDC: tl.constexpr = False,
                 DOT: tl.constexpr = False, IEEE: tl.constexpr = False,
                 ROW2: tl.constexpr = False, GROUPS: tl.constexpr = False):
    """Program j: output columns [j*BLOCK_N, (j+1)*BLOCK_N) of all M <= BLOCK_M rows of
        h = x                                              (NORM off), or
        s = round(x + r); h = round(s * rsqrt(mean(s^2) + eps) * nw)    (NORM, as norm_matmul)
        y = round(h @ W)   (SILU: W = [gate | up], y = round(silu(round(g)) * round(u)))
    as a matrix-vector product: W (K, N) is read along k, which is contiguous when W is the
    transpose of an (N, K) row-major weight (nn.Linear's layout, `w_sk == 1`): each program
    streams BLOCK_N whole weight rows, so a decode-sized matmul spreads over N / BLOCK_N
    programs with no split-K. fp32 products summed in fp32, rounded once. Programs j == 0
    write the new residual s. USE_GDC (PDL, kernels/pdl.py): the first weight tile is loaded
    before waiting on the kernel before (the weights are no kernel's output), the rest after.
    DOT (BLOCK_M >= 16: 5-16 rows, a verify window or a small batch): the products on the
    tensor cores (`_gemv_acc`). GROUPS (more rows than BLOCK_M, `gemv_row_groups`; a
    constexpr, so one-group launches compile as before): program (j, g) takes rows
    [g * BLOCK_M, (g + 1) * BLOCK_M)."""
    j = tl.program_id(0)
    if GROUPS:
        x_ptr, r_ptr, res_ptr, out_ptr, M, _ = _row_group(x_ptr, r_ptr, res_ptr, out_ptr, M,
                                                          x_s0, r_s0, N_OUT, BLOCK_M)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    y = _gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, M, K, N_OUT, x_s0, r_s0, w_sk, w_sn,
                   eps, j, rows, cols, out_ptr.dtype.element_ty, NORM, HAS_RESIDUAL, SILU,
                   BLOCK_M, BLOCK_N, BLOCK_K, BY_HAND, USE_GDC, DOT, IEEE, ROW2)
    tl.store(out_ptr + rows[:, None] * N_OUT + cols[None, :], y,
             mask=(rows < M)[:, None] & (cols < N_OUT)[None, :])


@triton.jit
def _gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, M, K, N_OUT, x_s0, r_s0, w_sk, w_sn, eps,
               j, rows, cols, dt: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BY_HAND: tl.constexpr, USE_GDC: tl.constexpr,
               DOT: tl.constexpr, IEEE: tl.constexpr, ROW2: tl.constexpr = False):
    """`_gemv_kernel`'s product for output columns `cols` of rows `rows`, rounded to `dt`
    (BLOCK_M, BLOCK_N); the dependents may launch once it returns (USE_GDC)."""
    rm = rows < M
    ks = tl.arange(0, BLOCK_K)
    cm = cols < N_OUT
    # tile 0 of W (and of its up half): read before anything an earlier kernel writes
    km0 = ks < K
    wm0 = cm[:, None] & km0[None, :]
    w_at0 = w_ptr + cols[:, None] * w_sn + ks.to(tl.int64)[None, :] * w_sk      # (BN, BK)
    w0 = tl.load(w_at0, mask=wm0, other=0.0)
    u0 = w0
    if SILU:
        u0 = tl.load(w_at0 + N_OUT * w_sn, mask=wm0, other=0.0)
    if USE_GDC:
        gdc_wait()
    inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                                   # pass 1: mean(s^2)
            kk = k0 + ks
            m2 = rm[:, None] & (kk < K)[None, :]
            s = tl.load(x_ptr + rows[:, None] * x_s0 + kk[None, :], mask=m2, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + rows[:, None] * r_s0 + kk[None, :], mask=m2, other=0.0)
                s = _round(s.to(tl.float32) + r.to(tl.float32), r_ptr.dtype.element_ty,
                           BY_HAND)
            s = s.to(tl.float32)
            sq += tl.sum(s * s, axis=1)
        inv = tl.rsqrt(sq / K + eps)
    h = _gemv_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, ks, km0, x_s0, r_s0, K, inv,
                   j == 0, NORM, HAS_RESIDUAL, BY_HAND)                   # pass 2: h @ W
    acc = _gemv_acc(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), h, w0, DOT, IEEE, ROW2)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU:
        acc2 = _gemv_acc(acc2, h, u0, DOT, IEEE, ROW2)
    for k0 in range(BLOCK_K, K, BLOCK_K):                                 # the other tiles
        kk = k0 + ks
        km = kk < K
        h = _gemv_rows(x_ptr, r_ptr, res_ptr, nw_ptr, rows, rm, kk, km, x_s0, r_s0, K, inv,
                       j == 0, NORM, HAS_RESIDUAL, BY_HAND)
        wm = cm[:, None] & km[None, :]
        w_at = w_ptr + cols[:, None] * w_sn + kk.to(tl.int64)[None, :] * w_sk   # (BN, BK)
        acc = _gemv_acc(acc, h, tl.load(w_at, mask=wm, other=0.0), DOT, IEEE, ROW2)
        if SILU:
            acc2 = _gemv_acc(acc2, h, tl.load(w_at + N_OUT * w_sn, mask=wm, other=0.0), DOT,
                             IEEE, ROW2)
    if USE_GDC:
        gdc_launch_dependents()
    y = _round(acc, dt, BY_HAND)
    if SILU:
        g = y.to(tl.float32)
        u = _round(acc2, dt, BY_HAND).to(tl.float32)
        y = _round(g * tl.sigmoid(g) * u, dt, BY_HAND)
    return y


def gemv_triton(x, residual, norm_weight, eps: float, w, silu_mul: bool, check,
                block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None):
    """x (M <= 16, K) contiguous rows, w (K, N) any strides (fast when w.stride(0) == 1);
    norm_weight None: y = x @ w only (residual unused) -> (y, new residual or None)."""
    norm = norm_weight is not None
    r = x if residual is None else residual
    M, K = x.shape
    bm, bn, bk, nw, dot = gemv_tiling(M, K, block_n, block_k, num_warps)
    use_pdl = pdl.enabled(x.device)
    groups = gemv_row_groups(M, bm, dot)
    key = (_sig(x), residual is None, _sig(r), norm and _sig(norm_weight), _sig(w), silu_mul,
           bm, bn, bk, nw, dot, use_pdl, GEMV_ONE_ROW_2D, groups > 1)
    hit = _GEMV.lookup(key)
    if hit is None:
        check(x, residual, norm_weight, w, silu_mul)
    n_out = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = torch.empty((M, n_out), dtype=w.dtype, device=x.device)
    new_res = (None if not norm else x if residual is None
               else torch.empty((M, K), dtype=residual.dtype, device=x.device))
    if M:
        args = (x, r, norm_weight if norm else x, w, out,
                new_res if new_res is not None else out, M, K, n_out, x.stride(0),
                r.stride(0), w.stride(0), w.stride(1), eps, norm, residual is not None,
                silu_mul, bm, bn, bk, not x.is_cuda, use_pdl, dot,
                w.dtype == torch.float32 or not x.is_cuda, GEMV_ONE_ROW_2D, groups > 1)
        _GEMV.launch(hit, key, (-(-n_out // bn), groups), args,
                     x.get_device(),
                     num_warps=nw, num_stages=2, **pdl.launch_options(use_pdl))
    return out, new_res


_GEMV = CachedLaunch(_gemv_kernel)


@triton.jit
def _mlp_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, wd_ptr, acc_ptr, res_ptr, zero_ptr, M, K, I,
                x_s0, r_s0, w_sk, w_sn, wd_si, wd_sk, acc_s0, n_zero, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ZBLOCK: tl.constexpr, BY_HAND: tl.constexpr,
                USE_GDC: tl.constexpr = False, IEEE: tl.constexpr = False,
                ATOMIC: tl.constexpr = True, DOWN: tl.constexpr = True,
                ROW2: tl.constexpr = False, GROUPS: tl.constexpr = False):
    """A decoder layer's MLP in one launch, split along the intermediate dimension. Program j
    takes intermediate columns c = [j*BLOCK_N, (j+1)*BLOCK_N) of I:
        s = round(x + r); h = round(s * rsqrt(mean(s^2) + eps) * nw)   (as `_gemv_kernel`)
        a = round(silu(round(h @ Wg[:, c])) * round(h @ Wu[:, c]))      (BLOCK_M, BLOCK_N)
        acc[m, :] += a[m, :] @ Wd[c, :]              (fp32 atomic adds: a split-K of down)
    so acc ends as the fp32 sum of down's products, which the next layer's add + RMSNorm
    reads as its x (rounded with the residual there). acc must be zero when the kernel
    starts: each program zeroes a ZBLOCK slice of `zero_ptr` (the next layer's accumulator,
    n_zero fp32) after the wait. K (the hidden size) is one tile (BLOCK_K >= K); w (K, 2I)
    column-major ([gate | up], `_gemv_kernel`'s SILU layout), wd (I, K) by rows (row i is
    down's input i). The sums' order varies between runs (atomics): fp32 results may differ
    in the last bits. USE_GDC (PDL): the three weight tiles are read before the wait.
    ATOMIC=False (plain stores: a wrong sum) and DOWN=False (no down product) exist only to
    time the parts (bench/explore_mlp.py). GROUPS (forwards of more than BLOCK_M rows; a
    constexpr, so one-group launches compile as before): program (j, g) takes rows
    [g * BLOCK_M, (g + 1) * BLOCK_M) with the same weight slice (the second group's read
    mostly from L2); only group 0 clears `zero_ptr`."""
    j = tl.program_id(0)
    row0 = 0
    if GROUPS:
        x_ptr, r_ptr, res_ptr, acc_ptr, M, row0 = _row_group(x_ptr, r_ptr, res_ptr, acc_ptr, M,
                                                             x_s0, r_s0, acc_s0, BLOCK_M)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    km = ks < K
    wd = tl.load(wd_ptr + cols[:, None] * wd_si + ks.to(tl.int64)[None, :] * wd_sk,
                 mask=(cols < I)[:, None] & km[None, :], other=0.0)      # (BN, BK), pre-wait
    a = _gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, M, K, I, x_s0, r_s0, w_sk, w_sn, eps,
                   j, rows, cols, w_ptr.dtype.element_ty, True, HAS_RESIDUAL, True, BLOCK_M,
                   BLOCK_N, BLOCK_K, BY_HAND, USE_GDC, False, IEEE, ROW2).to(tl.float32)
    if row0 == 0:                                # (group 0 only)
        z = j * ZBLOCK + tl.arange(0, ZBLOCK)
        tl.store(zero_ptr + z, tl.zeros([ZBLOCK], tl.float32), mask=z < n_zero)
    wf = wd.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        am = tl.sum(tl.where(rows[:, None] == m, a, 0.0), axis=0)                  # (BN,)
        if DOWN:
            part = tl.sum(am[:, None] * wf, axis=0)                                # (BK,)
        else:
            part = tl.sum(am) + ks * 0.0
        mask = km & (ks * 0 + m < M)              # (a full vector: the interpreter's masks)
        if ATOMIC:
            tl.atomic_add(acc_ptr + m * acc_s0 + ks, part, mask=mask, sem="relaxed")
        else:
            tl.store(acc_ptr + m * acc_s0 + ks, part, mask=mask)


# (block_n, num_warps) of `_mlp_kernel` by rows: intermediate columns a program (I / block_n
# programs, each adding a whole row of fp32 partials), not yet tuned on a GPU;
# EAGLEKV_MLP_CONFIG="block_n,num_warps" overrides it for every row count (read at import)
MLP_CONFIG = {1: (8, 4), 2: (4, 4), 4: (4, 4)}
if os.environ.get("EAGLEKV_MLP_CONFIG"):
    _v = tuple(int(v) for v in os.environ["EAGLEKV_MLP_CONFIG"].split(","))
    MLP_CONFIG = {m: _v for m in MLP_CONFIG}
MLP_MAX_HIDDEN = 2048        # the hidden size in one tile (SmolLM2's 576; an 8B's 4096 is not)
MLP_ROW_GROUP = 4            # rows a program: 5-8-row forwards (verifies) run two row groups


def mlp_triton(x, residual, norm_weight, eps: float, w, wd, acc, zero, *, config=None,
               atomic: bool = True, down: bool = True):
    """`_mlp_kernel`: x (M <= 8, K) contiguous rows (fp32 or w's dtype), residual (M, K) or
    None, w (K, 2I) column-major, wd (I, K) rows, acc (>= M, K) fp32 zero on entry, zero a
    contiguous fp32 buffer to clear -> (acc[:M] holding the MLP's output, new residual).
    More than MLP_ROW_GROUP rows: groups of MLP_ROW_GROUP, a second grid dimension.
    Arguments checked by `fused.fused_mlp`. config (block_n, num_warps), atomic and down:
    bench/explore_mlp.py's variants (atomic / down False time a part and give wrong sums)."""
    M, K = x.shape
    I = wd.shape[0]
    bm = min(_pow2(M), MLP_ROW_GROUP)
    groups = -(-M // bm)
    bn, nw = config or MLP_CONFIG[bm]
    progs = -(-I // bn)
    zb = _pow2(-(-zero.numel() // progs))
    use_pdl = pdl.enabled(x.device)
    r = x if residual is None else residual
    new_res = x if residual is None else torch.empty_like(residual)
    key = (_sig(x), residual is None, _sig(r), _sig(norm_weight), _sig(w), _sig(wd), _sig(acc),
           _sig(zero), bn, nw, use_pdl, atomic, down, GEMV_ONE_ROW_2D, groups > 1)
    args = (x, r, norm_weight, w, wd, acc, new_res, zero, M, K, I, x.stride(0), r.stride(0),
            w.stride(0), w.stride(1), wd.stride(0), wd.stride(1), acc.stride(0), zero.numel(),
            eps, residual is not None, bm, bn, max(16, _pow2(K)), zb, not x.is_cuda, use_pdl,
            w.dtype == torch.float32 or not x.is_cuda, atomic, down, GEMV_ONE_ROW_2D,
            groups > 1)
    _MLP.launch(_MLP.lookup(key), key, (progs, groups), args, x.get_device(), num_warps=nw,
                num_stages=1, **pdl.launch_options(use_pdl))
    return acc[:M], new_res


_MLP = CachedLaunch(_mlp_kernel)


@triton.jit
def _merge_o_kernel(mid_o_ptr, mid_lse_ptr, w_ptr, acc_ptr, zero_ptr, w_sk, w_sn, a_s0, a_s1,
                    a_s2, acc_s0, N_OUT, n_zero, H: tl.constexpr, D: tl.constexpr,
                    DP: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                    MERGED: tl.constexpr, NC: tl.constexpr, BLOCK_N: tl.constexpr,
                    ZBLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    """The decode attention's split-K merge and the o projection in one launch, the product
    split by heads. Program (b, h, c): head h of decode row b merged from its partials
    (MERGED: mid_o (B, H, SPLITS, DP), mid_lse (B, H, SPLITS), as `_merge_row` does; else
    read as it is from the attention output at mid_o with strides a_s*), cast to W's dtype
    as the merge stores it, times rows [h*D, (h+1)*D) of W (K = H * D, N) for output columns
    [c*BLOCK_N, (c+1)*BLOCK_N), added to acc[b] (fp32, zero on entry) by atomics (program
    ids (b * H + h, c)). Each program zeroes a ZBLOCK slice of `zero_ptr` (the next layer's
    accumulator, n_zero fp32) after the wait. USE_GDC (PDL): the weight block is read before
    the wait."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    c = tl.program_id(1)
    cols = (c * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cm = cols < N_OUT
    d = tl.arange(0, DP)
    dm = d < D
    w = tl.load(w_ptr + cols[:, None] * w_sn + (h * D + d)[None, :] * w_sk,
                mask=cm[:, None] & dm[None, :], other=0.0)                 # (BN, DP) pre-wait
    if USE_GDC:
        gdc_wait()
    z = ((b * H + h) * NC + c) * ZBLOCK + tl.arange(0, ZBLOCK)
    tl.store(zero_ptr + z, tl.zeros([ZBLOCK], tl.float32), mask=z < n_zero)
    if MERGED:
        s = tl.arange(0, SP)
        row = (b * H + h) * SPLITS + s
        lse = tl.load(mid_lse_ptr + row, mask=s < SPLITS, other=float("-inf"))
        o = tl.load(mid_o_ptr + row[:, None] * DP + d[None, :], mask=(s < SPLITS)[:, None],
                    other=0.0)                                               # (SP, DP)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        wt = tl.exp2(lse - m)                                                # 0 if empty
        den = tl.sum(wt, 0)
        x = tl.sum(wt[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    else:
        x = tl.load(mid_o_ptr + b * a_s0 + h * a_s1 + d * a_s2, mask=dm, other=0.0)
    x = x.to(w_ptr.dtype.element_ty).to(tl.float32)                         # (DP,)
    if USE_GDC:
        gdc_launch_dependents()
    part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)                    # (BN,)
    tl.atomic_add(acc_ptr + b * acc_s0 + cols, part, mask=cm, sem="relaxed")


MERGE_O_BLOCK_N = 64         # output columns a program: SmolLM2's 9 heads x 9 blocks of 64


def merge_o_triton(attn, mid_lse, head_dim: int, w, acc, zero):
    """`_merge_o_kernel`: attn the partials mid_o (B, H, S, DP) with mid_lse (B, H, S), or the
    attention output (B, H, D) (mid_lse None); w (H * head_dim, N) column-major, acc (>= B, N)
    fp32 zero on entry, zero a contiguous fp32 buffer to clear -> acc[:B] holding the o
    projection (a grid of (B * H, N / MERGE_O_BLOCK_N)). Arguments checked by
    `fused.merge_o`."""
    merged = mid_lse is not None
    B, H = attn.shape[:2]
    S, DP = (attn.shape[2], attn.shape[3]) if merged else (1, _pow2(head_dim))
    N = w.shape[1]
    bn = MERGE_O_BLOCK_N
    nc = -(-N // bn)
    zb = _pow2(-(-zero.numel() // (B * H * nc)))
    use_pdl = pdl.enabled(w.device)
    st = (0, 0, 0) if merged else attn.stride()
    args = (attn, mid_lse if merged else attn, w, acc, zero, w.stride(0), w.stride(1), *st,
            acc.stride(0), N, zero.numel(), H, head_dim, DP, S, _pow2(S), merged, nc, bn, zb,
            use_pdl)
    key = (_sig(attn), merged and _sig(mid_lse), head_dim, _sig(w), _sig(acc), _sig(zero),
           bn, use_pdl)
    _MERGE_O.launch(_MERGE_O.lookup(key), key, (B * H, nc), args, w.get_device(),
                    num_warps=4, **pdl.launch_options(use_pdl))
    return acc[:B]


_MERGE_O = CachedLaunch(_merge_o_kernel)


@triton.jit
def _gemv_merge_kernel(mid_o_ptr, mid_lse_ptr, w_ptr, out_ptr, K, N_OUT, w_sk, w_sn,
                       H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                       SPLITS: tl.constexpr, SP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BY_HAND: tl.constexpr, USE_GDC: tl.constexpr = False):
    """Program j: output columns [j*BLOCK_N, (j+1)*BLOCK_N) of y (1, N) = x @ W, where x (1,
    K = H * D) is the decode attention's output still in its split-K partials, merged here as
    `_merge_kernel` would have: head h's x[h, :] is sum_s w_s o_s / sum_s w_s, w_s =
    2**(lse2_s - max_s lse2), cast to W's dtype; mid_o (1, H, SPLITS, D), mid_lse (1, H,
    SPLITS); D a power of two (no padding), HP * D >= K: one K tile. Every program merges
    the whole row (from L2: a few KB) instead of a merge launch a layer. USE_GDC (PDL): the
    weight tile is read before the wait, the partials after it."""
    j = tl.program_id(0)
    cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cm = cols < N_OUT
    ks = tl.arange(0, HP * D)
    km = ks < K
    w = tl.load(w_ptr + cols[:, None] * w_sn + ks.to(tl.int64)[None, :] * w_sk,
                mask=cm[:, None] & km[None, :], other=0.0)                 # (BN, HP * D)
    if USE_GDC:
        gdc_wait()
    sp = tl.arange(0, SP)
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    row = h[None, :] * SPLITS + sp[:, None]                                 # (SP, HP)
    pm = (sp < SPLITS)[:, None] & (h < H)[None, :]
    lse = tl.load(mid_lse_ptr + row, mask=pm, other=float("-inf"))
    o = tl.load(mid_o_ptr + row[:, :, None] * D + d[None, None, :], mask=pm[:, :, None],
                other=0.0)                                                  # (SP, HP, D)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    wt = tl.exp2(lse - m[None, :])                                          # 0 if empty
    den = tl.sum(wt, 0)                                                     # (HP,)
    # stored as the merge kernel stores its output (a plain cast), then `_gemv_kernel`'s product
    x = (tl.sum(wt[:, :, None] * o, 0) / tl.where(den > 0, den, 1.0)[:, None]
         ).to(w_ptr.dtype.element_ty)                                       # (HP, D)
    if USE_GDC:
        gdc_launch_dependents()
    acc = _gemv_acc(tl.zeros((1, BLOCK_N), dtype=tl.float32), tl.reshape(x, (1, HP * D)), w,
                    False, False)
    tl.store(out_ptr + cols[None, :], _round(acc, out_ptr.dtype.element_ty, BY_HAND),
             mask=cm[None, :])


def gemv_merge_triton(mid_o: torch.Tensor, mid_lse: torch.Tensor, head_dim: int,
                      w: torch.Tensor) -> torch.Tensor:
    """(1, K) @ w (K, N) with x the merge of one decode query's split-K partials (mid_o (1,
    H, S, DP) and mid_lse (1, H, S) fp32, K = H * head_dim, head_dim == DP, pow2(H) * DP <=
    GEMV_MERGE_MAX_K) -> (1, N) in w's dtype. Arguments checked by `fused.gemv_merge`."""
    _, H, S, DP = mid_o.shape
    K, N = w.shape
    bn = GEMV_CONFIG["block_n"]
    use_pdl = pdl.enabled(w.device)
    out = torch.empty((1, N), dtype=w.dtype, device=w.device)
    args = (mid_o, mid_lse, w, out, K, N, w.stride(0), w.stride(1), H, _pow2(H), DP, S,
            _pow2(S), bn, not w.is_cuda, use_pdl)
    key = (_sig(mid_o), _sig(mid_lse), _sig(w), bn, GEMV_MERGE_WARPS, use_pdl)
    _GEMV_MERGE.launch(_GEMV_MERGE.lookup(key), key, (-(-N // bn), 1), args, w.get_device(),
                       num_warps=GEMV_MERGE_WARPS, **pdl.launch_options(use_pdl))
    return out


GEMV_MERGE_MAX_K = 1024      # x in one tile: SmolLM2's 576 (9 heads x 64); an 8B's 4096 is not
# 4 like the gemv's; at 16 splits the (splits, heads, head_dim) partials are 128 fp32 a thread
# at 4 warps, 64 at 8 (the bench's `_om8w` modes)
GEMV_MERGE_WARPS = 4
_GEMV_MERGE = CachedLaunch(_gemv_merge_kernel)


@triton.jit(do_not_specialize=["pos_call", "slot_call"])
def _gemv_rope_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, M, K, x_s0, r_s0, w_sk, w_sn, eps,
                      cos_ptr, c_s0, c_s1, sin_ptr, n_s0, n_s1, pos_ptr, p_s0, loc_ptr, l_s0,
                      q_ptr, kc_ptr, vc_ptr, err_ptr, pos_call, slot_call, num_pos, size_limit,
                      H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BY_HAND: tl.constexpr, CHECK: tl.constexpr,
                      ASSERT: tl.constexpr, USE_GDC: tl.constexpr = False,
                      DOT: tl.constexpr = False, IEEE: tl.constexpr = False,
                      ROW2: tl.constexpr = False, GROUPS: tl.constexpr = False):
    """`_gemv_kernel`'s add + RMSNorm + qkv product (columns [j*BLOCK_N, (j+1)*BLOCK_N) of
    the (H + 2Hkv) * D, rounded as the matmul's output), then `_rope_store_qkv_kernel`'s
    epilogue on them: pair (2i, 2i+1) of a q or k head rotated by cos/sin[pos[t], i] and
    rounded, q heads to q (T, H, D), k and v heads to row out_cache_loc[t] of the caches. The
    same values as the two kernels, one launch less a layer. BLOCK_N is even and divides D, so
    a program's columns are whole pairs of one head. Guards as rope_store_qkv's: a bad slot
    writes no cache row, a bad position rotates by row 0 (q stays defined), and program 0
    records each bad token once per kind (by its row in the call). GROUPS (more rows than
    BLOCK_M, `gemv_row_groups`; a constexpr, so one-group launches compile as before):
    program (j, g) takes rows [g * BLOCK_M, (g + 1) * BLOCK_M)."""
    j = tl.program_id(0)
    row0 = 0
    if GROUPS:
        x_ptr, r_ptr, res_ptr, q_ptr, M, row0 = _row_group(x_ptr, r_ptr, res_ptr, q_ptr, M,
                                                           x_s0, r_s0, H * D, BLOCK_M)
        pos_ptr += row0 * p_s0
        loc_ptr += row0 * l_s0
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    rm = rows < M
    NQKV: tl.constexpr = (H + 2 * HKV) * D
    cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    y = _gemv_tile(x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, M, K, NQKV, x_s0, r_s0, w_sk, w_sn,
                   eps, j, rows, cols, q_ptr.dtype.element_ty, True, HAS_RESIDUAL, False,
                   BLOCK_M, BLOCK_N, BLOCK_K, BY_HAND, USE_GDC, DOT, IEEE, ROW2)  # (BM, BN)
    pos = tl.load(pos_ptr + rows * p_s0, mask=rm, other=0).to(tl.int64)        # (BM,)
    slot = tl.load(loc_ptr + rows * l_s0, mask=rm, other=0).to(tl.int64)
    pos_ok, slot_ok = _rope_ok(pos, slot, num_pos, size_limit, CHECK)
    if ASSERT:                        # EAGLEKV_DEVICE_ASSERT=1, as rope_store_qkv
        tl.device_assert(pos_ok & slot_ok | ~rm, "gemv_rope_store: position or slot out of range")
    pos = tl.where(pos_ok, pos, 0)
    x0, x1 = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))        # (BM, BN/2) each
    c0 = j * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2).to(tl.int64)      # (BN/2,) dim 2i columns
    head = c0 // D                    # one head for the whole program (BLOCK_N divides D)
    i = (c0 % D) // 2
    c = tl.load(cos_ptr + pos[:, None] * c_s0 + i[None, :] * c_s1, mask=rm[:, None], other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * n_s0 + i[None, :] * n_s1, mask=rm[:, None], other=0.0)
    f0, f1 = x0.to(tl.float32), x1.to(tl.float32)
    rot = (head < H + HKV)[None, :]                                      # q and k heads
    y0 = _round(tl.where(rot, f0 * c - f1 * s, f0), x0.dtype, BY_HAND)   # v: exact copy
    y1 = _round(tl.where(rot, f0 * s + f1 * c, f1), x0.dtype, BY_HAND)
    is_q = (head < H)[None, :]
    kv_col = tl.where(head < H + HKV, c0 - H * D, c0 - (H + HKV) * D)[None, :]
    dst = tl.where(is_q, q_ptr + rows[:, None] * (H * D) + c0[None, :],
                   tl.where(rot, kc_ptr, vc_ptr) + slot[:, None] * (HKV * D) + kv_col)
    ok = rm[:, None] & (is_q | (slot_ok & pos_ok)[:, None])               # (BM, BN/2)
    tl.store(dst, y0, mask=ok)
    tl.store(dst + 1, y1, mask=ok)
    if CHECK:
        first = rm & (rows * 0 + j == 0)          # a full vector (the interpreter's masks)
        one = tl.full([BLOCK_M], 1, tl.int64)
        zero = tl.zeros([BLOCK_M], tl.int64)
        tl.atomic_add(err_ptr + zero, one, mask=first & ~pos_ok, sem="relaxed")
        tl.atomic_min(err_ptr + 1 + zero, (pos_call.to(tl.int64) << 32) + row0 + rows,
                      mask=first & ~pos_ok, sem="relaxed")
        tl.atomic_add(err_ptr + zero, one, mask=first & ~slot_ok, sem="relaxed")
        tl.atomic_min(err_ptr + 1 + zero, (slot_call.to(tl.int64) << 32) + row0 + rows,
                      mask=first & ~slot_ok, sem="relaxed")


def gemv_rope_store_triton(x, residual, norm_weight, eps: float, w, cos, sin, positions,
                           k_cache, v_cache, out_cache_loc, num_heads: int, num_kv_heads: int,
                           size_limit: int, layer: int | None, check):
    """`gemv_triton` (norm prologue) and `rope_store_qkv_triton` in one launch -> (q (M, H, D),
    new residual). `check(...)`: fused._check_gemv_rope's arguments, on a new signature only."""
    M, K = x.shape
    D = k_cache.shape[-1]
    bm, bn, bk, nw, dot = gemv_tiling(M, K)
    use_pdl = pdl.enabled(x.device)
    key = (_sig(x), residual is None, residual is not None and _sig(residual), _sig(norm_weight),
           _sig(w), _sig(cos), _sig(sin), _sig(positions), _sig(out_cache_loc), _sig(k_cache),
           _sig(v_cache), num_heads, num_kv_heads, size_limit, FLAGS.checks,
           FLAGS.device_assert, bm, bn, bk, nw, dot, use_pdl, GEMV_ONE_ROW_2D,
           gemv_row_groups(M, bm, dot))
    hit = _GEMV_ROPE.lookup(key)
    if hit is None:
        check(x, residual, norm_weight, w, cos, sin, positions, k_cache, v_cache, out_cache_loc,
              num_heads, num_kv_heads, size_limit, bn)
    q = torch.empty((M, num_heads, D), dtype=w.dtype, device=x.device)
    new_res = x if residual is None else torch.empty_like(residual)
    if M == 0:
        return q, new_res
    guard, pos_call, slot_call = _rope_guard_calls(x.device, cos, positions, out_cache_loc,
                                                   size_limit, layer, "gemv_rope_store")
    r = x if residual is None else residual
    n_out = (num_heads + 2 * num_kv_heads) * D
    args = (x, r, norm_weight, w, new_res, M, K, x.stride(0), r.stride(0), w.stride(0),
            w.stride(1), eps, cos, cos.stride(0), cos.stride(1), sin, sin.stride(0),
            sin.stride(1), positions, positions.stride(0), out_cache_loc,
            out_cache_loc.stride(0), q, k_cache, v_cache, guard.err, pos_call, slot_call,
            cos.shape[0], size_limit, num_heads, num_kv_heads, D, residual is not None,
            bm, bn, bk, not x.is_cuda, FLAGS.checks, FLAGS.device_assert, use_pdl, dot,
            w.dtype == torch.float32 or not x.is_cuda, GEMV_ONE_ROW_2D,
            gemv_row_groups(M, bm, dot) > 1)
    # tl.device_assert is compiled in only with debug=True
    _GEMV_ROPE.launch(hit, key, (-(-n_out // bn), gemv_row_groups(M, bm, dot)), args,
                      x.get_device(), num_warps=nw,
                      num_stages=2, debug=FLAGS.device_assert, **pdl.launch_options(use_pdl))
    guard.after_launch()
    return q, new_res


_GEMV_ROPE = CachedLaunch(_gemv_rope_kernel)


@triton.jit
def _rope_ok(pos, slot, num_pos, size_limit, CHECK: tl.constexpr):
    """(position inside the cos/sin rows, slot inside [0, size_limit)); both true where
    CHECK is off (measurement only: guard.unchecked)."""
    if CHECK:
        pos_ok = (pos >= 0) & (pos < num_pos)
        slot_ok = (slot >= 0) & (slot < size_limit)
    else:
        pos_ok = pos == pos
        slot_ok = slot == slot
    return pos_ok, slot_ok


@triton.jit(do_not_specialize=["pos_call", "slot_call"])
def _rope_store_qkv_kernel(qkv_ptr, s0, s1, s2, cos_ptr, c_s0, c_s1, sin_ptr, n_s0, n_s1,
                           pos_ptr, p_s0, loc_ptr, l_s0, q_ptr, kc_ptr, vc_ptr, err_ptr,
                           pos_call, slot_call, num_pos, size_limit, H: tl.constexpr,
                           HKV: tl.constexpr, D: tl.constexpr, HB: tl.constexpr,
                           PB: tl.constexpr, ASSERT: tl.constexpr, BY_HAND: tl.constexpr,
                           CHECK: tl.constexpr, USE_GDC: tl.constexpr = False):
    """Program (t, hb): heads [hb*HB, (hb+1)*HB) of token t, in one index space over the
    H + 2Hkv heads of qkv:

        h < H:              q head h:       rotate, store to q[t, h]
        H <= h < H+Hkv:     k head h-H:     rotate, store to k_cache[slot, h-H]
        H+Hkv <= h:         v head h-H-Hkv: copy,   store to v_cache[slot, h-H-Hkv]

    Pair i of a head is dims (2i, 2i+1): (x0, x1) -> (x0*c - x1*s, x0*s + x1*c) with
    c = cos[pos, i], s = sin[pos, i], pos = positions[t], slot = out_cache_loc[t].
    USE_GDC (PDL): every input is an earlier kernel's output, so the wait comes first."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if USE_GDC:
        gdc_wait()
    pos = tl.load(pos_ptr + t * p_s0).to(tl.int64)
    slot = tl.load(loc_ptr + t * l_s0).to(tl.int64)
    pos_ok, slot_ok = _rope_ok(pos, slot, num_pos, size_limit, CHECK)
    if ASSERT:
        tl.device_assert(pos_ok & slot_ok, "rope_store_qkv: position or slot out of range")
    pos = tl.where(pos_ok, pos, 0)    # a bad position reads row 0: q stays defined
    i = tl.arange(0, PB)                                                  # (PB,) pair index
    im = i < D // 2
    c = tl.load(cos_ptr + pos * c_s0 + i * c_s1, mask=im, other=0.0)[None, :]   # (1, PB)
    s = tl.load(sin_ptr + pos * n_s0 + i * n_s1, mask=im, other=0.0)[None, :]
    h = (hb * HB + tl.arange(0, HB))[:, None]                             # (HB, 1)
    m = (h < H + 2 * HKV) & im[None, :]                                   # (HB, PB)
    d0 = (2 * i)[None, :]                                                 # (1, PB) dim 2i
    src = qkv_ptr + t * s0 + h * s1 + d0 * s2                             # (HB, PB)
    x0 = tl.load(src, mask=m, other=0.0)
    x1 = tl.load(src + s2, mask=m, other=0.0)
    f0, f1 = x0.to(tl.float32), x1.to(tl.float32)
    rot = h < H + HKV                                                     # q and k heads
    y0 = _round(tl.where(rot, f0 * c - f1 * s, f0), x0.dtype, BY_HAND)    # v: exact copy
    y1 = _round(tl.where(rot, f0 * s + f1 * c, f1), x0.dtype, BY_HAND)
    is_q = h < H
    dst = tl.where(is_q, q_ptr + (t * H + h) * D + d0,                    # q: (T, H, D)
                   tl.where(rot, kc_ptr + (slot * HKV + (h - H)) * D + d0,
                            vc_ptr + (slot * HKV + (h - H - HKV)) * D + d0))
    # the cache rows only through a good slot (a full tile: the interpreter refuses a scalar
    # mask operand)
    good = (tl.zeros([HB, PB], dtype=tl.int32) + (slot_ok & pos_ok).to(tl.int32)) != 0
    ok = m & (is_q | good)                                                # (HB, PB)
    if USE_GDC:
        gdc_launch_dependents()
    tl.store(dst, y0, mask=ok)
    tl.store(dst + 1, y1, mask=ok)
    # the error record last: a branch on the position or slot ahead of the tile loads made
    # every load wait for those two (the checked kernel ran 1.33 us a launch against 1.14
    # unchecked on an H100, 2026-12-05; in the PTX the loads now precede every branch, as in
    # the unchecked kernel: tests/kernels/test_attention_codegen.py)
    if CHECK:
        if (hb == 0) & (~pos_ok):     # each bad token counts once, in the program of head 0
            tl.atomic_add(err_ptr, tl.full([], 1, tl.int64), sem="relaxed")
            tl.atomic_min(err_ptr + 1, (pos_call.to(tl.int64) << 32) + t, sem="relaxed")
        if (hb == 0) & (~slot_ok):
            tl.atomic_add(err_ptr, tl.full([], 1, tl.int64), sem="relaxed")
            tl.atomic_min(err_ptr + 1, (slot_call.to(tl.int64) << 32) + t, sem="relaxed")


def _rope_guard_calls(device, cos, positions, out_cache_loc, size_limit: int,
                      layer: int | None, op: str):
    """The guard of `device` and the call ids of a rope + K/V store launch: its positions
    (against the cos/sin rows) and its slots (against size_limit)."""
    guard = kv_guard(device)
    pos_call = guard.register("rope_store_qkv positions", cos.shape[0], positions, layer,
                              dense=True)
    slot_call = guard.register("store_cache", size_limit, out_cache_loc, layer, dense=True)
    if slot_call > MAX_CALL_ID:
        raise RuntimeError(f"{op}: {slot_call} guarded calls in one step without a check")
    return guard, pos_call, slot_call


def rope_store_qkv_triton(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc,
                          num_heads: int, num_kv_heads: int, size_limit: int,
                          layer: int | None, check):
    """`check(...)` (fused._check_rope_store's arguments): run on a new signature only."""
    use_pdl = pdl.enabled(qkv.device)
    key = (_sig(qkv), _sig(cos), _sig(sin), _sig(positions), _sig(out_cache_loc), _sig(k_cache),
           _sig(v_cache), num_heads, num_kv_heads, size_limit, FLAGS.device_assert, FLAGS.checks,
           use_pdl)
    hit = _ROPE_STORE_QKV.lookup(key)
    if hit is None:
        check(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc, num_heads,
              num_kv_heads, size_limit)
    T, _, D = qkv.shape
    q = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    guard, pos_call, slot_call = _rope_guard_calls(qkv.device, cos, positions, out_cache_loc,
                                                   size_limit, layer, "rope_store_qkv")
    pb = _pow2(D // 2)
    nh = num_heads + 2 * num_kv_heads
    hb = rope_heads_per_program(nh, pb, T)
    args = (qkv, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos, cos.stride(0), cos.stride(1),
            sin, sin.stride(0), sin.stride(1), positions, positions.stride(0), out_cache_loc,
            out_cache_loc.stride(0), q, k_cache, v_cache, guard.err, pos_call, slot_call,
            cos.shape[0], size_limit, num_heads, num_kv_heads, D, hb, pb, FLAGS.device_assert,
            not qkv.is_cuda, FLAGS.checks, use_pdl)
    # tl.device_assert is compiled in only with debug=True
    _ROPE_STORE_QKV.launch(hit, key, (T, -(-nh // hb)), args, qkv.get_device(),
                           debug=FLAGS.device_assert, **pdl.launch_options(use_pdl))
    guard.after_launch()
    return q


_ROPE_STORE_QKV = CachedLaunch(_rope_store_qkv_kernel)


def rope_heads_per_program(nh: int, pb: int, T: int) -> int:
    """Heads a rope_store_qkv program (a constant of the compiled kernel): at most ROPE_TILE
    elements, and at least ROPE_MIN_PROGRAMS programs where the tokens are few (one program
    for the 8B shape's 48 heads at batch 1 took 8.5 us). T counts as the power of two at or
    above it, as the graphs' buckets do: an eager forward of an odd size (an adaptive step's
    plain part) takes a class a captured bucket compiled."""
    return max(1, min(_pow2(nh), ROPE_TILE // pb,
                      _pow2(max(1, nh * _pow2(T) // ROPE_MIN_PROGRAMS))))
