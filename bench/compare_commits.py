"""`eaglekv bench` (plain and EAGLE with the shipped draft, CPU) on two commits side by side in
one run: each round runs the same command from each commit's tree, alternating, so machine
noise hits both alike; medians over the rounds. For a refactor that must cost nothing.

    PYTHONPATH=. .venv/bin/python bench/compare_commits.py BASE [HEAD] [--rounds 3] [--out DIR]

BASE / HEAD: commits (HEAD: the working tree). Each commit is checked out with `git worktree`
under /tmp. Writes refactor_cpu.json and .png to DIR (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = ["-m", "eaglekv.cli", "bench", "--no-hf", "--spec", "eagle", "--draft", "default",
         "--new-tokens", "96", "--repeats", "3"]


def tree_of(commit: str | None) -> tuple[str, str]:
    """(label, directory) of a commit's checkout; None: the working tree."""
    if commit is None:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                      text=True).strip()
        return f"{sha}+worktree", ROOT
    sha = subprocess.check_output(["git", "rev-parse", "--short", commit], cwd=ROOT,
                                  text=True).strip()
    path = os.path.join(tempfile.gettempdir(), f"eaglekv-{sha}")
    if not os.path.isdir(path):
        subprocess.check_call(["git", "worktree", "add", "--detach", path, sha], cwd=ROOT)
    return sha, path


def bench(tree: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.check_call([sys.executable, *BENCH, "--out", f.name], cwd=tree,
                              env={**os.environ, "PYTHONPATH": tree},
                              stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("head", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args()
    trees = [tree_of(args.base), tree_of(args.head)]
    runs = {label: [] for label, _ in trees}
    for r in range(args.rounds):
        for label, path in (trees if r % 2 == 0 else trees[::-1]):
            out = bench(path)
            runs[label].append({"plain": out["tokens_per_s"]["eaglekv"],
                                "eagle": out["tokens_per_s"]["eaglekv_spec"],
                                "accept_length": out["speculative"]["accept_length_mean"],
                                "identical": out["speculative"]
                                ["greedy_tokens_identical_to_plain"]})
            print(label, runs[label][-1], flush=True)
    summary = {label: {k: statistics.median(x[k] for x in rs) for k in ("plain", "eagle",
                                                                        "accept_length")}
               for label, rs in runs.items()}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
              "command": "PYTHONPATH=. .venv/bin/python bench/compare_commits.py "
                         + " ".join(sys.argv[1:]),
              "bench_command": "eaglekv " + " ".join(BENCH[2:]), "rounds": args.rounds,
              "median_tokens_per_s": summary, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "refactor_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "refactor_cpu.png"))
    print(json.dumps(summary, indent=1))


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(result["runs"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, kind in enumerate(("plain", "eagle")):
        for j, label in enumerate(labels):
            xs = [x[kind] for x in result["runs"][label]]
            ax.scatter([i * 3 + j] * len(xs), xs, label=f"{label} {kind}")
    ax.set_xticks([0.5, 3.5], ["plain", "EAGLE (shipped draft)"])
    ax.set_ylabel("tokens/s, batch 1 (each round)")
    ax.set_title(f"eaglekv bench, two commits alternating\n{result['device']}, "
                 f"{result['date']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
