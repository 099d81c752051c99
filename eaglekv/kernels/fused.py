"""Fused glue ops of a Llama decoder layer, each with its PyTorch reference (the CPU path).

    add_rms_norm:   s = x + residual (rounded to the dtype, as `residual + x` does),
                    normed = s * rsqrt(mean(s^2) + eps) * w   (fp32, rounded once)
    silu_and_mul:   gate_up = [gate | up] (T, 2I) -> silu(gate) * up = gate * sigmoid(gate) * up
    rope_store_qkv: qkv (T, H + 2Hkv, D) = [q heads | k heads | v heads], q/k in the interleaved
                    pair layout (dims 2i, 2i+1 form pair i, see model/rope.py); with
                    c, s = cos[pos], sin[pos]: (x0, x1) -> (x0*c - x1*s, x0*s + x1*c) on q and k;
                    q is returned, rotated k and plain v go to row out_cache_loc[t] of the caches.

Every public function runs the Triton kernel (`fused_triton.py`) on CUDA tensors, or on CPU
under TRITON_INTERPRET=1 with EAGLEKV_TRITON_ON_CPU=1 (`store_cache.use_triton`); otherwise the
reference (`*_torch`). The host checks read shapes, dtypes and devices only (no device read),
so every launch can be captured in a CUDA graph. Guards (rope_store_qkv): the CPU path raises
`KVIndexError` before writing anything; the Triton path never writes through a bad slot or
reads through a bad position, records the error in the buffer of `eaglekv.kernels.guard`, and
still returns q for every token (rotated by position 0 where the position is bad).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from eaglekv.errors import KVIndexError
from eaglekv.kernels.guard import check_indices
from eaglekv.kernels.store_cache import store_cache_torch, use_triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

_TRITON_IMPL = None


def _triton_impl():
    """The Triton module, imported on first use (CPU-only installs never import Triton)."""
    global _TRITON_IMPL
    if _TRITON_IMPL is None:
        from eaglekv.kernels import fused_triton
        _TRITON_IMPL = fused_triton
    return _TRITON_IMPL


def _expect(op: str, name: str, x: torch.Tensor, shape: tuple, dtypes: tuple, device) -> None:
    """ValueError / TypeError naming `name` unless x has `shape` (None: any size there), a dtype
    in `dtypes` and sits on `device`."""
    if x.dim() != len(shape) or any(w is not None and s != w for s, w in zip(x.shape, shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{op}: {name} has shape {tuple(x.shape)}, expected {want}")
    if x.dtype not in dtypes:
        raise TypeError(f"{op}: {name} dtype {x.dtype}, expected "
                        + " or ".join(str(d) for d in dtypes))
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device}, the other inputs on {device}")


# ---------------------------------------------------------------------------- add_rms_norm

def _check_add_rms_norm(x, residual, weight) -> None:
    op = "add_rms_norm"
    if x.dim() != 2:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}, expected (T, H)")
    _expect(op, "x", x, (None, None), FLOAT_DTYPES, x.device)
    if residual is not None:
        _expect(op, "residual", residual, tuple(x.shape), (x.dtype,), x.device)
    _expect(op, "weight", weight, (x.shape[1],), (x.dtype,), x.device)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the model's `residual = x if residual is None else residual + x` (the add
    rounds to the dtype) then `F.rms_norm(residual, w, eps)`."""
    _check_add_rms_norm(x, residual, weight)
    return _add_rms_norm_ops(x, residual, weight, eps)


def _add_rms_norm_ops(x, residual, weight, eps):
    new_residual = x if residual is None else residual + x                  # (T, H)
    return F.rms_norm(new_residual, weight.shape, weight, eps), new_residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, checked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: (T, H) (residual None: a plain RMSNorm, new_residual is x itself); weight
    (H,). Returns (normed, new_residual), both (T, H) in the residual's dtype (x's without
    one). x may be fp32 beside a residual of another dtype (the fused kernels' accumulator):
    the sum is rounded to the residual's dtype once. Triton: H <= 8192
    (`fused_triton.MAX_HIDDEN`), any strides. `checked=False` skips the argument checks of
    the torch path (the model's hot path on CPU, whose shapes hold by construction)."""
    mixed = residual is not None and x.dtype != residual.dtype
    if not use_triton(x):
        if mixed:
            return _add_rms_norm_ops((x + residual.float()).to(residual.dtype), None, weight,
                                     eps)
        if not checked:
            return _add_rms_norm_ops(x, residual, weight, eps)
        return add_rms_norm_torch(x, residual, weight, eps)
    return _triton_impl().add_rms_norm_triton(x, residual, weight, float(eps),
                                              _check_mixed_add_rms_norm if mixed
                                              else _check_add_rms_norm)


def _check_mixed_add_rms_norm(x, residual, weight) -> None:
    """An fp32 x (the fused kernels' accumulator) beside a residual of the model's dtype."""
    _expect("add_rms_norm", "x", x, tuple(residual.shape), (torch.float32,), residual.device)
    _check_add_rms_norm(residual, residual, weight)


# ---------------------------------------------------------------------------- silu_and_mul

def _check_silu_and_mul(gate_up) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: gate_up has shape {tuple(gate_up.shape)}, expected "
                         f"(T, 2I)")
    _expect("silu_and_mul", "gate_up", gate_up, (None, None), FLOAT_DTYPES, gate_up.device)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: `F.silu(gate) * up` in the tensor dtype (two roundings)."""
    _check_silu_and_mul(gate_up)
    return _silu_and_mul_ops(gate_up)


def _silu_and_mul_ops(gate_up):
    gate, up = gate_up.chunk(2, -1)                                         # (T, I) each
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, *, checked: bool = True) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> silu(gate) * up (T, I); Triton computes in fp32 and
    rounds once. `checked=False`: as in `add_rms_norm`."""
    if not use_triton(gate_up):
        return silu_and_mul_torch(gate_up) if checked else _silu_and_mul_ops(gate_up)
    return _triton_impl().silu_and_mul_triton(gate_up, _check_silu_and_mul)


# ----------------------------------------------------------------------------- norm_matmul

NORM_MATMUL_MAX_ROWS = 64    # decode, draft and small verify batches; larger ones: cuBLAS
# Off by default: measured on the H200 (bench/results/gpu_bench_h200_norm_matmul.json) the
# one kernel is slower than the cuBLAS matmul beside the two small Triton kernels it replaces
# (SmolLM2 batch 1: 229 kernels a step instead of 319, but 1.01 ms of device time instead of
# 0.85; Llama-8B shape 6.83 ms a step instead of 5.24): its grid has too few programs at
# M <= 64 to stream the weights at full bandwidth. EAGLEKV_FUSE_NORM_MATMUL=1 turns it on.
FUSE_NORM_MATMUL = os.environ.get("EAGLEKV_FUSE_NORM_MATMUL") == "1"


def _check_norm_matmul(x, residual, norm_weight, w, silu_mul) -> None:
    _check_add_rms_norm(x, residual, norm_weight)
    op = "norm_matmul"
    _expect(op, "w", w, (x.shape[1], None), (x.dtype,), x.device)
    if silu_mul and w.shape[1] % 2:
        raise ValueError(f"{op}: w has shape {tuple(w.shape)}, expected (K, 2I) for silu_mul")
    for name, t in (("x", x), ("residual", residual), ("w", w)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along its last dimension")


def norm_matmul_torch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, w: torch.Tensor, *, silu_mul: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `add_rms_norm`, then `h @ w`, then (silu_mul) `silu_and_mul`."""
    _check_norm_matmul(x, residual, norm_weight, w, silu_mul)
    return _norm_matmul_ops(x, residual, norm_weight, eps, w, silu_mul)


def _norm_matmul_ops(x, residual, norm_weight, eps, w, silu_mul):
    h, new_residual = _add_rms_norm_ops(x, residual, norm_weight, eps)
    y = h @ w
    return (_silu_and_mul_ops(y) if silu_mul else y), new_residual


def norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, w: torch.Tensor, *, silu_mul: bool = False, matmul=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm -> matmul (-> silu_and_mul) in one kernel: the first matmul of a decoder
    layer's attention (`w` = qkv) and of its MLP (`w` = [gate | up], silu_mul). x, residual
    (M, K); norm_weight (K,); w (K, N) -> (y (M, N), or (M, N/2) with silu_mul; new residual
    (M, K)). With FUSE_NORM_MATMUL (off by default: slower than cuBLAS on the H200, see
    there) the Triton kernel takes M <= NORM_MATMUL_MAX_ROWS (a decode-sized batch: three
    launches become one); otherwise the separate ops run, the matmul through `matmul(h, w)`
    (default `h @ w`)."""
    if use_gemv(x, w, fused=True):
        return _triton_impl().gemv_triton(x, residual, norm_weight, float(eps), w, silu_mul,
                                          _check_gemv)
    mixed = residual is not None and x.dtype != residual.dtype   # the fused kernels' fp32 x
    if mixed and not use_triton(x):
        x, residual, mixed = (x + residual.float()).to(residual.dtype), None, False
    if (FUSE_NORM_MATMUL and use_triton(x) and not mixed
            and x.shape[0] <= NORM_MATMUL_MAX_ROWS and w.stride(-1) == 1):
        return _triton_impl().norm_matmul_triton(x, residual, norm_weight, float(eps), w,
                                                 silu_mul, _check_norm_matmul)
    h, new_residual = add_rms_norm(x, residual, norm_weight, eps, checked=False)
    y = h @ w if matmul is None else matmul(h, w)
    return (silu_and_mul(y, checked=False) if silu_mul else y), new_residual


# ------------------------------------------------------------------------------------ gemv

GEMV_MAX_ROWS = 4            # decode-sized batches; from 8 rows on cuBLAS's tiles win
# 5-16 rows (a verify window at batch 1: S5's 6 tokens, a tree's 8 or 16; decode batches of 5-16)
# go to the kernel's tensor-core tile (fused_triton.gemv_tiling) when GEMV_DOT_MAX_ROWS allows:
# then a verify layer is Triton to Triton like the decode's (qkv + norm + RoPE + store, o,
# gate_up + norm + SiLU*mul, down: four launches where cuBLAS and its glue are eight).
# Off by default (EAGLEKV_GEMV_DOT=1 on; the bench's `_dot` / `_nodot` modes compare): measured
# on an H100 on 2026-12-06 (bench/results/explore_gemvdot_h100_20261206.json, at its best tiling
# 32 / 256 / 4) the tile runs SmolLM2's matmuls at 6 rows in 6.1 / 5.7 / 7.8 / 10.2 us (qkv with
# the norm, o, gate_up with norm and SiLU, down) where cuBLAS with its glue kernels takes 5.4 /
# 3.6 / 7.6 / 5.0: its 16-column blocks give o and down 36 programs for 132 SMs. In the engine
# (gpu_bench_h100_20261206_gemv_dot.json, one process, end to end) S5 at batch 1 ran 0.97x
# the shipped engine (1.02x with the extend attention under PDL too, `_dot_xpdl`), plain at 4
# and 16 rows 0.94x / 0.94x, the S4/K2/N8 tree at batch 1 0.95x.
GEMV_DOT_MAX_ROWS = 0 if os.environ.get("EAGLEKV_GEMV_DOT", "0") == "0" else 16
# 5 to GEMV_GROUP_MAX_ROWS rows (a verify window at batch 1: S5's 6, S7's 8) in the kernel's
# 4-row register tile, in row groups (a second grid dimension: each weight slice read by two
# programs, the second mostly from L2) instead of the tensor-core tile above, which lost to
# cuBLAS at 6 rows; with the MLP (`FUSE_MLP_MAX_ROWS`) and merge + o (`MERGE_O_MAX_ROWS`) up
# to 8 rows too, a verify layer of S7 at batch 1 is four launches like the decode's (qkv +
# norm + RoPE + store, attention, merge + o, the MLP) where it is ten. Built 2026-12-07
# without a GPU; timed the same day on an H100 (random SmolLM2-shaped model and EAGLE-3 head,
# one process, bench/results/gpu_bench_h100_20261207c_verify_draft_rnd.json): S7 at batch 1
# 638.7 steps/s against 611.7 with the three 8-row settings (1.044x; 1500 kernels a profiled
# window against 2200), 659.4 with the draft's gemv layer too (1.078x); batch 4 unchanged
# (2251 / 2263 against 2260). On by default since (8; EAGLEKV_GEMV_GROUP_ROWS=0: off, the
# bench's `_nog8`). Not timed: plain decoding at batch 5-8, which these rows take too.
# Read at each forward (graphs capture it).
GEMV_GROUP_MAX_ROWS = int(os.environ.get("EAGLEKV_GEMV_GROUP_ROWS", "8"))
# On by default on CUDA since 2026-12-05 for the matmuls it carries glue with: at the tiling of
# `fused_triton.GEMV_CONFIG` the kernel with the add + RMSNorm prologue runs SmolLM2's qkv in
# 3.3 us where cuBLAS and the separate norm kernel take 5.4, gate_up with SiLU*mul 4.8 against
# 7.5 (M = 1, H100, bench/results/explore_gemv_fused_h100_20261205.json), three launches a layer
# fewer; plain decoding at batch 1 / 2 / 4 ran 1.25x / 1.15x / 1.05x the cuBLAS graphs
# (1234 against 988 tok/s, gpu_bench_h100_20261205b_gemv_small_batches.json, every matmul of
# a layer in the kernel then). A bare matmul (o, down, lm_head) stays with cuBLAS by default:
# alone the kernel only ties it (o 3.46 / 3.55 us) or loses (down 5.64 / 5.15, the 8B's down
# 47.2 / 44.2, lm_head 23.6 / 22.8; explore_gemv2_h100_20261205.json). Before this tiling
# (8 rows a program, K in 256-wide blocks) the kernel was slower than cuBLAS everywhere
# (958 -> 782 tok/s on the H200) and shipped off.
# With programmatic dependent launch (kernels/pdl.py, sm_90+) the bare ones go to the kernel
# too: it then loads its first weight tile while the kernel before it still runs, and a layer
# has no cuBLAS launch left to break the chain of early launches (plain at batch 1: 1447 tok/s
# against 1197 with cuBLAS for the bare matmuls, H100, gpu_bench_h100_20261205d_next.json).
# None (the default): the fused matmuls on CUDA, and every decode-sized one where PDL is on;
# EAGLEKV_GEMV=0: off (False); =1: every decode-sized matmul wherever Triton runs (True: the
# CPU interpreter in tests, and the bench's `*_gemv` modes). Read when a model is built (the
# weights' layout) and when graphs capture.
FUSE_GEMV: bool | None = {"0": False, "1": True}.get(os.environ.get("EAGLEKV_GEMV", ""))


# A draft model's one layer in the gemv layout too (`llama.gemv_layout`): its one-token draft
# forwards (batch 1 chains: each draft step) then take the gemv kernel and its norm prologue /
# SiLU epilogue, as the target's decode does, instead of cuBLAS with separate add + RMSNorm and
# SiLU*mul launches (an H100, 2026-12-07, S7 at batch 1: the draft's 7 forwards a step ran
# 4 cuBLAS matmuls of ~3.7 us and 2 more launches each). Timed on an H100 on 2026-12-07
# (random model and head, gpu_bench_h100_20261207c_verify_draft_rnd.json): the draft phase of
# an S7 step 0.885 -> 0.546 ms; S7 at batch 1 1.026x, S3 1.013x, batch 4 1.003x / 1.004x.
# On by default since (EAGLEKV_DRAFT_GEMV=0: off, the bench's `_nodgemv`). Read when a
# draft model is built, on CUDA.
DRAFT_GEMV = os.environ.get("EAGLEKV_DRAFT_GEMV", "1") == "1"


def gemv_on(device: torch.device, fused: bool = True) -> bool:
    """Whether decode-sized matmuls on `device` go to the gemv kernel (see FUSE_GEMV):
    `fused`, one that carries the norm prologue (qkv, gate_up); else a bare matmul (by
    default only where programmatic dependent launch is on)."""
    if FUSE_GEMV is not None:
        return FUSE_GEMV
    if device.type != "cuda":
        return False
    from eaglekv.kernels import pdl        # imports Triton: not on the CPU path
    return fused or pdl.enabled(device)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same (K, N) matrix stored as the transpose of an (N, K) row-major weight
    (nn.Linear's layout): `gemv` then streams whole weight rows, and `x @ w` is cuBLAS's
    transposed operand (measured on the H200 at the speed of the (K, N) layout, M = 1-64)."""
    return w.t().contiguous().t()


# Matmuls of 2-4 rows take the gemv kernel only below this K (None: at any K). Its 2-4-row
# register tile (4 weight rows x 1024 of K x the rows: 128 registers a thread at 4 rows, 205
# with SiLU*mul, bench/gemv_regs.py) keeps 2-4 programs on an SM, and at the Llama-3.1-8B
# shape's K (4096, 14336) a 4-token verify cost 2.02 decode steps on the H200 and 1.34-1.53 on
# the H100 where 8 tokens, through cuBLAS, cost 1.11 and 1.03-1.07 (`--llama8b`'s
# verify_vs_decode, 2026-12-04..06). So from K = 4096 cuBLAS takes them (chosen from those
# figures; the 4-row cuBLAS time itself is the bench's `verify4_variants_vs_decode`, not yet
# run). SmolLM2's K (576, 1536) keeps the kernel. EAGLEKV_GEMV_ROWS_MAX_K=0: no bound.
GEMV_ROWS_MAX_K: int | None = (int(os.environ.get("EAGLEKV_GEMV_ROWS_MAX_K", "4096"))
                               or None)


# Weights of more bytes than these go to cuBLAS (None: no bound, the default): every matmul
# (GEMV_MAX_WEIGHT_BYTES; the fused ones then run cuBLAS with the separate add + RMSNorm and
# SiLU*mul kernels) or only the bare ones, o and down (GEMV_BARE_MAX_WEIGHT_BYTES). Why: on
# the H200 the Llama-3.1-8B shape's step streamed its layers' 14 GB through the gemv kernel
# at 3.3 TB/s (75% of the roofline, 2026-12-06) where cuBLAS alone ran its gate_up and down
# at 3.7-4.1 TB/s (explore_matmul_layout_h200.json); SmolLM2's weights (at most 3.5 MB) are
# latency bound, where the kernel's PDL chain wins. The bench's `--llama8b` variants
# `bare_cublas` / `all_cublas` measure them; EAGLEKV_GEMV_MAX_WEIGHT_BYTES /
# EAGLEKV_GEMV_BARE_MAX_WEIGHT_BYTES set them (read at import; graphs capture the choice).
GEMV_MAX_WEIGHT_BYTES: int | None = (
    int(os.environ.get("EAGLEKV_GEMV_MAX_WEIGHT_BYTES", "0")) or None)
GEMV_BARE_MAX_WEIGHT_BYTES: int | None = (
    int(os.environ.get("EAGLEKV_GEMV_BARE_MAX_WEIGHT_BYTES", "0")) or None)


def _weight_fits(w: torch.Tensor, fused: bool) -> bool:
    """w is within the gemv kernel's weight bounds (GEMV_MAX_WEIGHT_BYTES, and
    GEMV_BARE_MAX_WEIGHT_BYTES for a bare matmul)."""
    nbytes = w.numel() * w.element_size()
    bounds = (GEMV_MAX_WEIGHT_BYTES,) if fused else (GEMV_MAX_WEIGHT_BYTES,
                                                     GEMV_BARE_MAX_WEIGHT_BYTES)
    return all(b is None or nbytes <= b for b in bounds)


def gemv_max_rows() -> int:
    """The most rows a matmul may have for the gemv kernel to take it: its register tile
    (GEMV_MAX_ROWS), the row groups of that tile (GEMV_GROUP_MAX_ROWS, 8 by default) or the
    tensor-core tile (GEMV_DOT_MAX_ROWS, off by default)."""
    return max(GEMV_MAX_ROWS, GEMV_DOT_MAX_ROWS, GEMV_GROUP_MAX_ROWS)


def use_gemv(x: torch.Tensor, w: torch.Tensor, fused: bool = False) -> bool:
    """The gemv kernel takes this matmul: on for it (`gemv_on`; `fused`: with the norm
    prologue), a decode-sized x (M <= `gemv_max_rows()`; 2 rows or more only where K <
    GEMV_ROWS_MAX_K) on a Triton device, a column-major w (see `column_major`) within the
    weight bounds (`_weight_fits`)."""
    return (gemv_on(x.device, fused) and x.dim() == 2
            and 0 < x.shape[0] <= gemv_max_rows()
            and (x.shape[0] == 1 or GEMV_ROWS_MAX_K is None or x.shape[1] < GEMV_ROWS_MAX_K)
            and w.dim() == 2 and w.stride(0) == 1 and w.shape[1] > 1 and use_triton(x)
            and _weight_fits(w, fused))


def _check_gemv(x, residual, norm_weight, w, silu_mul) -> None:
    op = "gemv"
    dt = x.dtype
    if norm_weight is not None and residual is not None and x.dtype == torch.float32:
        # the fused MLP's fp32 accumulator as x beside a residual of the model's dtype
        _expect(op, "x", x, tuple(residual.shape), (torch.float32,), residual.device)
        dt = residual.dtype
        _check_add_rms_norm(residual, residual, norm_weight)
    elif norm_weight is not None:
        _check_add_rms_norm(x, residual, norm_weight)
    _expect(op, "x", x, (None, None), FLOAT_DTYPES, x.device)
    _expect(op, "w", w, (x.shape[1], None), (dt,), x.device)
    if silu_mul and w.shape[1] % 2:
        raise ValueError(f"{op}: w has shape {tuple(w.shape)}, expected (K, 2I) for silu_mul")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError(f"{op}: x and residual must be contiguous along their last dimension")
    if x.shape[0] > 16:
        raise ValueError(f"{op}: x has {x.shape[0]} rows; the kernel takes at most 16")


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (K, N) by the matrix-vector kernel (M <= 16; fast for a column-major w);
    the reference is `x @ w`."""
    if not use_triton(x):
        return x @ w
    return _triton_impl().gemv_triton(x, None, None, 0.0, w, False, _check_gemv)[0]


# ------------------------------------------------------------------------------- fused_mlp

# A decoder layer's MLP (add + RMSNorm + gate/up + SiLU*mul + down) as one launch
# (`fused_triton._mlp_kernel`) for a one-row forward (M <= FUSE_MLP_MAX_ROWS): each program
# takes a slice of the intermediate dimension and adds its part of down's product to an fp32
# accumulator with atomics, which the next layer's add + RMSNorm reads as its x. Why: plain
# decoding at batch 1 on the H200 ran ~190 launches a token of ~3 us each (542 us of device
# time a token, 2026-12-06), where the layer's weights stream in ~2 us; gate_up and down were
# two of the six launches a layer. Measured on an H100 on 2026-12-07 (a random SmolLM2-shaped
# model, one process, `bench/h200_issue13.sh rnd`; gpu_bench_h100_20261207_fused_*.json): with
# the merge + o launch below, plain decoding at batch 1 ran 1.17x (2074 / 2087 tok/s against
# 1769 / 1784 in two processes, 2058 against 1753 in a third); alone 1.11x at one row but
# 0.96x at four (its 4-row tile), so for one row only (EAGLEKV_FUSE_MLP_MAX_ROWS=4 takes up
# to four). **On by default** since 2026-12-07 (twenty-second session; EAGLEKV_FUSE_MLP=0
# turns it off): with both fusions on, the GPU suite's speculative, graph, fault and fusion
# files passed on an H100 (166 tests; the 5 spec failures of the session before were a test
# helper's stale copy of down), and plain batch 1 ran 1.18x (2080 against 1767 tok/s, random
# model, gpu_bench_h100_20261207b_fused_rnd.json; 2073 against 1759 on the real weights,
# gpu_bench_h100_20261207b_fused_default.json). The atomics' order varies, so fp32 sums are
# not bit-stable from run to run (as cuBLAS's split-K is not). Read when a model is built
# (it keeps down by rows and the accumulators) and at each forward.
FUSE_MLP = os.environ.get("EAGLEKV_FUSE_MLP", "1") == "1"
FUSE_MLP_MAX_ROWS = int(os.environ.get("EAGLEKV_FUSE_MLP_MAX_ROWS", "8"))
# (FUSE_MLP_MAX_ROWS: forwards of at most this many tokens take it; 8 by default since
# 2026-12-07 with GEMV_GROUP_MAX_ROWS above, whose figures they are; =1 as before: the
# bench's `_mlp1`.) The fused MLP kernel's rows: a register tile of 4
# (fused_triton.MLP_ROW_GROUP), 5-8 rows in two row groups of programs over the same weight
# slices (a verify of S5 / S7 at batch 1)
MLP_KERNEL_MAX_ROWS = 8
MLP_MAX_ROWS = 8                    # rows of the accumulators (merge + o takes up to 8)
MLP_MAX_WEIGHT_BYTES = 16 << 20     # gate_up + down; larger MLPs stream at the bandwidth


def use_fused_mlp(x: torch.Tensor, w: torch.Tensor, wd: torch.Tensor | None) -> bool:
    """The fused MLP takes this forward's MLP: on (FUSE_MLP), the model prepared for it (`wd`,
    down by rows, not None), a decode-sized x (M <= FUSE_MLP_MAX_ROWS <= MLP_MAX_ROWS),
    gate_up a fused gemv matmul (`use_gemv`), the hidden size in one tile and the weights
    small enough."""
    return (FUSE_MLP and wd is not None and x.dim() == 2
            and 0 < x.shape[0] <= min(FUSE_MLP_MAX_ROWS, MLP_KERNEL_MAX_ROWS)
            and use_gemv(x[:1], w, fused=True)          # (w's layout and bounds: any rows)
            and x.shape[1] <= _triton_impl().MLP_MAX_HIDDEN
            and (w.numel() + wd.numel()) * w.element_size() <= MLP_MAX_WEIGHT_BYTES)


def _check_fused_mlp(x, residual, norm_weight, w, wd, acc, zero) -> None:
    op = "fused_mlp"
    _check_gemv(x, residual, norm_weight, w, True)
    M, K = x.shape
    I = w.shape[1] // 2
    _expect(op, "wd", wd, (I, K), (w.dtype,), x.device)
    _expect(op, "acc", acc, (None, K), (torch.float32,), x.device)
    _expect(op, "zero", zero, (None, K), (torch.float32,), x.device)
    if M > MLP_KERNEL_MAX_ROWS or acc.shape[0] < M:
        raise ValueError(f"{op}: x has {M} rows; at most "
                         f"{min(MLP_KERNEL_MAX_ROWS, acc.shape[0])} (the kernel's tile, the "
                         f"accumulator's rows)")
    if not (acc.is_contiguous() and zero.is_contiguous()):
        raise ValueError(f"{op}: acc and zero must be contiguous")
    if acc.data_ptr() == zero.data_ptr():
        raise ValueError(f"{op}: acc and zero are the same buffer")


def fused_mlp_torch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, w: torch.Tensor, wd: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `norm_matmul(..., silu_mul=True)` (x rounded to the residual's dtype first
    when it is the fp32 accumulator), then `act @ wd` summed in fp32 -> (fp32 (M, K), new
    residual)."""
    if residual is not None and x.dtype != residual.dtype:
        x, residual = (x + residual.float()).to(residual.dtype), None     # s = round(x + r)
    act, new_residual = _norm_matmul_ops(x, residual, norm_weight, eps, w, True)
    return act.float() @ wd.float(), new_residual


def fused_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, w: torch.Tensor, wd: torch.Tensor, acc: torch.Tensor,
              zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """add + RMSNorm + x @ [gate | up] + SiLU*mul + @ down in one launch (`use_fused_mlp`
    said so): x (M, K) (fp32: the previous layer's accumulator), residual (M, K), w (K, 2I)
    column-major, wd (I, K) contiguous (down by rows); acc (>= M, K) fp32, zero on entry, gets
    the sum; zero (any rows, K) fp32 is cleared (the next layer's accumulator) -> (acc[:M],
    new residual). Off the Triton path: the reference's values written into acc."""
    if not use_triton(x):
        y, new_residual = fused_mlp_torch(x, residual, norm_weight, eps, w, wd)
        acc[:x.shape[0]] += y
        zero.zero_()
        return acc[:x.shape[0]], new_residual
    _check_fused_mlp(x, residual, norm_weight, w, wd, acc, zero)
    return _triton_impl().mlp_triton(x, residual, norm_weight, float(eps), w, wd, acc, zero)


# --------------------------------------------------------------------------------- merge_o

# The decode attention's split-K merge and the o projection in one launch
# (`fused_triton._merge_o_kernel`) for decode forwards of at most MLP_MAX_ROWS rows: one
# program a (row, head, block of 64 output columns) merges its head's partials (a few KB from
# L2), multiplies by that head's rows of o and adds into an fp32 accumulator by atomics: the
# merge launch and the o launch (1.3 + 3.1 us a layer at batch 1 on the H200, 2026-12-06)
# become one. Unlike `gemv_merge` (each of o's ~144 programs merged every head: 0.81x on the
# H200), each head is merged by the 9 programs that use it. Measured on an H100 on 2026-12-07
# (as FUSE_MLP above): plain decoding 1.04x / 1.03x at batch 1 / 4 alone, 1.17x / 1.02x with
# the fused MLP. On by default with FUSE_MLP (EAGLEKV_MERGE_O=0 turns it off). Read when a
# model is built (the accumulators) and at each forward (graphs capture it).
MERGE_O = os.environ.get("EAGLEKV_MERGE_O", "1") == "1"
# forwards of at most this many tokens (<= MLP_MAX_ROWS); 8 takes S5 / S7 verifies at batch 1
# too, whose gate_up (cuBLAS from 5 rows) then follows the Triton add + RMSNorm of the fp32
# x (built 2026-12-07 without a GPU; 8 by default since the same day's timing, with
# GEMV_GROUP_MAX_ROWS above; EAGLEKV_MERGE_O_MAX_ROWS=4 as before: the bench's `_mo4`)
MERGE_O_MAX_ROWS = int(os.environ.get("EAGLEKV_MERGE_O_MAX_ROWS", "8"))
MERGE_O_MAX_WEIGHT_BYTES = 8 << 20   # o of SmolLM2 is 0.66 MB; an 8B's 32 MB streams as it is


def use_merge_o(x: torch.Tensor, w: torch.Tensor, num_heads: int, acc) -> bool:
    """A forward of x (T <= MERGE_O_MAX_ROWS <= MLP_MAX_ROWS rows) hands its attention
    to `merge_o`: on (MERGE_O), the model prepared (`acc` not None), w (K = num_heads *
    head_dim, N) a bare gemv matmul (`use_gemv`) of at most MERGE_O_MAX_WEIGHT_BYTES with a
    head_dim of at most 256."""
    return (MERGE_O and acc is not None and x.dim() == 2
            and 0 < x.shape[0] <= min(MERGE_O_MAX_ROWS, MLP_MAX_ROWS)
            and w.shape[0] % num_heads == 0 and w.shape[0] // num_heads <= 256
            and w.numel() * w.element_size() <= MERGE_O_MAX_WEIGHT_BYTES
            and use_gemv(x.new_empty((1, w.shape[0])), w))       # (w's layout and bounds)


def accumulated_rows() -> int:
    """The most tokens a forward may have for a fusion to add into the accumulators (0:
    both off): a model clears its first accumulators only for such forwards."""
    return max(min(FUSE_MLP_MAX_ROWS, MLP_KERNEL_MAX_ROWS) if FUSE_MLP else 0,
               min(MERGE_O_MAX_ROWS, MLP_MAX_ROWS) if MERGE_O else 0)


def merge_o_torch(attn: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: attn (T, H, D) in w's dtype, flattened, @ w summed in fp32 -> (T, N) fp32."""
    return attn.reshape(attn.shape[0], -1).to(w.dtype).float() @ w.float()


def merge_o(attn, w: torch.Tensor, acc: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """attn: the decode attention's output (T, H, D), or its partials
    (`attention.DecodePartials`) -> acc[:T] += attn (T, H * D) @ w (fp32; acc zero on entry
    gives the o projection), and `zero` (the next layer's accumulator) cleared, in one launch
    on the Triton path (see MERGE_O); off it the merged attention through the reference."""
    partials = not isinstance(attn, torch.Tensor)
    T, H = (attn.mid_o.shape[:2] if partials else attn.shape[:2])
    D = attn.head_dim if partials else attn.shape[2]
    op = "merge_o"
    if H * D != w.shape[0]:
        raise ValueError(f"{op}: attention of {H} heads x {D} does not match w "
                         f"{tuple(w.shape)}")
    _expect(op, "acc", acc, (None, w.shape[1]), (torch.float32,), w.device)
    _expect(op, "zero", zero, (None, w.shape[1]), (torch.float32,), w.device)
    if acc.shape[0] < T or not (acc.is_contiguous() and zero.is_contiguous()):
        raise ValueError(f"{op}: acc of {acc.shape[0]} rows for {T} (contiguous, as zero)")
    if acc.data_ptr() == zero.data_ptr():
        raise ValueError(f"{op}: acc and zero are the same buffer")
    if not use_triton(w):
        out = attn.finish() if partials else attn
        acc[:T] += merge_o_torch(out, w)
        zero.zero_()
        return acc[:T]
    if partials:
        return _triton_impl().merge_o_triton(attn.mid_o, attn.mid_lse, D, w, acc, zero)
    if attn.stride(-1) != 1 and D > 1:
        attn = attn.contiguous()
    return _triton_impl().merge_o_triton(attn, None, D, w, acc, zero)


# ------------------------------------------------------------------------------ gemv_merge

# The split-K decode attention's merge inside the o projection (`fused_triton.
# _gemv_merge_kernel`): at batch 1 every o-proj program merges the row's partials (9 heads x
# 16 splits x 64 fp32 for SmolLM2, ~37 KB from L2) after its weight tile is loaded, where the
# separate merge kernel was a launch a layer (1.3 us of the ~17 us a layer, 40 us of 542 a
# token on the H200, 2026-12-06). Built 2026-12-07 on the CPU (interpreter); off until measured
# on a GPU (EAGLEKV_GEMV_MERGE=1 or the bench's `*_omerge` modes turn it on). Read at each
# forward (graphs capture it).
GEMV_MERGE = os.environ.get("EAGLEKV_GEMV_MERGE", "0") == "1"


def use_gemv_merge(x: torch.Tensor, w: torch.Tensor, num_heads: int) -> bool:
    """A one-token forward (x (1, ...)) on the Triton backend may hand its o projection `w`
    (K = num_heads * head_dim) the decode attention's partials (`gemv_merge`): on
    (GEMV_MERGE), w a bare gemv matmul (`use_gemv`), heads its kernel takes (`merge_fits`)."""
    return (GEMV_MERGE and x.dim() == 2 and x.shape[0] == 1
            and use_gemv(x.new_empty((1, w.shape[0])), w)
            and merge_fits(num_heads, w.shape[0] // num_heads))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def merge_fits(num_heads: int, head_dim: int) -> bool:
    """`gemv_merge`'s kernel takes these heads: head_dim a power of two >= 16 (the partials'
    rows unpadded), pow2(num_heads) * head_dim <= GEMV_MERGE_MAX_K (one K tile)."""
    return (head_dim >= 16 and head_dim == _pow2(head_dim)
            and _pow2(num_heads) * head_dim <= _triton_impl().GEMV_MERGE_MAX_K)


def gemv_merge(attn, w: torch.Tensor) -> torch.Tensor:
    """attn (1, H, D) tensor or `attention.DecodePartials` of one query -> attn (1, H * D) @ w
    (K = H * D, N): the partials merged inside the gemv kernel (`use_gemv_merge` decided
    that), or attn as it is through `gemv`. The values of `finish()` then `gemv`."""
    if isinstance(attn, torch.Tensor):
        return gemv(attn.reshape(attn.shape[0], -1), w)
    _, H, S, _ = attn.mid_o.shape
    D = attn.head_dim
    if attn.mid_o.shape[0] != 1 or H * D != w.shape[0] or attn.mid_o.shape[3] != D:
        raise ValueError(f"gemv_merge: partials of shape {tuple(attn.mid_o.shape)} (head_dim "
                         f"{D}) do not match w {tuple(w.shape)} of one query")
    if not merge_fits(H, D):
        raise ValueError(f"gemv_merge: {H} heads of {D} take a K tile of "
                         f"{_pow2(H) * _pow2(D)} > {_triton_impl().GEMV_MERGE_MAX_K}")
    return _triton_impl().gemv_merge_triton(attn.mid_o, attn.mid_lse, attn.head_dim, w)


# -------------------------------------------------------------------------- rope_store_qkv

def _check_rope_store(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc, num_heads,
                      num_kv_heads, size_limit) -> None:
    op, dev = "rope_store_qkv", qkv.device
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"{op}: num_heads={num_heads}, num_kv_heads={num_kv_heads}; both "
                         f"must be >= 1")
    if qkv.dim() != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads or qkv.shape[2] % 2:
        raise ValueError(f"{op}: qkv has shape {tuple(qkv.shape)}, expected (T, num_heads + "
                         f"2 * num_kv_heads = {num_heads + 2 * num_kv_heads}, even head_dim)")
    T, _, D = qkv.shape
    _expect(op, "qkv", qkv, (T, None, D), FLOAT_DTYPES, dev)
    _expect(op, "cos", cos, (None, D // 2), (torch.float32,), dev)
    _expect(op, "sin", sin, tuple(cos.shape), (torch.float32,), dev)
    _expect(op, "positions", positions, (T,), INDEX_DTYPES, dev)
    _expect(op, "out_cache_loc", out_cache_loc, (T,), INDEX_DTYPES, dev)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _expect(op, name, c, (None, num_kv_heads, D), (qkv.dtype,), dev)
        if not c.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (rows, {num_kv_heads}, {D})")
    rows = min(k_cache.shape[0], v_cache.shape[0])
    if not 0 < size_limit <= rows:
        raise ValueError(f"{op}: size_limit={size_limit}, expected 1 <= size_limit <= {rows} "
                         f"(cache rows)")


def rope_store_qkv_torch(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc, *,
                         num_heads: int, num_kv_heads: int, size_limit: int,
                         layer: int | None = None) -> torch.Tensor:
    """Reference: `RotaryEmbedding.apply` on the q and k heads with rot = cos + i*sin at the
    positions, then `store_cache_torch(k, v, ...)`. Raises `KVIndexError` (a position outside
    the tables, or a slot outside [0, size_limit)) before writing anything."""
    _check_rope_store(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc, num_heads,
                      num_kv_heads, size_limit)
    H, Hkv = num_heads, num_kv_heads
    try:
        check_indices(positions, cos.shape[0], "rope_store_qkv positions")
        rot = torch.complex(cos[positions], sin[positions]).unsqueeze(1)   # (T, 1, D/2)
        qk = qkv[:, :H + Hkv]                                             # (T, H+Hkv, D)
        xc = torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], -1, 2))  # (T, H+Hkv, D/2)
        qk = torch.view_as_real(xc * rot).flatten(-2).to(qkv.dtype)       # (T, H+Hkv, D)
        store_cache_torch(qk[:, H:], qkv[:, H + Hkv:], k_cache, v_cache, out_cache_loc,
                          size_limit=size_limit)
    except KVIndexError as e:
        raise (e if layer is None else e.with_layer(layer)) from None
    return qk[:, :H].contiguous()                                          # (T, H, D)


def rope_store_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out_cache_loc: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                   size_limit: int, layer: int | None = None) -> torch.Tensor:
    """RoPE on q and k, K/V into the paged cache, in one kernel; returns q (T, H, D).

    qkv: (T, H + 2Hkv, D) any strides (e.g. a view of the (T, (H+2Hkv)*D) matmul output);
    cos, sin: float32 (P, D/2) any strides (`cis.real`, `cis.imag` of RotaryEmbedding work as
    they are); positions, out_cache_loc: (T,) int32/int64; k_cache, v_cache: contiguous
    (rows, Hkv, D) in qkv's dtype. Token t's rotated k and v go to row out_cache_loc[t]; a slot
    outside [0, size_limit) or a position outside [0, P) raises `KVIndexError` (CPU: at once,
    nothing written; Triton: that token's row is not written, the error surfaces at once or at
    the step's `raise_if_error`).
    """
    if not use_triton(qkv):
        return rope_store_qkv_torch(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc,
                                    num_heads=num_heads, num_kv_heads=num_kv_heads,
                                    size_limit=size_limit, layer=layer)
    return _triton_impl().rope_store_qkv_triton(qkv, cos, sin, positions, k_cache, v_cache,
                                                out_cache_loc, num_heads, num_kv_heads,
                                                size_limit, layer, _check_rope_store)


# ------------------------------------------------------------------- norm_matmul_rope_store

# The qkv gemv with rope_store_qkv as its epilogue (`fused_triton._gemv_rope_kernel`): one
# launch a layer fewer where the qkv matmul runs in the gemv kernel. Why: with PDL the plain
# decode step at batch 1 spent 1.38 us a layer in rope_store_qkv (1324 us of 19.3 ms for 32
# tokens of 30 layers, H100, gpu_bench_h100_20261205d_default_pdl.json), a kernel that only
# moves the 960 values the qkv kernel just wrote. Measured on an H100 2026-12-06
# (gpu_bench_h100_20261206_next.json, one process): SmolLM2's plain decode 1.10x / 1.07x /
# 1.01x / 1.00x at batch 1 / 4 / 16 / 64 (6.3 kernels a layer, device time 19.04 -> 18.11 ms
# for 32 tokens), tokens bit-identical to the two kernels at every batch; but the 8B shape's
# decode 6.61 -> 6.80 ms (77.7% -> 75.5% of its roofline): its qkv weight (50 MB) is streamed
# at the bandwidth, and the epilogue's registers cost occupancy. So on by default for a qkv
# weight of at most GEMV_ROPE_MAX_BYTES (SmolLM2's is 1.1 MB), where the kernel is bound by
# latency, not bandwidth; EAGLEKV_GEMV_ROPE=0 turns it off, =1 on for any size. Read at each
# forward (graphs capture it).
_GEMV_ROPE_ENV = os.environ.get("EAGLEKV_GEMV_ROPE")
FUSE_GEMV_ROPE = _GEMV_ROPE_ENV != "0"
GEMV_ROPE_MAX_BYTES = None if _GEMV_ROPE_ENV == "1" else 8 << 20


def use_gemv_rope(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """The fused qkv + rope kernel takes this forward: on (FUSE_GEMV_ROPE), the qkv weight at
    most GEMV_ROPE_MAX_BYTES (None: any), the qkv matmul in the gemv kernel (`use_gemv`), and
    the gemv's column block whole pairs of one head."""
    if not (FUSE_GEMV_ROPE and use_gemv(x, w, fused=True)):
        return False
    if GEMV_ROPE_MAX_BYTES is not None and w.numel() * w.element_size() > GEMV_ROPE_MAX_BYTES:
        return False
    bn = _triton_impl().gemv_tiling(x.shape[0], x.shape[1])[1]
    return bn % 2 == 0 and head_dim % bn == 0


def _check_gemv_rope(x, residual, norm_weight, w, cos, sin, positions, k_cache, v_cache,
                     out_cache_loc, num_heads, num_kv_heads, size_limit, block_n) -> None:
    D = k_cache.shape[-1] if k_cache.dim() == 3 else 0
    n = (num_heads + 2 * num_kv_heads) * D
    if w.dim() != 2 or w.shape[1] != n:
        raise ValueError(f"norm_matmul_rope_store: w has shape {tuple(w.shape)}, expected "
                         f"({x.shape[-1]}, (num_heads + 2 * num_kv_heads) * head_dim = {n})")
    if block_n % 2 or D % block_n:
        raise ValueError(f"norm_matmul_rope_store: the gemv's block_n={block_n} must be even "
                         f"and divide head_dim={D}")
    _check_gemv(x, residual, norm_weight, w, False)
    qkv = torch.empty((x.shape[0], num_heads + 2 * num_kv_heads, D), dtype=w.dtype,
                      device=x.device)                # shapes only: the unfused op's checks
    _check_rope_store(qkv, cos, sin, positions, k_cache, v_cache, out_cache_loc, num_heads,
                      num_kv_heads, size_limit)


def norm_matmul_rope_store(x: torch.Tensor, residual: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           out_cache_loc: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                           size_limit: int, layer: int | None = None, matmul=None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_matmul` (the qkv matmul) then `rope_store_qkv` on its output -> (q (T, H, D), new
    residual): one kernel where `use_gemv_rope` says so, else the two ops (`matmul` as
    norm_matmul's). Same values either way; guards as rope_store_qkv's."""
    D = k_cache.shape[-1]
    if use_gemv_rope(x, w, D):
        return _triton_impl().gemv_rope_store_triton(
            x, residual, norm_weight, float(eps), w, cos, sin, positions, k_cache, v_cache,
            out_cache_loc, num_heads, num_kv_heads, size_limit, layer, _check_gemv_rope)
    qkv, new_residual = norm_matmul(x, residual, norm_weight, eps, w, matmul=matmul)
    q = rope_store_qkv(qkv.view(x.shape[0], num_heads + 2 * num_kv_heads, D), cos, sin,
                       positions, k_cache, v_cache, out_cache_loc, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, size_limit=size_limit, layer=layer)
    return q, new_residual
