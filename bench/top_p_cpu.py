"""Sampled decoding on the CPU with top-p over the largest 1024 probabilities vs a full sort of
the vocabulary (`eaglekv.sampling.TOP_P_CANDIDATES`), side by side in one process, alternating:
plain, and EAGLE-3 with the shipped head (chain S3/K1/N4, tree S4/K2/N8), T = 0.7, top-p 0.95.
The sampled tokens are the same either way (the filter's result is bit for bit the full
sort's, tests/engine/test_top_p.py); only the time differs.

    python bench/top_p_cpu.py [--new-tokens 64] [--repeats 3] [--out bench/results/top_p_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglekv import Engine, EngineConfig, SamplingParams  # noqa: E402
from eaglekv import sampling  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
MODES = {"plain": None,
         "eagle3 chain S3K1N4": dict(num_steps=3, topk=1, num_draft_tokens=4),
         "eagle3 tree S4K2N8": dict(num_steps=4, topk=2, num_draft_tokens=8)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {"top-1024 candidates": sampling.TOP_P_CANDIDATES, "full sort": 10 ** 9}
    rows = []
    for mode, shape in MODES.items():
        spec = None if shape is None else dict(algorithm="eagle3", draft_model="default",
                                               adaptive=False, **shape)
        kw = {} if spec is None else {"speculative": spec}
        e = Engine(EngineConfig(model="default", max_total_tokens=2048, **kw))
        ids = e.encode(PROMPT)
        sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.7, top_p=0.95,
                            seed=1, ignore_eos=True)
        e.generate([ids], sp)                                           # warm-up
        times, tokens = {v: [] for v in variants}, {}
        for _ in range(args.repeats):
            for name, k in variants.items():
                sampling.TOP_P_CANDIDATES = k
                t = time.perf_counter()
                out = e.generate([ids], sp)[0]
                times[name].append(time.perf_counter() - t)
                tokens.setdefault(name, out.token_ids)
        sampling.TOP_P_CANDIDATES = variants["top-1024 candidates"]
        tok_s = {v: args.new_tokens / statistics.median(ts) for v, ts in times.items()}
        rows.append({"mode": mode, "tok_s": tok_s,
                     "speedup": tok_s["top-1024 candidates"] / tok_s["full sort"],
                     "same_tokens": tokens["top-1024 candidates"] == tokens["full sort"]})
        print(f"{mode:22s} " + "  ".join(f"{v} {x:.1f} tok/s" for v, x in tok_s.items())
              + f"  ({rows[-1]['speedup']:.2f}x, same tokens {rows[-1]['same_tokens']})",
              flush=True)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({platform.machine()})",
           "command": "python bench/top_p_cpu.py " + " ".join(sys.argv[1:]),
           "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
