"""How the CPU engine multiplies by its fp32 weights (`linear` in llama.py calls `cpu_linear`).

Four libraries, chosen by `EAGLEKV_CPU_BLAS` (or `set_mode`, for benches comparing them in
one process):

- `onednn` (default): matmuls of 2-16 rows (a verify of N draft tokens, a decode of 2-16
  requests, a draft tree's level) by oneDNN on a copy of the weight reordered once into
  oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the prepacked linear
  PyTorch's Inductor uses for frozen CPU weights), on all of torch's threads; one row and
  more than 16 by OpenBLAS as `numpy` does, and every other op on torch's one thread: the
  count is raised around each oneDNN call and put back (`torch.set_num_threads`, 0.2 us), so
  OpenBLAS's pool and torch's OpenMP pool own the cores in turn. That needs OpenBLAS's threads to
  sleep when a call ends (`OPENBLAS_THREAD_TIMEOUT=4`, which `import eaglekv` sets before
  numpy loads; by default they spin ~0.1 s and an S3 step ran 2.2x slower); where numpy was
  loaded first (`import torch` loads it) without that variable, oneDNN stays on one thread,
  as `onednn1` does. The copy is kept on the tensor (`_eaglekv_packed`, with the weight's
  version counter: a weight changed in place is reordered again), 540 MB more for
  SmolLM2-135M. A CPU speculative engine makes it for its target's and draft's weights
  while it is built (`prepack`, 0.5-0.8 s here on both cores); any other weight gets it at
  its `PACK_AFTER`-th call of 2-16 rows. Weights that require grad are never packed
  (training runs through autograd).
- `onednn1`: the same on one thread throughout (eaglekv before 2026-12-05; benches compare).
- `numpy`: every matmul by numpy's BLAS (OpenBLAS). On this project's AMD EPYC it runs its
  AVX-512 kernels where torch's oneMKL takes a generic path, and it is the fastest library
  for one row (a GEMV) and for long prefill chunks, but from 2 rows up to ~24 it repacks the
  whole weight on every call. One SmolLM2-135M forward's matmuls (30 distinct layers + the LM
  head; `bench/blas_cpu.py`, 2026-12-04 23:43, `bench/results/blas_cpu_onednn.json`):

  | rows | 1 | 2 | 4 | 6 | 8 | 16 | 64 | 256 |
  |---|---|---|---|---|---|---|---|---|
  | OpenBLAS, ms | 18.3 | 51.3 | 49.1 | 57.8 | 56.5 | 66.7 | 124 | 398 |
  | oneDNN prepacked, 1 thread, ms | 35.3 | 41.9 | 27.8 | 28.6 | 38.2 | 51.7 | 170 | 672 |

  (2 to 16 rows in finer steps, `bench/results/blas_cpu_onednn_rows.json`: oneDNN 45 ms at
  2 rows, 29-31 at 3-6, 36-39 at 7-8, 43-56 at 10-16; so 2 rows are padded to 3.)

  So on OpenBLAS alone a verify of 4-8 tokens cost 2-2.5 decode steps and speculation rarely
  paid on CPU. torch's own ops run on one thread beside OpenBLAS: with two, its pool and
  OpenBLAS's spin against each other (plain decoding fell from 36 to 3.6 tok/s).

  On a later machine of the same kind (2026-12-05 01:30) oneDNN on two threads against one:
  a forward's matmuls took 26.1 / 42.5 ms at 4 rows, 28.0 / 47.6 at 6, 45.7 / 81.5 at 16
  (OpenBLAS 44.7, 63.7, 44.0); at one row 19.4 / 31.0 against OpenBLAS's 18.4 (its LM head
  3.1 ms against 1.8: one row stays on OpenBLAS).
- `torch`: `x @ w` (oneMKL here).

All four are exact fp32 matmuls up to summation order; tests compare them over shapes.
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np
import torch

from eaglekv.blas_env import timeout_is_short

MODES = ("onednn", "onednn1", "numpy", "torch")
PACK_HINT = 8          # the batch size oneDNN's layout is chosen for (1 picks a layout that
#                        ran a forward 4x slower at every M here)
ONEDNN_MIN_ROWS = 2    # fewer rows (one token: a GEMV) go to OpenBLAS, and so do more than
ONEDNN_MAX_ROWS = 16   # this (a prefill chunk, a batch-64 decode): there OpenBLAS's threads win
PACK_AFTER = 16        # a weight not prepacked is reordered at its 16th call of 2-16 rows: an
#                        S5 verify saves ~29 ms of matmuls, reordering all costs 0.33-0.56 s
_mode = os.environ.get("EAGLEKV_CPU_BLAS", "onednn")
_ALL_THREADS = torch.get_num_threads()   # torch's own choice at import: the machine's cores


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def mode() -> str:
    """The library in use: `EAGLEKV_CPU_BLAS` (`onednn` falls back to `numpy` where this
    torch has no oneDNN)."""
    if _mode in ("onednn", "onednn1") and not onednn_available():
        return "numpy"
    return _mode


def set_mode(name: str) -> str:
    """Switch libraries (benches); returns the previous mode. Threads: see `threads`."""
    global _mode
    if name not in MODES:
        raise ValueError(f"EAGLEKV_CPU_BLAS={name!r}: expected one of {MODES}")
    old, _mode = _mode, name
    return old


if _mode not in MODES:
    raise ValueError(f"EAGLEKV_CPU_BLAS={_mode!r}: expected one of {MODES}")


def threads() -> int | None:
    """torch intra-op threads the CPU engine starts with: 1 beside OpenBLAS's own pool
    (`numpy`, `onednn1`, and `onednn`, which moves to `onednn_threads()` for its oneDNN
    calls), else None (torch's default)."""
    return None if mode() == "torch" else 1


@functools.cache
def openblas_sleeps() -> bool:
    """Whether OpenBLAS's threads sleep as soon as a call ends (`OPENBLAS_THREAD_TIMEOUT` of
    at most 2**10 cycles, in the environment before numpy loaded OpenBLAS: see eaglekv's
    `__init__`), so that torch's OpenMP threads can have the cores between its calls.
    Read once: OpenBLAS read it once."""
    return timeout_is_short()


def onednn_threads() -> int:
    """Threads a 2-16-row oneDNN matmul runs on: all of torch's in `onednn` where OpenBLAS's
    threads sleep between calls, else one."""
    return _ALL_THREADS if mode() == "onednn" and openblas_sleeps() else 1


def describe() -> str:
    """The library and its threads, e.g. `onednn 2t` (cost caches and bench results keep it:
    the same library on other threads is another machine)."""
    m = mode()
    return f"{m} {onednn_threads()}t" if m in ("onednn", "onednn1") else m


def packs() -> bool:
    """Whether weights get oneDNN copies (`onednn`, `onednn1`)."""
    return mode() in ("onednn", "onednn1")


def _onednn(x: torch.Tensor, p, bias):
    """x @ the packed weight p on `onednn_threads()`; torch's thread count is put back after,
    so every other op runs as before (one thread in the engine: the same numerics whatever
    the batch; oneDNN's rows are the same whatever M, tested)."""
    n, old = onednn_threads(), torch.get_num_threads()
    if n == old:
        return torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], "")
    torch.set_num_threads(n)
    try:
        return torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], "")
    finally:
        torch.set_num_threads(old)


def packed(w_t: torch.Tensor, now: bool = True):
    """The oneDNN-reordered copy of `w_t` (in, out), kept on the tensor and made again if
    `w_t` was changed in place since. Not made yet and `now` False: made only at this
    weight's `PACK_AFTER`-th call (returns None before): reordering SmolLM2's weights takes
    ~0.5 s, which a one-shot `eaglekv generate` with a few batched calls never earns back
    (ski rental: rent with OpenBLAS until the rent paid reaches the price)."""
    hit = getattr(w_t, "_eaglekv_packed", None)
    if hit is not None and hit[0] == w_t._version:
        return hit[1]
    if not now and hit is None:      # (a stale copy is made again at once)
        calls = getattr(w_t, "_eaglekv_calls", 0) + 1
        w_t._eaglekv_calls = calls
        if calls < PACK_AFTER:
            return None
    p = torch.ops.mkldnn._reorder_linear_weight(w_t.t().contiguous(), PACK_HINT)
    w_t._eaglekv_packed = (w_t._version, p)
    return p


def prepack(weights) -> int:
    """Reorder `weights` for oneDNN now, on every core (engines that will verify: a CPU
    speculative engine prepacks its target's and its draft's weights while it is built, so
    its steps and their measured costs are the same from the first). -> bytes reordered."""
    if not packs():
        return 0
    done, total = set(), 0
    old = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        for w in weights:
            if (id(w) in done or w.device.type != "cpu" or w.dtype != torch.float32
                    or w.dim() != 2 or w.requires_grad):
                continue
            done.add(id(w))
            packed(w)
            total += w.numel() * w.element_size()
    finally:
        torch.set_num_threads(old)
    return total


def cpu_linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None):
    """x (T, in) @ w_t (in, out) (+ bias) on CPU, by the library in use (module docstring:
    `onednn` takes 2-16 rows and hands the rest to OpenBLAS); None when this call
    is not one the CPU libraries take (another dtype or device, a weight under autograd):
    the caller then runs `x @ w_t`."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or w_t.dtype != torch.float32
            or w_t.dim() != 2 or x.dim() != 2):
        return None
    if w_t.requires_grad or x.requires_grad:
        return None
    m = mode()
    dnn = m in ("onednn", "onednn1")
    if dnn and ONEDNN_MIN_ROWS <= x.shape[0] <= ONEDNN_MAX_ROWS:
        p = packed(w_t, now=False)
        if p is not None:
            if x.shape[0] == 2:      # 2 rows ran 1.5x slower than 3 here: padded with zeros
                x3 = torch.cat([x, x.new_zeros(1, x.shape[1])])
                return _onednn(x3, p, bias)[:2]
            return _onednn(x.contiguous(), p, bias)
    if dnn or m == "numpy":
        y = torch.from_numpy(np.matmul(x.numpy(), w_t.numpy()))          # shares memory
        return y if bias is None else y.add_(bias)
    return None


@contextlib.contextmanager
def using(name: str):
    """Run a block with library `name` and its thread setting (benches comparing libraries
    in one process); both are put back after."""
    old_mode, old_threads = set_mode(name), torch.get_num_threads()
    n = threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        set_mode(old_mode)
        torch.set_num_threads(old_threads)
