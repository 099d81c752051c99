"""Tile shapes of the store_cache kernel side by side on the GPU: checked vs unchecked time and
bandwidth for each (TOK tokens x BLOCK columns a tile, num_warps), at the rows where the
1% checked/unchecked target is tightest. What chose `_launch_args`' tile rule.

Usage: PYTHONPATH=. python3 bench/store_cache_variants.py OUT.json
"""

import datetime
import json
import statistics
import sys

import torch
import triton

from eaglekv.kernels.store_cache_triton import _store_cache_kernel

SLOTS = 1 << 19
CONFIGS = [(tok, block, warps) for tok, block in ((2, 512), (4, 512), (8, 512), (8, 256),
                                                   (16, 256), (16, 128)) for warps in (2, 4, 8)]
POINTS = ((4096, 8192), (2048, 8192), (4096, 65536), (384, 8192))   # (row bytes, rows)


def measure(rb: int, n: int, rounds: int = 9) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    elems = rb // 2
    split = 4 if rb % 2048 == 0 else 2 if rb % 1024 == 0 else 1
    err = torch.zeros(2, dtype=torch.int64, device=dev)
    kc = torch.zeros(SLOTS, elems, dtype=dt, device=dev)
    vc = torch.zeros_like(kc)
    k = torch.randn(n, elems, device=dev).to(dt)
    v = torch.randn(n, elems, device=dev).to(dt)
    idx = torch.randperm(SLOTS, device=dev)[:n]
    out = []
    for tok, block, warps in CONFIGS:
        grid = (triton.cdiv(n, tok), split)

        def launch(check, tok=tok, block=block, warps=warps, grid=grid):
            return lambda: _store_cache_kernel[grid](
                k, v, kc, vc, idx, err, 1, n, k.stride(0), 1, v.stride(0), 1, kc.stride(0),
                vc.stride(0), elems, SLOTS, check, False, split, tok, block, num_warps=warps)
        fc, fu = launch(True), launch(False)
        ratios, tc = [], []
        for r in range(rounds):   # alternate who goes first
            order = (fc, fu) if r % 2 == 0 else (fu, fc)
            t = [triton.testing.do_bench(f, warmup=5, rep=25, return_mode="median") for f in order]
            c, u = t if r % 2 == 0 else t[::-1]
            ratios.append(c / u)
            tc.append(c)
        correct = torch.equal(kc[idx], k) and torch.equal(vc[idx], v) and int(err[0]) == 0
        d = {"row_bytes": rb, "rows": n, "tok": tok, "block": block, "warps": warps,
             "checked_vs_unchecked": round(statistics.median(ratios), 4),
             "checked_us": round(statistics.median(tc) * 1e3, 2),
             "checked_GBps": round(4 * n * rb / statistics.median(tc) / 1e6),
             "correct": correct}
        out.append(d)
        print(json.dumps(d), flush=True)
    return out


if __name__ == "__main__":
    results = [d for rb, n in POINTS for d in measure(rb, n)]
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "dtype": "bfloat16",
           "command": "PYTHONPATH=. python3 bench/store_cache_variants.py " + sys.argv[1],
           "results": results}
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)
