"""Index checks: at once on the host (`check_indices`), deferred on the device (`KVGuard`).

`check_indices` is the CPU path of every guarded kernel: one host sync, then `KVIndexError`
before anything is written. A guarded Triton kernel never writes through an out-of-range
index; it masks the access and records the error in a small device buffer: `[bad count, first
key, value, value's key]` where `key = call_id * 2**32 + token position` (atomic min, so the
earliest call and position win). The range guard (`guard_indices`) also records the bad value
itself and the key it belongs to, because the host cannot always read it back from the indices:
in a chain of captured steps (`spec_step_chain`) a later step overwrites the buffer it checked
before the sync comes. The other guarded kernels record the key alone and the host reads the
value from their indices (slot tables a step does not overwrite). The host reads the buffer at the step's existing sync (`raise_if_error`), so
the normal path costs no extra sync. Outside a step, a guarded call checks at once (one sync)
and raises. `EAGLEKV_DEVICE_ASSERT=1` switches the kernels to a hard device assert for
debugging.

`unchecked()` is for measuring what the checks cost, never for serving: kernels launched and
graphs captured inside it skip every index check (the Triton kernels are compiled with
CHECK=False, the torch-op guards return their input, the host checks return at once), so a bad
index there is the illegal memory access the guards exist to prevent. `eaglekv bench` builds
its `*_unchecked` modes under it to time a checked step against the same step unchecked.

The environment switches are read once, when this module is imported (a launch-path
`os.environ` lookup costs ~1 us on a slow host); `reload_env_flags()` reads them again.

Imports go one way: this module imports no other kernel module; the kernels (`store_cache`,
`store_cache_triton`, `move_kv`, the draft kv-index kernels) import it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from eaglekv.errors import KVIndexError

NO_ERROR = 2**62


@dataclass
class EnvFlags:
    device_assert: bool   # EAGLEKV_DEVICE_ASSERT=1: hard device assert instead of the guard
    fast_launch: bool     # EAGLEKV_TRITON_FAST_LAUNCH=0: always go through Triton's dispatch
    checks: bool = True   # False only inside `unchecked()` (measurement), never from the env

    @classmethod
    def from_env(cls) -> "EnvFlags":
        return cls(device_assert=os.environ.get("EAGLEKV_DEVICE_ASSERT", "0") == "1",
                   fast_launch=os.environ.get("EAGLEKV_TRITON_FAST_LAUNCH", "1") != "0")


FLAGS = EnvFlags.from_env()


def reload_env_flags() -> EnvFlags:
    """Re-read the environment switches (tests, or a process that changes them late)."""
    new = EnvFlags.from_env()
    FLAGS.device_assert, FLAGS.fast_launch = new.device_assert, new.fast_launch
    return FLAGS


def device_assert_enabled() -> bool:
    return FLAGS.device_assert


def checks_enabled() -> bool:
    return FLAGS.checks


@contextmanager
def unchecked():
    """Measurement only (see the module docstring): every index check off inside; the
    kernels compiled and the graphs captured here keep them off when they run later."""
    prev, FLAGS.checks = FLAGS.checks, False
    try:
        yield
    finally:
        FLAGS.checks = prev


def check_indices(indices: torch.Tensor, limit: int, op: str, low: int = 0) -> None:
    """Raise `KVIndexError` unless every index lies in `[low, limit)` (one host sync)."""
    if indices.numel() == 0 or not FLAGS.checks:
        return
    lo, hi = torch.aminmax(indices)
    if int(lo) < low or int(hi) >= limit:
        flat = indices.reshape(-1)
        bad = (flat < low) | (flat >= limit)
        raise KVIndexError(op, int(flat[bad][0]), limit, int(bad.sum()), flat.numel(), low=low)


@dataclass
class _Call:
    op: str
    limit: int
    indices: torch.Tensor
    layer: int | None
    dense: bool       # every entry of `indices` is addressed (not a table read in part)
    low: int = 0


def fresh_error_buffer() -> list[int]:
    """The error buffer's empty state: no bad index, no key, no recorded value."""
    return [0, NO_ERROR, 0, NO_ERROR]


class KVGuard:
    """One per device: the error buffer and the calls of the current step."""

    def __init__(self, device: torch.device):
        self.device = device
        # a normal tensor even when the first guarded call runs under inference_mode (a
        # model forward): the host resets it in place later, outside of it
        with torch.inference_mode(False):
            self.err = torch.tensor(fresh_error_buffer(), dtype=torch.int64, device=device)
        self.calls: dict[int, _Call] = {}     # call id -> call, this step's
        self.next_id = 0
        self.deferred = False

    def register(self, op: str, limit: int, indices: torch.Tensor, layer: int | None,
                 dense: bool = False, low: int = 0) -> int:
        call_id = self.next_id
        self.calls[call_id] = _Call(op, limit, indices, layer, dense, low)
        self.next_id += 1
        return call_id

    @contextmanager
    def capturing(self, first_id: int):
        """Record the calls of a CUDA graph capture under ids from `first_id` (a range of its
        own, so that a replay's calls never collide with the step's eager ones, which count
        from 0); yields the dict they go to, kept by the graph and handed back at every
        replay with `replaying`."""
        saved, saved_next = self.calls, self.next_id
        self.calls, self.next_id = {}, first_id
        try:
            yield self.calls
        finally:
            self.calls, self.next_id = saved, saved_next

    def replaying(self, calls: dict[int, _Call]) -> None:
        """A captured graph is about to run in this step: its calls become this step's."""
        self.calls.update(calls)

    @contextmanager
    def step(self):
        """Defer checks to `raise_if_error()` for the duration of one engine step."""
        prev, self.deferred = self.deferred, True
        try:
            yield self
        finally:
            self.deferred = prev

    def raise_if_error(self) -> None:
        """Read the buffer (call right after an existing host sync) and raise the first error."""
        count, key, value, value_key = self.err.tolist()
        calls, self.calls, self.next_id = self.calls, {}, 0
        if count == 0:
            return
        self.err.copy_(torch.tensor(fresh_error_buffer(), dtype=torch.int64))
        call = calls[key >> 32]
        pos = key & 0xFFFFFFFF
        flat = call.indices.reshape(-1)
        # the value as the device saw it when the guard recorded it, else (a kernel that keys
        # its errors only) read back from the indices, which the step has not overwritten
        bad = value if value_key == key else int(flat[pos])
        # the device counts over the whole step; a dense call's own count is recomputed here
        # (0 when a later step of a chain rewrote the indices: the device's count then)
        own = count
        if call.dense:
            own = int(((flat < call.low) | (flat >= call.limit)).sum()) or count
        raise KVIndexError(call.op, bad, call.limit, own, flat.numel(), layer=call.layer,
                           low=call.low, step_bad=count)

    def after_launch(self) -> None:
        if not self.deferred:
            self.raise_if_error()  # one sync: a standalone call raises right away


_GUARDS: dict[torch.device, KVGuard] = {}


def kv_guard(device: torch.device | str) -> KVGuard:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _GUARDS:
        _GUARDS[device] = KVGuard(device)
    return _GUARDS[device]


def guard_indices(indices: torch.Tensor, limit: int, op: str, layer: int | None = None,
                  low: int = 0) -> torch.Tensor:
    """Indices safe to address with: on CPU, checked at once (raises `KVIndexError`); on CUDA,
    bad entries are recorded in the device error buffer (no sync) and replaced by slot 0, the
    padding page, so the gather or scatter that follows stays inside its buffer."""
    if not FLAGS.checks:
        return indices
    if not indices.is_cuda:
        check_indices(indices, limit, op, low)
        return indices
    guard = kv_guard(indices.device)
    call_id = guard.register(op, limit, indices, layer, dense=True, low=low)
    flat = indices.reshape(-1).contiguous()
    if _USE_TORCH_OPS:
        safe = guard_range_torch(flat, low, limit, guard.err, call_id << 32)
    else:
        from eaglekv.kernels.guard_triton import guard_range_triton
        safe = guard_range_triton(flat, low, limit, guard.err, call_id << 32)
    guard.after_launch()
    return safe.view(indices.shape)


_USE_TORCH_OPS = False     # tests: the reference below instead of the Triton kernel


def guard_range_torch(flat: torch.Tensor, low: int, limit: int, err: torch.Tensor,
                      key_base: int) -> torch.Tensor:
    """Reference of `guard_triton.guard_range_triton` in torch ops (no host sync): a copy of
    flat with bad entries 0; err[0] += their count, err[1] = min(err[1], key_base + first)
    and, when that key is new (smaller than err[1] was), err[2:4] = (the first bad value, its
    key)."""
    if flat.numel() == 0:
        return flat.clone()
    bad = (flat < low) | (flat >= limit)                                   # (n,)
    pos = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    first = torch.where(bad, pos, torch.full_like(pos, flat.numel() - 1)).amin()
    key = torch.where(bad.any(), first + key_base, torch.full_like(first, NO_ERROR))
    new = key < err[1]
    err[2:4] = torch.where(new, torch.stack([flat[first].to(torch.int64), key]), err[2:4])
    err[0] += bad.sum()
    torch.minimum(err[1], key, out=err[1:2].view(()))
    return torch.where(bad, torch.zeros_like(flat), flat)


def guard_segments(starts: torch.Tensor, lens: tuple[int, ...], width: int,
                   op: str) -> torch.Tensor:
    """Offsets of n packed segments into a buffer of `width` entries (a draft step's
    kv_indptr into its kv_indices row): segment i is `[starts[i], starts[i] + lens[i])` and
    starts at `sum(lens[:i])`, the end of the one before; an offset anywhere else reads
    another branch's slots or past the buffer. An empty segment (a padded graph row, or a row
    frozen inside a chain of captured steps) reads nothing and may start anywhere, and the
    segment after it may start past the end of the one before it, never before: the list of
    a frozen row keeps the entries its writer laid out (the draft's `it` entries) while its
    read length is 0. CPU: checked at once (`KVIndexError` naming the first wrong offset and
    where it had to be); CUDA: the range alone, through the device error buffer (no sync)."""
    n = len(lens)
    if not FLAGS.checks:
        return starts
    if not starts.is_cuda:
        want, gap_ok = 0, False
        for i, s in enumerate(starts[:n].tolist()):
            if not lens[i]:       # reads nothing: any offset will do, and may leave a gap
                gap_ok = True
                continue
            if gap_ok and want <= s <= width - lens[i]:
                want, gap_ok = s, False
            if s != want or want + lens[i] > width:
                raise KVIndexError(f"{op} (segment {i} of {n} starts at {want})", s,
                                   want + 1 if want + lens[i] <= width else width, 1, n,
                                   low=want)
            want += lens[i]
        return starts
    return guard_indices(starts, max(width - max(lens, default=0) + 1, 1), op)


def guard_path(path: torch.Tensor, parent: torch.Tensor, op: str) -> torch.Tensor:
    """An accepted path (B, S+1) of tree node indices (-1 past the accepted depth) whose nodes
    address the verify window: each entry in [-1, N), and on CPU also a chain (a node at depth
    d is a child of the node at depth d-1; -1 only after the last accepted node), else
    `KVIndexError` naming the node; parent (B, N) is the tree's parent table."""
    N = parent.shape[1]
    if not FLAGS.checks:
        return path
    path = guard_indices(path, N, op, low=-1)
    if path.is_cuda:
        return path
    prev, cur = path[:, :-1], path[:, 1:]                                       # (B, S)
    par = parent.gather(1, cur.clamp(min=0))                                    # (B, S)
    bad = (cur >= 0) & ((prev < 0) | (par != prev))
    if bool(bad.any()):
        b, d = (int(x) for x in bad.nonzero()[0])
        node = int(cur[b, d])
        raise KVIndexError(f"{op}: node {node} at depth {d + 1} of request {b} is not a "
                           f"child of the node at depth {d} ({int(prev[b, d])})", node, N,
                           int(bad.sum()), cur.numel(), low=-1)
    return path
