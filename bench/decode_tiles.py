"""The decode attention kernel's tile on the GPU (issue 13, plain decoding at batch 1): what
one layer's decode attention costs, its split-K merge launch included, for split counts, key
tiles, warps and the least keys a split (`attention_triton.DECODE_BLOCK_N`, `DECODE_WARPS`,
`DECODE_MIN_CHUNK`), at SmolLM2's shape (9 query heads, 3 kv heads, 64 dims, bf16).

A decode graph is captured for the context limit, so its split count comes from that bound
(16 at batch 1) while a short context spreads over all 16 splits (~19 keys each at 300 keys):
`default` is that, the others what a tile could do instead. Each variant: 30 launches (a
forward's layers) captured in one CUDA graph, unchecked (the target's layers run unchecked
after the once-a-forward check) with PDL as shipped, timed with CUDA events, median of 30
replays, variants alternating. Writes JSON to --out.

    python bench/decode_tiles.py --out bench/results/decode_tiles_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from attention_checks import capture, time_graph    # bench/: 30 layers a graph, us a layer
from eaglekv.kernels import attention_triton as at
from eaglekv.kernels import guard
from eaglekv.kernels.attention import decode_attention, default_num_splits

H, HKV, D = 9, 3, 64


def variants() -> dict[str, tuple[int | None, int, int, int | None]]:
    """name -> (block_n, warps, min_chunk, splits; None: the graph's default)."""
    out = {"default": (None, 4, 0, None)}
    for c in (32, 64, 128, 256):
        out[f"s16c{c}"] = (64, 4, c, 16)
    for c, n, w in ((64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 256, 8)):
        out[f"s16c{c}n{n}w{w}"] = (n, w, c, 16)
    for s in (1, 2, 4, 8):
        for n, w in ((64, 4), (128, 4), (128, 8), (256, 8)):
            out[f"s{s}n{n}w{w}"] = (n, w, 0, s)
    return out


def graph_of(B: int, ctx: int, cfg) -> torch.cuda.CUDAGraph:
    block_n, warps, min_chunk, splits = cfg
    g = torch.Generator(device="cuda").manual_seed(B + ctx)
    slots = B * ctx + 64
    kb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = (torch.randperm(slots - 1, device="cuda", generator=g)[:B * ctx] + 1).to(torch.int32)
    start = torch.arange(B, device="cuda") * ctx
    lens = torch.full((B,), ctx, device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    n = splits or default_num_splits(B, HKV, 2048)          # a graph for a 2048-token limit
    at.DECODE_BLOCK_N, at.DECODE_WARPS, at.DECODE_MIN_CHUNK = block_n, warps, min_chunk

    def fn():
        decode_attention(q, kb, vb, table, start, lens, D ** -0.5, size_limit=slots,
                         num_splits=n, out=out, checked=False)
    with guard.kv_guard("cuda").step(), guard.unchecked():
        graph = capture(fn)
    guard.kv_guard("cuda").calls.clear()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", default="1x300,1x1000,1x100,64x300")
    args = ap.parse_args()
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "command":
           "python bench/decode_tiles.py " + " ".join(sys.argv[1:]), "us_per_layer": {}}
    vs = variants()
    for case in args.cases.split(","):
        B, ctx = map(int, case.split("x"))
        graphs = {v: graph_of(B, ctx, cfg) for v, cfg in vs.items()}
        times = {v: [] for v in vs}
        for _ in range(30):
            for v in vs:
                times[v].append(time_graph(graphs[v]))
        row = {v: round(statistics.median(t[3:]), 3) for v, t in times.items()}
        res["us_per_layer"][f"b{B} ctx{ctx}"] = row
        best = sorted(row.items(), key=lambda kv: kv[1])[:6]
        print(f"b{B} ctx{ctx}: default {row['default']} us; best {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
