"""What the attention kernels' index checks cost, and which way of checking costs least
(issue 13: checked vs unchecked within 1%). For each CHECK variant of
`attention_triton._load_slots` (0 unchecked; 1 rows read only through good slots; 2 rows read
through the clamped slot, bad keys masked from the scores; 3 = 2 without recording), each
unpipelined (as shipped) and with Triton's default software pipelining ("p", 3 stages), the
S5 verify's extend (6 queries over a 300-key prefix) and a decode (300 keys) of SmolLM2's
shape (9 query heads, 3 kv heads, 64 dims, bf16) at batch 1 and 64: 30 launches captured in
one CUDA graph (as a step replays them), the graph timed with CUDA events, median of 30,
variants alternating. Variant "g" is the shipped way since the once-a-forward check: one
`table_guard.guard_table_rows` launch, then the 30 layers' kernels unchecked over its copy
(its figure is the graph's time / 30, the check's launch included). Writes JSON to --out.

    python bench/attention_checks.py --out bench/results/attention_checks_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys

from contextlib import nullcontext

import torch

from eaglekv.kernels import attention_triton as at
from eaglekv.kernels import guard
from eaglekv.kernels.attention import decode_attention, default_num_splits, extend_attention
from eaglekv.kernels.table_guard import guard_table_rows

H, HKV, D, PREFIX, N, LAYERS = 9, 3, 64, 300, 6, 30


def case(B: int):
    g = torch.Generator(device="cuda").manual_seed(B)
    slots = B * (PREFIX + N) + 64
    kb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = (torch.randperm(slots - 1, device="cuda", generator=g)[:B * (PREFIX + N)] + 1
             ).to(torch.int32)
    start = torch.arange(B, device="cuda") * (PREFIX + N)
    return kb, vb, table, start, slots


def runner(kind: str, B: int, once: bool = False):
    """(prologue, layer): what a forward runs once, and what each of its layers runs. once:
    the rows checked and copied by the prologue, the layers unchecked over the copy."""
    kb, vb, table, start, slots = case(B)
    W = PREFIX + N
    cur = {}
    if kind == "extend":
        q = torch.randn(B * N, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        pre = torch.full((B,), PREFIX, device="cuda")
        ext = torch.full((B,), N, device="cuda")
        qs = torch.arange(B, device="cuda") * N
        mask = torch.ones(B, N, N, dtype=torch.bool, device="cuda").tril()
        cur.update(table=table, start=start, pre=pre, ext=ext)

        def prologue():
            g = guard_table_rows(table, start, pre, ext, W, slots, "extend_attention")
            cur.update(table=g.rows, start=g.kv_start, pre=g.prefix_len, ext=g.extend_len)
        return (prologue if once else None), lambda: extend_attention(
            q, kb, vb, cur["table"], cur["start"], cur["pre"], cur["ext"], qs, D ** -0.5,
            size_limit=slots, mask=mask, max_extend=N, out=out, checked=not once)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((B,), PREFIX, device="cuda")
    splits = default_num_splits(B, HKV, PREFIX + N)
    cur.update(table=table, start=start, lens=lens)

    def prologue():
        g = guard_table_rows(table, start, None, lens, W, slots, "decode_attention")
        cur.update(table=g.rows, start=g.kv_start, lens=g.extend_len)
    return (prologue if once else None), lambda: decode_attention(
        q, kb, vb, cur["table"], cur["start"], cur["lens"], D ** -0.5, size_limit=slots,
        num_splits=splits, out=out, checked=not once)


def graph_of(kind: str, B: int, variant: str):
    """variant: the check level (0 unchecked), "p" for the pipelined loop, or "g" (checked
    once, then unchecked layers), then optionally "@rR" / "@nN" for a short extend's tile (at
    least R rows of queries x heads, keys in tiles of N: at.SHORT_MIN_ROWS / SHORT_BLOCK_N),
    e.g. "1@r16n32"."""
    base, _, tile = variant.partition("@")
    once = base == "g"
    level = 1 if once else int(base.rstrip("p"))
    prologue, fn = runner(kind, B, once)
    at.CHECK_LEVEL = max(level, 1)
    at.DECODE_STAGES = at.DEFAULT_STAGES if base.endswith("p") else 1
    at.UNCHECKED_STAGES = at.DEFAULT_STAGES if base.endswith("p") else 1
    at.SHORT_EXTEND = 0 if base.endswith("p") else 64
    rows = re.search(r"r(\d+)", tile)
    cols = re.search(r"n(\d+)", tile)
    at.SHORT_MIN_ROWS = int(rows.group(1)) if rows else None
    at.SHORT_BLOCK_N = int(cols.group(1)) if cols else 64
    # every variant defers its checks to a step's sync (none happens inside the capture); the
    # unchecked one also compiles the kernels without them
    with guard.kv_guard("cuda").step(), (guard.unchecked() if level == 0 else nullcontext()):
        g = capture(fn, prologue)
    guard.kv_guard("cuda").calls.clear()
    return g


def capture(fn, prologue=None) -> torch.cuda.CUDAGraph:
    """A forward's attention: `prologue` once, then `fn` for each of LAYERS layers, warmed
    up (three eager runs) and captured in one CUDA graph."""
    for _ in range(3):
        if prologue:
            prologue()
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if prologue:
            prologue()
        for _ in range(LAYERS):
            fn()
    return g


def time_graph(g) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / LAYERS        # us a launch


def main() -> None:
    global N
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--variants", default="0,1,g,2,3,0p,1p")
    ap.add_argument("--kinds", default="extend,decode")
    ap.add_argument("--n", type=int, default=N, help="queries a request in an extend (verify)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "command":
           "python bench/attention_checks.py " + " ".join(sys.argv[1:]),
           "us_per_launch": {}}
    N = args.n
    for kind in args.kinds.split(","):
        for B in (1, 64):
            graphs = {v: graph_of(kind, B, v) for v in variants}
            times = {v: [] for v in variants}
            for _ in range(30):
                for v in variants:
                    times[v].append(time_graph(graphs[v]))
            row = {v: statistics.median(t[3:]) for v, t in times.items()}
            res["us_per_launch"][f"{kind} b{B}"] = row
            print(kind, B, {v: round(x, 2) for v, x in row.items()}, flush=True)
    assert guard.kv_guard("cuda").err.tolist() == [0, guard.NO_ERROR]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
