"""The device side of `table_guard.guard_table_rows` in one Triton launch: program (b, p)
checks and copies the blocks p, p + SPLIT, ... of BLOCK keys of request b's row, up to its
clamped key count; program (b, 0) also writes the row's start and clamped lengths and records
a bad key count. The formulas and the error keys are in `table_guard`'s docstring;
`table_guard.guard_table_rows_torch` is the reference. Imports go one way: `table_guard`
imports this module (inside a function), never the reverse.

Graph-ready: no host sync; the grid (B, SPLIT) and the outputs' shapes come from host ints
(SPLIT <= MAX_SPLIT: a graph captured at the context limit launches B * 8 programs, not one
per 512 keys of it), and the work follows the keys a request has, not the width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512
MAX_SPLIT = 8
_HALF = tl.constexpr(2**31)


@triton.jit(do_not_specialize=["call_id", "size_limit", "n_table", "W"])
def _guard_rows_kernel(table_ptr, start_ptr, pre_ptr, ext_ptr, rows_ptr, start_out, pre_out,
                       ext_out, keys_out, err_ptr, call_id, size_limit, n_table, W,
                       HAS_PRE: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    ext = tl.load(ext_ptr + b).to(tl.int64)
    if HAS_PRE:
        pre = tl.load(pre_ptr + b).to(tl.int64)
    else:
        pre = ext * 0
    pre_s = tl.minimum(tl.maximum(pre, 0), W)
    ext_s = tl.minimum(tl.maximum(ext, 0), W - pre_s)
    n_s = pre_s + ext_s                                                # <= W
    cid = call_id.to(tl.int64)
    if p == 0:
        neg = (pre < 0) | (ext < 0)
        tl.store(start_out + b, b * W)
        tl.store(ext_out + b, ext_s)
        if HAS_PRE:
            tl.store(pre_out + b, pre_s)
        tl.store(keys_out + b, tl.where(neg, tl.minimum(pre, ext), pre + ext))
        if neg | (pre + ext > W):
            tl.atomic_add(err_ptr, 1, sem="relaxed")
            tl.atomic_min(err_ptr + 1, ((cid + 2) << 32) + b, sem="relaxed")
    base = tl.load(start_ptr + b).to(tl.int64)
    for blk in range(p, (n_s + BLOCK - 1) // BLOCK, SPLIT):
        j = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)             # (BLOCK,) key index
        live = j < n_s
        tpos = base + j                                                # table positions
        in_table = live & (tpos >= 0) & (tpos < n_table)
        slot = tl.load(table_ptr + tpos, mask=in_table, other=0).to(tl.int64)
        ok = in_table & (slot >= 0) & (slot < size_limit)
        zero = j * 0
        outside = live & ~in_table
        code = tl.where(tpos >= n_table, tl.minimum(tpos - n_table, _HALF - 1),
                        _HALF + tl.minimum(-tpos - 1, _HALF - 1))
        tl.atomic_add(err_ptr + zero, zero + 1, mask=outside, sem="relaxed")
        tl.atomic_min(err_ptr + 1 + zero, (cid << 32) + code, mask=outside, sem="relaxed")
        bad = in_table & ~ok
        tl.atomic_add(err_ptr + zero, zero + 1, mask=bad, sem="relaxed")
        tl.atomic_min(err_ptr + 1 + zero, ((cid + 1) << 32) + tpos, mask=bad, sem="relaxed")
        tl.store(rows_ptr + b * W + j, tl.where(ok, slot, 0).to(tl.int32), mask=live)


def guard_table_rows_triton(table: torch.Tensor, kv_start: torch.Tensor,
                            prefix_len: torch.Tensor | None, extend_len: torch.Tensor,
                            width: int, size_limit: int, err: torch.Tensor,
                            call_id: int) -> tuple:
    """table: flat int32; kv_start, prefix_len (or None), extend_len: (B,) int; err: the
    guard's (2,) int64 buffer -> (rows, kv_start, prefix_len or None, extend_len, keys), the
    fields of `table_guard.GuardedRows` (imports go one way: `table_guard` imports this
    module). Rows past a request's keys are left unwritten."""
    B, dev = kv_start.shape[0], kv_start.device
    rows = torch.empty(B * width, dtype=torch.int32, device=dev)
    start = torch.empty(B, dtype=torch.int64, device=dev)
    ext = torch.empty(B, dtype=torch.int64, device=dev)
    keys = torch.empty(B, dtype=torch.int64, device=dev)
    pre = None if prefix_len is None else torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        split = min(triton.cdiv(width, BLOCK), MAX_SPLIT)
        _guard_rows_kernel[(B, split)](
            table, kv_start, extend_len if prefix_len is None else prefix_len, extend_len,
            rows, start, ext if pre is None else pre, ext, keys, err, call_id, size_limit,
            table.numel(), width, HAS_PRE=prefix_len is not None, BLOCK=BLOCK, SPLIT=split,
            num_warps=4)
    return rows, start, pre, ext, keys
