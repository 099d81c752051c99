"""Every slot a forward's attention will read, checked once for all its layers.

The Triton attention kernels can check each slot as they read it (`attention_triton`,
CHECK > 0), but a target forward reads the same req_to_token rows in every layer: 30 times the
same checks for SmolLM2, and on the H200 the checked verify kernel ran 17.1 us a launch against
11.7 unchecked (2026-12-05), which kept checked speculation 8-9% below unchecked. Here the
rows are checked once, before the first layer, and copied into a buffer of the forward's own;
the layers then read that copy with the unchecked kernels. Nothing a layer reads was left
unchecked: the copy holds only slots that passed, the lengths the layers see are clamped to
the copy, and nothing writes req_to_token between the layers.

Request b's keys are `table[kv_start[b] + j]`, j < n_b, with n_b = prefix_len[b] +
extend_len[b] (extend) or kv_len[b] (decode, no prefix). `guard_table_rows` returns

    rows[b, j] = table[kv_start[b] + j] if it is a good slot else 0     for j < n'_b
    kv_start'[b] = b * W,  prefix' = clamp(prefix, 0, W),  extend' = clamp(extend, 0, W - prefix')

(n'_b = prefix' + extend' <= W, the copy's width; entries past n'_b are never written or read),
and records three kinds of error in the device error buffer (`kernels.guard`), read at the
step's sync as `KVIndexError`:
- "<op> table position": kv_start[b] + j outside [0, table.numel()), for j < n'_b (a corrupt
  request row), keyed as `attention_triton._outside` keys it;
- "<op>": a slot outside [0, size_limit), keyed by its table position (the attention kernels'
  own key, so the message names the slot);
- "<op> key count": n_b outside [0, W] (a negative prefix or extend length is named itself),
  keyed by b: a length that would read past the request's own row.

A bad entry reads slot 0 (the padding page) in its place, so a corrupt step computes garbage
inside the buffers and raises at its sync; its K/V writes are guarded on their own.

`guard_table_rows_torch` is the reference in torch ops (no host sync), and the path when the
Triton kernel is not in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglekv.kernels.guard import NO_ERROR, kv_guard

HALF = 2**31     # `attention_triton._outside`'s key codes: [0, HALF) past the end, else < 0


@dataclass
class GuardedRows:
    """What the layers read instead of the table: `rows` (B * W,) int32 flat, `kv_start`
    (B,) int64 = b * W, the clamped lengths (`prefix_len` None for decode) and `keys` (B,)
    int64, each request's key count as given (the "key count" error reads it)."""
    rows: torch.Tensor
    kv_start: torch.Tensor
    prefix_len: torch.Tensor | None
    extend_len: torch.Tensor
    keys: torch.Tensor
    width: int


def outside_code(pos: torch.Tensor, n_table: int) -> torch.Tensor:
    """The 32-bit key of table positions outside [0, n_table), as `_outside` codes them: the
    min over positions names the first one past the end, else the negative one nearest 0."""
    past = (pos - n_table).clamp(max=HALF - 1)
    neg = HALF + (-pos - 1).clamp(max=HALF - 1)
    return torch.where(pos >= n_table, past, neg)


def _record(err: torch.Tensor, bad: torch.Tensor, key: torch.Tensor) -> None:
    """err[0] += bad.sum(); err[1] = min(err[1], min key over bad) (torch ops, no sync)."""
    err[0] += bad.sum()
    first = torch.where(bad, key, torch.full_like(key, NO_ERROR)).amin()
    torch.minimum(err[1], first, out=err[1:2].view(()))


def guard_table_rows_torch(table: torch.Tensor, kv_start: torch.Tensor,
                           prefix_len: torch.Tensor | None, extend_len: torch.Tensor,
                           width: int, size_limit: int, err: torch.Tensor,
                           call_id: int) -> GuardedRows:
    """Reference of `table_guard_triton.guard_table_rows_triton` (see the module docstring);
    call ids: `call_id` table positions, `+ 1` slots, `+ 2` key counts."""
    B, W, dev = kv_start.shape[0], width, kv_start.device
    ext = extend_len.to(torch.int64)
    pre = torch.zeros_like(ext) if prefix_len is None else prefix_len.to(torch.int64)
    neg = (pre < 0) | (ext < 0)
    n = pre + ext
    keys = torch.where(neg, torch.minimum(pre, ext), n)                 # (B,)
    pre_s = pre.clamp(0, W)
    ext_s = torch.minimum(ext.clamp(min=0), W - pre_s)
    n_s = pre_s + ext_s
    b = torch.arange(B, device=dev, dtype=torch.int64)
    _record(err, neg | (n > W), ((call_id + 2) << 32) + b)
    j = torch.arange(W, device=dev, dtype=torch.int64)
    live = j[None, :] < n_s[:, None]                                    # (B, W)
    tpos = kv_start.to(torch.int64)[:, None] + j[None, :]               # (B, W)
    in_table = live & (tpos >= 0) & (tpos < table.numel())
    slot = table[torch.where(in_table, tpos, 0)].to(torch.int64)        # (B, W)
    ok = in_table & (slot >= 0) & (slot < size_limit)
    _record(err, live & ~in_table, (call_id << 32) + outside_code(tpos, table.numel()))
    _record(err, in_table & ~ok, ((call_id + 1) << 32) + tpos)
    rows = torch.where(ok, slot, 0).to(torch.int32)                     # (B, W), 0 past n'
    return GuardedRows(rows.reshape(-1), b * W, None if prefix_len is None else pre_s, ext_s,
                       keys, W)


def guard_table_rows(table: torch.Tensor, kv_start: torch.Tensor,
                     prefix_len: torch.Tensor | None, extend_len: torch.Tensor, width: int,
                     size_limit: int, op: str) -> GuardedRows:
    """Check and copy the rows a forward's attention reads (the module docstring): one launch
    on CUDA (and under the Triton interpreter in tests), torch ops otherwise; no host sync.
    The errors are raised at the step's sync (at once outside a step). `op` names the calls
    ("decode_attention" or "extend_attention"); `width` (a host int) is the copy's width, a
    bound on every request's key count."""
    from eaglekv.kernels.store_cache import use_triton
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"{op}: width={width} must be an int >= 1")
    for name, x in (("kv_start", kv_start), ("prefix_len", prefix_len),
                    ("extend_len", extend_len)):
        if x is not None and x.shape[0] > 1 and x.stride(0) != 1:
            raise ValueError(f"{op}: {name} has stride {x.stride(0)}; the guard reads it "
                             f"packed (stride 1): pass {name}.contiguous()")
    guard = kv_guard(table.device)
    call_id = guard.next_id
    if call_id > MAX_CALL_ID:
        raise RuntimeError(f"{op}: {call_id} guarded calls in one step without a check")
    if use_triton(table):
        from eaglekv.kernels.table_guard_triton import guard_table_rows_triton
        res = GuardedRows(*guard_table_rows_triton(table, kv_start, prefix_len, extend_len,
                                                   width, size_limit, guard.err, call_id),
                          width)
    else:
        res = guard_table_rows_torch(table, kv_start, prefix_len, extend_len, width,
                                     size_limit, guard.err, call_id)
    n_table = table.numel()
    guard.register(f"{op} table position", n_table, TablePositions(n_table), None)
    guard.register(op, size_limit, table, None)
    guard.register(f"{op} key count", width + 1, res.keys, None)
    guard.after_launch()
    return res


MAX_CALL_ID = 2**31 - 4     # call_id + 2 fits the kernel's i32 and the key's high 32 bits


class TablePositions:
    """The `indices` of a guard call of table positions: the kernels key a position outside
    the table by `outside_code`, and the guard reads the bad value back as
    `indices.reshape(-1)[code]` (this object is its own flat view), on the error path only."""

    def __init__(self, n_table: int):
        self.n_table = n_table

    def reshape(self, *shape) -> "TablePositions":
        return self

    def numel(self) -> int:
        return self.n_table

    def __getitem__(self, code: int) -> int:
        code = int(code)
        return self.n_table + code if code < HALF else -(code - HALF) - 1
