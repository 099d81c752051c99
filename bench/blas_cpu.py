"""numpy's OpenBLAS, torch's MKL and oneDNN on prepacked weights for SmolLM2-135M's fp32
matmuls on this CPU (what eaglekv/model/cpu_blas.py chooses between): one forward's worth of matmuls
(30 layers x qkv, o, gate_up, down, and the LM head) at M tokens, the two libraries
alternating, median of --repeats. Also records which code path MKL reports (MKL_VERBOSE's
banner) and which kernel OpenBLAS picked.

    .venv/bin/python bench/blas_cpu.py [--repeats 7] [--out bench/results/blas_cpu.json]
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/blas_cpu.py --torch-threads 1 --out ...

The one-thread run compares the two libraries' kernels alone; on a loaded 2-core machine the
two-thread run mostly measures threads spinning against other processes.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import eaglekv  # noqa: F401  (before numpy loads: OpenBLAS's threads sleep, eaglekv/__init__)
import numpy as np
import torch

from eaglekv.model import cpu_blas

H, I, QKV, V, LAYERS = 576, 1536, 576 + 2 * 192, 49152, 30
SHAPES = [(H, QKV), (H, H), (H, 2 * I), (I, H)]            # (in, out), stored as the engine does


def one_forward(layers, head, x_by_in, mm) -> None:
    for mats in layers:
        for w in mats:
            mm(x_by_in[w.shape[0]], w)
    mm(x_by_in[H], head)


def onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, cpu_blas.packed(w), None, "none", [], "")


def mkl_banner() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; torch.ones(4, 4) @ torch.ones(4, 4)"],
                         env={**os.environ, "MKL_VERBOSE": "1"}, capture_output=True, text=True)
    return next((ln for ln in out.stdout.splitlines() if "oneMKL" in ln or "Intel(R) MKL" in ln), "")


def openblas_core() -> str:
    import numpy
    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "scipy_openblas*",
                                  "lib", "libscipy_openblas*.so"))
    libs += glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "numpy.libs",
                                   "libscipy_openblas*.so"))
    for lib in libs:
        dll = ctypes.CDLL(lib)
        for prefix in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                       "openblas_get_corename64_", "openblas_get_corename"):
            fn = getattr(dll, prefix, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ms", default="1,2,4,6,8,16,64,256")
    ap.add_argument("--torch-threads", type=int, default=torch.get_num_threads(),
                    help="threads for the MKL rows (default torch's; OpenBLAS's come from "
                    "OPENBLAS_NUM_THREADS, default all cores)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/blas_cpu.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    # 30 distinct layers, as in the model (540 MB: no layer's weights stay in cache); before
    # 2026-12-04 23:40 one layer's were used 30 times
    mats = [[torch.randn(i, o, generator=g) * 0.02 for i, o in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(H, V, generator=g) * 0.02
    torch_threads = args.torch_threads
    libs = {
        # torch's own matmul (MKL here) with torch's default thread count
        "torch_mkl": (torch_threads, lambda x, w: x @ w),
        # the engine's CPU path: numpy's OpenBLAS on the same tensors, torch on one thread
        "numpy_openblas": (1, lambda x, w: np.matmul(x.numpy(), w.numpy())),
        # oneDNN on the weight reordered once (cpu_blas.packed), at every M; the engine
        # (cpu_blas "onednn") sends M = 1 to OpenBLAS and runs this on one torch thread
        "onednn_packed": (1, onednn),
        "onednn_packed_2t": (2, onednn),
    }
    for layer in mats:                                   # reorder once, outside the timing
        for w in layer:
            cpu_blas.packed(w)
    cpu_blas.packed(head)
    rows = []
    for m in [int(s) for s in args.ms.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in (H, I)}
        times = {name: [] for name in libs}
        for r in range(args.repeats + 1):                   # round 0: warm-up, not kept
            for name, (threads, mm) in (libs.items() if r % 2 else reversed(libs.items())):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                one_forward(mats, head, xs, mm)
                if r:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"M": m, **{f"{n}_ms": round(statistics.median(t), 2) for n, t in times.items()}}
        row["numpy_over_torch"] = round(row["numpy_openblas_ms"] / row["torch_mkl_ms"], 3)
        row["onednn_over_numpy"] = round(row["onednn_packed_ms"] / row["numpy_openblas_ms"], 3)
        rows.append(row)
        print(row, file=sys.stderr)
    result = {"what": "one SmolLM2-135M forward's fp32 matmuls (30 layers + LM head) at M tokens",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([".venv/bin/python", "bench/blas_cpu.py", *sys.argv[1:]]),
              "device": {"cores": os.cpu_count(), "torch": torch.__version__,
                         "numpy": np.__version__, "torch_cpu_capability":
                         torch.backends.cpu.get_cpu_capability(),
                         "mkl_verbose_banner": mkl_banner(), "openblas_core": openblas_core(),
                         "load_avg": os.getloadavg()},
              "torch_threads_for_mkl": torch_threads,
              "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "(all cores)"),
              "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
