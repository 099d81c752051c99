"""GB/s of eaglekv store_cache (checked and unchecked) vs torch index_put vs a D2D copy.

bytes = read k + v and write them (4 * rows * row_bytes); L2 is flushed between repetitions
(triton.testing.do_bench zeroes a 256 MB buffer before each); the caches are 2 GiB so the
working set is far beyond the 60 MB L2. Usage (GPU):  PYTHONPATH=. python3 bench/store_cache.py
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import triton

from eaglekv.kernels.store_cache import store_cache

ROWS = [1, 4, 16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536]
ROW_BYTES = [384, 1024, 2048, 4096]
SLOTS = 262144


def main(out_dir: str) -> None:
    dev = "cuda"
    dtype = torch.bfloat16
    results = []
    for rb in ROW_BYTES:
        elems = rb // 2
        kc = torch.zeros(SLOTS, elems, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        for n in ROWS:
            k = torch.randn(n, elems, device=dev).to(dtype)
            v = torch.randn(n, elems, device=dev).to(dtype)
            idx = torch.randperm(SLOTS, device=dev)[:n].to(torch.int64)
            dk, dv = torch.empty_like(k), torch.empty_like(v)

            def checked():
                store_cache(k, v, kc, vc, idx)

            def unchecked():
                store_cache(k, v, kc, vc, idx, checked=False)

            def index_put():
                kc[idx] = k
                vc[idx] = v

            def copy():
                dk.copy_(k)
                dv.copy_(v)
            from eaglekv.kernels.guard import kv_guard
            guard = kv_guard(dev)
            row = {"rows": n, "row_bytes": rb}
            with guard.step():  # deferred check: no host sync per call, as in the engine
                for name, fn in [("eaglekv_checked", checked), ("eaglekv_unchecked", unchecked),
                                 ("torch_index_put", index_put), ("d2d_copy", copy)]:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                    row[name + "_us"] = ms * 1e3
                    row[name + "_GBps"] = 4 * n * rb / (ms * 1e-3) / 1e9
                guard.calls.clear()
            guard.raise_if_error()
            row["checked_vs_unchecked"] = row["eaglekv_checked_us"] / row["eaglekv_unchecked_us"]
            row["checked_vs_copy_bw"] = row["eaglekv_checked_GBps"] / row["d2d_copy_GBps"]
            results.append(row)
            print(json.dumps(row), flush=True)
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "dtype": "bfloat16",
           "command": "PYTHONPATH=. python3 bench/store_cache.py", "results": results}
    with open(os.path.join(out_dir, "store_cache_h200.json"), "w") as f:
        json.dump(doc, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(ROW_BYTES), figsize=(5 * len(ROW_BYTES), 4), sharey=True)
        for ax, rb in zip(axes, ROW_BYTES):
            rs = [r for r in results if r["row_bytes"] == rb]
            for name in ("eaglekv_checked", "eaglekv_unchecked", "torch_index_put", "d2d_copy"):
                ax.plot([r["rows"] for r in rs], [r[name + "_GBps"] for r in rs], marker="o",
                        label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"row {rb} B")
            ax.set_xlabel("rows")
        axes[0].set_ylabel("GB/s (read + write)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "store_cache_h200.png"), dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
