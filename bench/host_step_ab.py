"""Host time of a speculative engine step with the device work stubbed out (as
bench/host_step.py does), fixed S5/K1/N6 against adaptive speculation (S3 and S5 candidates,
costs frozen so that it chooses S5 every step), at batch 1 and 64, for two trees side by side:
each round runs a fresh process over each tree in turn, and the figures are medians over the
rounds. This CPU's timings move by 20-50% between runs, so only the ratios within a round and
the medians compare.

    python bench/host_step_ab.py --before DIR [--after .] [--rounds 5] [--out F.json]
    (DIR: a checkout of the other commit, e.g. `git worktree add /tmp/before HEAD~1`)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def warm(e, batch: int, sp) -> list:
    """`batch` requests prefilled and decoding (3 steps past the first token): the steps timed
    next are steady decode steps. Also bench/host_step.py's (this file is self-contained, so
    it can time an older tree's engine)."""
    reqs = [e.add_request([5, 17, 42, i % 200 + 1], sp) for i in range(batch)]
    while any(not r.output_ids for r in reqs):
        e.step()
    for _ in range(3):
        e.step()
    return reqs


def one(batch: int, adaptive: bool, steps: int, tiny: Path) -> float:
    """ms of host time a step, in this process's tree (on sys.path)."""
    import host_step as H
    from helpers import tiny_engine

    from eaglekv import SamplingParams
    from eaglekv.speculative.adaptive import CHAIN, PLAIN, CostTable
    from eaglekv.speculative.graphs import SpecStepGraphs
    kw = dict(max_running_requests=max(batch, 2), attention_backend="triton",
              max_total_tokens=batch * (steps * 8 + 64) + 256)
    kw["speculative"] = (dict(algorithm="eagle", draft_model="random", adaptive=True,
                              shapes=((3, 1, 4), (5, 1, 6))) if adaptive
                         else H.spec("eagle", 5, 1, 6))
    e = tiny_engine(tiny, **kw)
    cfg = e.model_config
    for w in (list(e.runner.workers.values()) if adaptive else [e.runner]):
        w.slots.hold_both = True
        w.step_graphs = SpecStepGraphs(w, batch, progress=False, capture=False)
        H.stub_spec(w.step_graphs, cfg.vocab_size, cfg.hidden_size)
    if adaptive:
        e.runner.policy.costs = CostTable.fixed({PLAIN: 1.0, CHAIN: 1.0, "S3K1N4": 10.0,
                                                 "S5K1N6": 1.2})
    warm(e, batch, SamplingParams(max_new_tokens=steps * 8, ignore_eos=True))
    t = time.perf_counter()
    for _ in range(steps):
        e.step()
    return 1e3 * (time.perf_counter() - t) / steps


def child(root: str, steps: int, batches: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path[:0] = [root, os.path.join(root, "bench"), os.path.join(root, "tests")]
    import torch
    from helpers import make_tiny
    torch.set_num_threads(1)
    tiny = Path(tempfile.mkdtemp())
    make_tiny(tiny)
    for b in (int(x) for x in batches.split(",")):
        for a in (False, True):
            print("R", f"b{b}_{'adaptive' if a else 'fixed'}", f"{one(b, a, steps, tiny):.4f}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.steps, a.batches)
        return
    trees = {"before": str(Path(a.before).resolve()), "after": str(Path(a.after).resolve())}
    runs: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for _ in range(a.rounds):
        for name, root in trees.items():
            out = subprocess.run([sys.executable, __file__, "--before", "-", "--child", root,
                                  "--steps", str(a.steps), "--batches", a.batches], capture_output=True, text=True,
                                 cwd=root, check=True).stdout
            for line in out.splitlines():
                if line.startswith("R "):
                    _, key, v = line.split()
                    runs[name].setdefault(key, []).append(float(v))
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in runs.items()}
    for n in trees:
        print(n, {k: round(v, 3) for k, v in med[n].items()})
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": "host only (device work stubbed), this CPU, torch 1 thread",
           "command": "python bench/host_step_ab.py " + " ".join(sys.argv[1:]),
           "trees": trees, "ms_per_step_median": med, "ms_per_step_runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
