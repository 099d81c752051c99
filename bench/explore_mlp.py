"""The fused MLP kernel on the GPU (issue 13, plain decoding at batch 1): where a launch's
time goes, at SmolLM2's shape (hidden 576, intermediate 1536, bf16, one row).

The H100 profile of 2026-12-07 (`gpu_bench_h100_20261207_fused_r3.json`) put the fused MLP at
6.2 us a launch, about what the two gemv launches it replaced took (3.1 + 3.2): the merge +
o launch and the gaps between launches made the 1.17x. Each variant here: 30 launches (a
forward's layers, each with its own weights, so they stream from HBM as in the engine, not
from L2) captured in one CUDA graph with PDL as shipped, timed with CUDA events, median of
30 replays, variants alternating:
- `unfused`: the gemv with the norm and SiLU*mul (gate_up), then the gemv for down;
- `bn{N}w{W}`: the fused kernel with N intermediate columns a program and W warps;
- `..._store`: plain stores instead of the atomic adds (a wrong sum: what the atomics cost);
- `..._nodown`: no down product (what down's share of the work costs);
- `cublas_glue`: add + RMSNorm, cuBLAS gate_up, SiLU*mul, cuBLAS down (what a verify's MLP
  of 5-8 rows runs as shipped).
`--rows 8` (or 6): the same at a verify window's rows, the fused kernel and the unfused gemvs
in row groups of 4 (fused.GEMV_GROUP_MAX_ROWS, 2026-12-07).

    python bench/explore_mlp.py --out bench/results/explore_mlp_h100.json [--rows 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from attention_checks import LAYERS, time_graph    # bench/: 30 layers a graph, us a layer
from eaglekv.kernels import fused
from eaglekv.kernels import fused_triton as ft

H, I, EPS = 576, 1536, 1e-5


def variants() -> dict[str, tuple | None]:
    """name -> ((block_n, num_warps), atomic, down), or None for the unfused pair."""
    out: dict[str, tuple | None] = {"unfused": None, "cublas_glue": "cublas"}
    for bn, nw in ((4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8)):
        out[f"bn{bn}w{nw}"] = ((bn, nw), True, True)
    for bn, nw in ((8, 4), (16, 8)):
        out[f"bn{bn}w{nw}_store"] = ((bn, nw), False, True)
        out[f"bn{bn}w{nw}_nodown"] = ((bn, nw), True, False)
    return out


def layers(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    out = []
    for _ in range(LAYERS):
        wd = rnd(I, H, scale=I ** -0.5)
        out.append(dict(nw=rnd(H, scale=0.1) + 1,
                        w=fused.column_major(rnd(H, 2 * I, scale=H ** -0.5)),
                        wd=wd, wd_cm=fused.column_major(wd)))
    return out


def graph_of(ws, cfg, rows: int = 1) -> torch.cuda.CUDAGraph:
    x = torch.randn(rows, H, device="cuda")                              # the fp32 accumulator
    r = torch.randn(rows, H, device="cuda").to(torch.bfloat16)
    acc = torch.zeros((2, fused.MLP_MAX_ROWS, H), device="cuda")
    x_b = x.to(torch.bfloat16)                                          # the unfused input

    def run():
        for i, lw in enumerate(ws):
            if cfg == "cublas":
                h, _ = fused.add_rms_norm(x_b, r, lw["nw"], EPS, checked=False)
                act = fused.silu_and_mul(h @ lw["w"], checked=False)
                act @ lw["wd_cm"]
            elif cfg is None:
                act, _ = ft.gemv_triton(x_b, r, lw["nw"], EPS, lw["w"], True,
                                        fused._check_gemv)
                ft.gemv_triton(act, None, None, 0.0, lw["wd_cm"], False, fused._check_gemv)
            else:
                config, atomic, down = cfg
                ft.mlp_triton(x, r, lw["nw"], EPS, lw["w"], lw["wd"], acc[i % 2],
                              acc[(i + 1) % 2], config=config, atomic=atomic, down=down)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rows", type=int, default=1, help="1-8 (5-8: row groups of 4)")
    args = ap.parse_args()
    if not 1 <= args.rows <= fused.MLP_KERNEL_MAX_ROWS:
        ap.error(f"--rows {args.rows}: 1 to {fused.MLP_KERNEL_MAX_ROWS}")
    fused.GEMV_GROUP_MAX_ROWS = 8              # the unfused gemvs at 5-8 rows: row groups
    ws = layers()
    graphs = {name: graph_of(ws, cfg, args.rows) for name, cfg in variants().items()}
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.replays):
        for n, g in graphs.items():              # alternating
            times[n].append(time_graph(g))
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(),
           "command": "python bench/explore_mlp.py " + " ".join(sys.argv[1:]),
           "shape": {"hidden": H, "intermediate": I, "rows": args.rows, "layers": LAYERS},
           "us_per_layer": {n: round(statistics.median(t), 3) for n, t in times.items()}}
    for n, us in res["us_per_layer"].items():
        print(f"{n:>16}: {us:7.3f} us a layer")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
