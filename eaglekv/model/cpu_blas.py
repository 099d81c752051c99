"""How the CPU engine multiplies by its fp32 weights (`linear` in llama.py calls `cpu_linear`).

Three libraries, chosen by `EAGLEKV_CPU_BLAS` (or `set_mode`, for benches comparing them in
one process):

- `onednn` (default): oneDNN's matmul on a copy of the weight reordered once into oneDNN's
  blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the prepacked linear that
  PyTorch's Inductor uses for frozen CPU weights), on torch's threads. The copy is made at a
  weight's first use and kept beside it (`_eaglekv_packed`, with the weight's version
  counter: a weight changed in place is reordered again); weights that require grad are never
  packed (training runs through autograd).
- `numpy`: numpy's BLAS (OpenBLAS). On this project's AMD EPYC it runs its AVX-512 kernels
  where torch's oneMKL takes a generic path (`bench/blas_cpu.py`), and it is the fastest
  library for one token (a GEMV), but from 2 tokens up it repacks the whole weight on every
  call: one SmolLM2-135M forward's matmuls took 20 ms at 1 token, 44 at 2, 54 at 6, 69 at 16
  (30 distinct layers + the LM head, 2 cores; `bench/blas_cpu.py --libs numpy,onednn`).
  oneDNN on prepacked weights: 22 / 25 / 20 / 31 ms. A verify of N draft tokens is such an
  M = N matmul, so on OpenBLAS it cost 2-2.5 decode steps and speculation rarely paid on CPU.
  Runs torch's own ops on one thread (its pool and OpenBLAS's spin against each other).
- `torch`: `x @ w` (oneMKL here).

All three are exact fp32 matmuls up to summation order; tests compare them over shapes.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

MODES = ("onednn", "numpy", "torch")
PACK_HINT = 8          # the batch size oneDNN's layout is chosen for (1 picks a layout that
#                        ran a forward 4x slower at every M here)
ONEDNN_MIN_ROWS = 2    # fewer rows (one token: a GEMV) go to OpenBLAS
SWITCH_THREADS = False
CORES = os.cpu_count() or 1
_mode = os.environ.get("EAGLEKV_CPU_BLAS", "onednn")


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def mode() -> str:
    """The library in use: `EAGLEKV_CPU_BLAS` (`onednn` falls back to `numpy` where this
    torch has no oneDNN)."""
    if _mode == "onednn" and not onednn_available():
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
    """torch intra-op threads the CPU engine should run with: 1 beside OpenBLAS's own pool,
    else None (torch's default: every core, which oneDNN's matmuls use)."""
    return 1 if mode() == "numpy" else None


def packed(w_t: torch.Tensor):
    """The oneDNN-reordered copy of `w_t` (in, out), made on first use and kept on the
    tensor; made again if `w_t` was changed in place since."""
    hit = getattr(w_t, "_eaglekv_packed", None)
    if hit is not None and hit[0] == w_t._version:
        return hit[1]
    p = torch.ops.mkldnn._reorder_linear_weight(w_t.t().contiguous(), PACK_HINT)
    w_t._eaglekv_packed = (w_t._version, p)
    return p


def cpu_linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None):
    """x (T, in) @ w_t (in, out) (+ bias) on CPU, by the library in use; None when this call
    is not one the CPU libraries take (another dtype or device, a weight under autograd):
    the caller then runs `x @ w_t`."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or w_t.dtype != torch.float32
            or w_t.dim() != 2 or x.dim() != 2):
        return None
    m = mode()
    if m == "onednn" and x.shape[0] < ONEDNN_MIN_ROWS:
        m = "numpy"
    if m == "onednn" and not w_t.requires_grad and not x.requires_grad:
        if SWITCH_THREADS:
            n = torch.get_num_threads()
            torch.set_num_threads(CORES)
            try:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed(w_t), bias,
                                                          "none", [], "")
            finally:
                torch.set_num_threads(n)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed(w_t), bias,
                                                  "none", [], "")
    if m == "numpy" and not w_t.requires_grad and not x.requires_grad:
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
