"""Triton `store_cache`: program (token block, split); row i of k/v -> row indices[i].

An index outside `[0, size_limit)` is masked (nothing written) and recorded in the device
error buffer of `eaglekv.kernels.guard`; CHECK=False is the unchecked variant, kept only for
the benchmark comparison.

Launch cost. Triton's JIT dispatch (bind the arguments, compute the specialization key, look
up the kernel) costs ~16 us of host time a call on the H200 host, and the argument checks of
`resolve_args` ~7 us more, against ~18 us for torch's two `index_put` calls. Small batches are
launch-bound, so `store_cache_triton_fast` caches, per launch signature, the checked geometry
and the CompiledKernel, and calls its launcher directly (~6 us). The signature holds every
value the checks and Triton's specialization depend on: shapes, strides, dtypes, the device,
the 16-byte alignment of each pointer and the keyword arguments. The integers that change per
call (the call id) are `do_not_specialize`, so one compiled kernel serves every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eaglekv.kernels.guard import FLAGS, KVGuard, device_assert_enabled, kv_guard


@triton.jit(do_not_specialize=["call_id", "n_tokens"])
def _store_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, err_ptr, call_id, n_tokens,
                        k_s0, k_s1, v_s0, v_s1, kc_s0, vc_s0, row, size_limit,
                        CHECK: tl.constexpr, ASSERT: tl.constexpr, SPLIT: tl.constexpr,
                        TOK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, part): tokens [i*TOK, (i+1)*TOK), columns [part*chunk, (part+1)*chunk)."""
    part = tl.program_id(1)
    toks = (tl.program_id(0) * TOK + tl.arange(0, TOK)).to(tl.int64)   # (TOK,)
    tmask = toks < n_tokens
    slot = tl.load(idx_ptr + toks, mask=tmask, other=0).to(tl.int64)    # (TOK,)
    ok = tmask
    if CHECK:
        ok = tmask & (slot >= 0) & (slot < size_limit)
    if ASSERT:
        tl.device_assert(~tmask | ((slot >= 0) & (slot < size_limit)),
                         "store_cache: slot out of range")
    chunk = row // SPLIT
    start = part * chunk
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)                          # (BLOCK,)
        cm = cols[None, :] < start + chunk                                # (1, BLOCK)
        # the loads do not wait for the slot check (one DRAM latency per program otherwise);
        # only the stores, whose address is the slot anyway, are masked by it
        lm = tmask[:, None] & cm                                          # (TOK, BLOCK)
        sm = ok[:, None] & cm
        kx = tl.load(k_ptr + toks[:, None] * k_s0 + cols[None, :] * k_s1, mask=lm)
        vx = tl.load(v_ptr + toks[:, None] * v_s0 + cols[None, :] * v_s1, mask=lm)
        tl.store(kc_ptr + slot[:, None] * kc_s0 + cols[None, :], kx, mask=sm)
        tl.store(vc_ptr + slot[:, None] * vc_s0 + cols[None, :], vx, mask=sm)
    if CHECK:
        # report after the copy, without a reduction: each bad token (counted once, by the
        # part-0 program) issues its own masked atomics; on the normal path they are all
        # predicated off. Relaxed: the host reads the buffer only after the step's sync, and
        # the default acq_rel wraps every atomic in CTA barriers (bar.sync), run even when
        # predicated off; relaxed lowers to a bare `red` (no measurable change on the H200).
        # Vector pointers and masks (the interpreter refuses scalar + vector).
        zero = tl.zeros([TOK], dtype=tl.int32)
        bad = tmask & (~ok) & ((zero + part) == 0)                            # (TOK,)
        tl.atomic_add(err_ptr + zero, tl.full([TOK], 1, tl.int64), mask=bad, sem="relaxed")
        key = toks + (call_id.to(tl.int64) << 32)                             # id*2^32 + pos
        tl.atomic_min(err_ptr + 1 + zero, key, mask=bad, sem="relaxed")


def _launch_args(k2, v2, kc2, vc2, flat, guard: KVGuard, call_id: int, limit: int, split: int,
                 check: bool):
    """(grid, positional args incl. constexprs) of one launch; k2/v2 (n, row), kc2/vc2 rows."""
    n, row = k2.shape
    chunk = row // split
    # tiles of <= 8 x 256 elements, several per program on long chunks: a 2-D tile of 64-bit
    # addresses is register-hungry (8 x 512 took 128-168 registers, and the checked variant's
    # schedule differed from the unchecked one: 1.4-1.8% slower at 8192 rows of 2-4 KiB);
    # bench/store_cache_variants.py measured the alternatives side by side on the H200
    block = min(256, triton.next_power_of_2(chunk))
    tok = max(1, min(16, 2048 // block, triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, tok), split)
    args = (k2, v2, kc2, vc2, flat, guard.err, call_id, n,
            k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1), kc2.stride(0), vc2.stride(0),
            row, limit, check, device_assert_enabled() and check, split, tok, block)
    return grid, args


def _flat_indices(indices):
    flat = indices.reshape(-1)                                           # (n,)
    return flat if flat.stride(0) == 1 else flat.contiguous()           # the kernel reads idx[i]


def store_cache_triton(k2, v2, kc2, vc2, indices, limit: int, split: int, *, check: bool = True,
                       layer: int | None = None):
    """k2/v2: (n, row) any strides; kc2/vc2: (slots, row) contiguous rows. Launches through
    Triton's JIT and returns the CompiledKernel (None under the interpreter)."""
    n = k2.shape[0]
    if n == 0:
        return None
    guard = kv_guard(k2.device)
    call_id = guard.register("store_cache", limit, indices, layer, dense=True) if check else 0
    grid, args = _launch_args(k2, v2, kc2, vc2, _flat_indices(indices), guard, call_id, limit,
                              split, check)
    # tl.device_assert is compiled in only with debug=True
    compiled = _store_cache_kernel[grid](*args, debug=FLAGS.device_assert and check)
    if check:
        guard.after_launch()
    return compiled


@dataclass(frozen=True, slots=True)
class _Launch:
    """One cached launch signature: the launcher, the grid and the fixed tail arguments."""
    run: object
    function: int
    metadata: object
    grid: tuple
    guard: KVGuard
    limit: int
    tail: tuple          # n, strides, row, limit, constexprs: fixed for this signature


_LAUNCHES: dict[tuple, _Launch | None] = {}   # signature -> launch (None: not cacheable)
_MAX_LAUNCHES = 1024   # token counts vary per prefill step: bound the cache, start over when full
_MAX_CALL_ID = 2**31 - 1                      # call_id is passed as i32
_MISSING = object()
# the current CUDA stream as an int, what Triton's own dispatch reads (absent in CPU builds)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def fast_launch_enabled() -> bool:
    return FLAGS.fast_launch


def _signature(k, v, k_cache, v_cache, indices, row_bytes, num_split, size_limit, checked):
    return (k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
            k_cache.shape, k_cache.stride(), k_cache.dtype,
            v_cache.shape, v_cache.stride(), v_cache.dtype,
            indices.shape, indices.stride(), indices.dtype, k.get_device(), v.get_device(),
            k_cache.get_device(), v_cache.get_device(), indices.get_device(),
            k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0,
            v_cache.data_ptr() % 16 == 0, indices.data_ptr() % 16 == 0,
            row_bytes, num_split, size_limit, checked, FLAGS.device_assert)


def _hook_active(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # an empty HookChain: no


def _hooks_set() -> bool:
    """A launch hook (a profiler such as proton) needs Triton's dispatch: no cached launch."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True   # an older Triton without knobs: never bypass its dispatch
    rt = knobs.runtime
    return _hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)


def store_cache_triton_fast(k, v, k_cache, v_cache, indices, row_bytes: int, num_split: int,
                            size_limit: int, layer: int | None, checked: bool,
                            resolve) -> None:
    """`store_cache` on CUDA with the launch cost cut: the first call of a signature runs the
    full checks (`resolve`) and Triton's dispatch; later ones go straight to the launcher."""
    key = _signature(k, v, k_cache, v_cache, indices, row_bytes, num_split, size_limit, checked)
    launch = _LAUNCHES.get(key, _MISSING)
    if launch is None or launch is _MISSING or _RAW_STREAM is None or _hooks_set():
        k2, v2, kc2, vc2, limit, split = resolve(k, v, k_cache, v_cache, indices, row_bytes,
                                                 num_split, size_limit)
        compiled = store_cache_triton(k2, v2, kc2, vc2, indices, limit, split, check=checked,
                                      layer=layer)
        if launch is _MISSING:
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            _LAUNCHES[key] = _cacheable(k, v, k_cache, v_cache, indices, k2, v2, kc2, vc2,
                                        limit, split, checked, compiled)
        return
    guard = launch.guard
    call_id = (guard.register("store_cache", launch.limit, indices, layer, dense=True)
               if checked else 0)
    if call_id > _MAX_CALL_ID:
        raise RuntimeError(f"store_cache: {call_id} guarded calls in one step without a check")
    g0, g1 = launch.grid
    stream = _RAW_STREAM(k.get_device())
    launch.run(g0, g1, 1, stream, launch.function, launch.metadata, None, None, None,
               k, v, k_cache, v_cache, indices, guard.err, call_id, *launch.tail)
    if checked:
        guard.after_launch()


def _cacheable(k, v, k_cache, v_cache, indices, k2, v2, kc2, vc2, limit, split, checked,
               compiled) -> _Launch | None:
    """A launch is cached only if every 2-D view shares its tensor's memory (no copy was
    needed), the indices are contiguous, and the CompiledKernel exposes its launcher."""
    same = (k2.data_ptr() == k.data_ptr() and v2.data_ptr() == v.data_ptr()
            and kc2.data_ptr() == k_cache.data_ptr() and vc2.data_ptr() == v_cache.data_ptr()
            and indices.is_contiguous())
    if not same or compiled is None or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    guard = kv_guard(k2.device)
    grid, args = _launch_args(k2, v2, kc2, vc2, indices, guard, 0, limit, split, checked)
    return _Launch(compiled.run, compiled.function, compiled.packed_metadata, grid, guard, limit,
                   args[7:])
