"""Start-up of the default model on CPU (issue 17): `import eaglekv`, a cold and a warm
`eaglekv generate --max-new-tokens 1`, each a fresh process: wall time and peak RSS. Every
round runs each case once, the trees (this one, and --before: a checkout of an older commit)
alternating, so load from other processes falls on all of them alike; medians of --repeats.

    .venv/bin/python bench/startup.py [--repeats 5] [--before DIR] [--out FILE.json]

cold: an empty EAGLEKV_CACHE (weights converted, tokenizer converted, both written);
warm: the cache a previous, unmeasured run filled. A tree from before the weight cache keeps
only its tokenizer there. Writes the JSON (and a PNG beside it) with the date, the machine and
each exact command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello"
GENERATE = ["-m", "eaglekv.cli", "generate", PROMPT, "--max-new-tokens", "1"]
IMPORT = ["-c", "import eaglekv"]
TORCH = ["-c", "import os, torch; os._exit(0)"]     # the floor: torch's import, no teardown


def run(argv: list[str], tree: Path, cache: Path) -> dict:
    """One fresh process: wall seconds, peak RSS (MiB, from wait4) and the load-split line."""
    # as on a user's machine: Python caches the modules' bytecode (this sandbox sets
    # PYTHONDONTWRITEBYTECODE, which recompiles eaglekv's ~50 modules, 0.06 s, every run)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(tree), EAGLEKV_CACHE=str(cache))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, *argv], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} in {tree} failed:\n{err}")
    line = re.search(r"\[eaglekv\] model .* loaded in .*", err)
    return {"wall_s": round(wall, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "load_line": line.group(0) if line else None}


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", lscpu)
    flags = set(re.search(r"Flags:\s*(.*)", lscpu).group(1).split()) if "Flags:" in lscpu else set()
    import numpy
    import torch
    return {"cpu": model.group(1).strip() if model else platform.processor(),
            "cores": os.cpu_count(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "torch": torch.__version__, "numpy": numpy.__version__,
            "python": platform.python_version()}


def commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "(not a git checkout)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", type=Path, help="an older tree to run side by side")
    ap.add_argument("--before-commit", help="its commit, when it is not a git checkout")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/startup_cpu.json")
    args = ap.parse_args()
    trees = {"after": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    load_start = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="eaglekv_startup_"))
    warm = {name: scratch / f"warm_{name}" for name in trees}
    for name, tree in trees.items():                 # fill each tree's warm cache
        run(GENERATE, tree, warm[name])
    cases = {"import eaglekv": IMPORT, "import torch": TORCH, "warm generate": GENERATE,
             "cold generate": GENERATE}
    runs = {name: {case: [] for case in cases} for name in trees}
    for r in range(args.repeats):
        for case, argv in cases.items():
            for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                cache = warm[name] if case != "cold generate" else scratch / f"cold_{name}_{r}"
                runs[name][case].append(run(argv, tree, cache))
                if case == "cold generate":
                    shutil.rmtree(cache, ignore_errors=True)
                print(name, case, runs[name][case][-1], file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    summary = {name: {case: {"median_wall_s": statistics.median(x["wall_s"] for x in rs),
                             "median_peak_rss_mib": statistics.median(x["peak_rss_mib"] for x in rs)}
                      for case, rs in cases_runs.items()}
               for name, cases_runs in runs.items()}
    result = {
        "what": "start-up of the default model (SmolLM2-135M-Instruct Q4_1 GGUF), fresh "
                "processes, trees alternating, medians",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {**machine(), "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
        "commands": {case: " ".join([".venv/bin/python", *argv]) for case, argv in cases.items()},
        "env": "PYTHONPATH=<tree> EAGLEKV_CACHE=<warm dir, or an empty dir for cold>; "
               "PYTHONDONTWRITEBYTECODE unset (bytecode cached, as Python does by default)",
        "trees": {name: {"path": str(tree), "commit": (args.before_commit if name == "before"
                                                       and args.before_commit else commit(tree))}
                  for name, tree in trees.items()},
        "bench_command": " ".join([".venv/bin/python", "bench/startup.py", *sys.argv[1:]]),
        "repeats": args.repeats, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(summary, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(next(iter(summary.values())))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(summary)
    for k, (name, s) in enumerate(summary.items()):
        xs = [i + k * width for i in range(len(cases))]
        ax1.bar(xs, [s[c]["median_wall_s"] for c in cases], width, label=name)
        ax2.bar(xs, [s[c]["median_peak_rss_mib"] for c in cases], width, label=name)
    for ax, title in ((ax1, "wall time, s (median)"), (ax2, "peak RSS, MiB (median)")):
        ax.set_xticks([i + width * (len(summary) - 1) / 2 for i in range(len(cases))], cases)
        ax.set_title(title)
        ax.legend()
    ax1.axhline(1.5, color="gray", ls=":", lw=1)
    ax2.axhline(900, color="gray", ls=":", lw=1)
    fig.suptitle("eaglekv start-up, SmolLM2-135M Q4_1 GGUF, CPU (targets dotted: warm 1.5 s, 900 MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
