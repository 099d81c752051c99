"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

At batch 1 a SmolLM2 layer is six or seven kernels of 1.3-4 us each, and much of each is the
gap between one kernel's end and the next one's start (launch, ramp-up) rather than memory
traffic (the layer's 7 MB of weights stream in ~2.3 us). With PDL a kernel is launched while
the one before it is still running: its programs become resident, load what no earlier kernel
writes (a matrix-vector product's weight tile), then wait (`gdc_wait`: griddepcontrol.wait)
until the kernel before has finished and its writes are visible; a kernel lets the next one
start (`gdc_launch_dependents`) once its main work is issued.

The rule each kernel keeps: nothing an earlier kernel of the stream writes is read, and
nothing is written, before its `gdc_wait`; every program runs `gdc_wait` before it exits (so
a kernel never completes before the one it follows: ordering stays transitive down the
stream). A kernel launched without PDL runs `gdc_wait` as a no-op.

On by default since 2026-12-05 night (`EAGLEKV_PDL=0`, or the bench's `*_nopdl` modes, turn it
off). `enabled(device)` also needs a CUDA device of compute capability 9.0+, and a Triton with
the `launch_pdl` launch option and `triton.language.extra.cuda.gdc_wait` (Triton's tutorial
11). Measured on an H100 (bench/results/gpu_bench_h100_20261205d_next.json, one process): alone
(a cuBLAS matmul, which never lets the next kernel launch early, still sits between the Triton
kernels) it ties plain decoding (0.98x / 1.03x / 1.09x / 0.98x at batch 1 / 4 / 16 / 64); with
every decode-sized matmul in the gemv kernel, so that every boundary of a layer is Triton to
Triton, plain ran 1447 tok/s at batch 1 against 1197 (1.21x; 1.09x / 1.09x / 1.04x at 4 / 16
/ 64), where the gemv kernel without PDL gave 1.09x. So with PDL on, `fused.gemv_on` puts the
bare matmuls in the gemv kernel too.
"""

from __future__ import annotations

import functools
import os

import torch

PDL = os.environ.get("EAGLEKV_PDL", "1") != "0"

try:   # Triton >= 3.3; the kernels only reference these under a USE_GDC=True constexpr
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    _HAS_GDC = True
except ImportError:                                   # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False


@functools.lru_cache(maxsize=None)
def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:                               # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """PDL for a launch on `device`: switched on, a CUDA device of sm_90+, a Triton that has
    it (never under the interpreter: its kernels run on the CPU)."""
    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _HAS_GDC and _triton_launches_pdl() and _capable(index)


def launch_options(use: bool) -> dict:
    """The launch keyword for Triton's dispatch: {"launch_pdl": True} or nothing."""
    return {"launch_pdl": True} if use else {}
