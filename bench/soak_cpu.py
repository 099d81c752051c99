"""CPU soak of `eaglekv serve` (issue 16): the default model (SmolLM2-135M, fp32) with its
EAGLE head (adaptive), in its own process, under `concurrency` openai clients for a bounded
time, 1% of the requests poisoned (eaglekv/testing/soak.py says how). The server's RSS is
sampled every second; after the run the server must be idle with no KV slot in use.

    PYTHONPATH=. .venv/bin/python bench/soak_cpu.py [--duration 90] [--concurrency 8]
        [--poison-rate 0.01] [--out bench/results]

Writes soak_cpu.json (counts, latencies, RSS samples, the verdicts) and soak_cpu.png (RSS over
time). Exit status 1 if a request failed, a poisoned one was answered wrongly, a slot leaked
or RSS grew past the bound after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from eaglekv.testing.soak import run_load

MODEL = "smollm2"
RSS_BOUND_MB = 50.0   # growth allowed from the first post-warm-up minute to the end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--poison-rate", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before RSS counts")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.setdefault("EAGLEKV_CACHE", tempfile.mkdtemp(prefix="eaglekv_soak_"))
    cmd = [os.path.join(os.path.dirname(sys.executable), "eaglekv"), "serve", "--model",
           "default", "--spec",
           "eagle", "--draft", "default", "--port", str(port), "--served-model-name", MODEL,
           "--max-running-requests", "8"]
    log = open(os.path.join(tempfile.gettempdir(), "eaglekv_soak_server.log"), "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}); see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server did not come up in 300 s")
            time.sleep(0.5)
        load_before = os.getloadavg()
        proc = psutil.Process(server.pid)
        rss = lambda: proc.memory_info().rss / 2**20  # noqa: E731
        started_rss = rss()
        res = run_load(url, MODEL, args.duration, args.concurrency, args.poison_rate,
                       args.seed, sample=rss)
        idle_deadline = time.time() + 120        # hung-up requests are aborted, then idle
        while (metric(url, "eaglekv:num_requests_running")
               + metric(url, "eaglekv:num_requests_waiting") > 0
               or metric(url, "eaglekv:kv_cache_usage_perc") > 0):
            if time.time() > idle_deadline:
                break
            time.sleep(0.5)
        idle = {k: metric(url, "eaglekv:" + k) for k in
                ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        alive = server.poll() is None
        load_after = os.getloadavg()
    finally:
        server.terminate()
        server.wait(30)
    samples = res.pop("samples")
    after = [m for t, m in samples if t >= args.warmup]
    first_min = [m for t, m in samples if args.warmup <= t < args.warmup + 60] or after[:1]
    growth = (statistics_mean(after[-10:]) - statistics_mean(first_min)) if after else None
    slope = slope_mb_per_min([(t, m) for t, m in samples if t >= args.warmup])
    verdict = {
        "every_request_answered": res["failed"] == 0,
        "poison_answered_as_expected": not res["poison_unexpected"],
        "server_idle_no_kv_in_use": all(v == 0 for v in idle.values()),
        "server_alive": alive,
        "rss_flat_after_warmup": growth is not None and growth < RSS_BOUND_MB,
    }
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch threads as the CLI sets",
        "command": "PYTHONPATH=. .venv/bin/python bench/soak_cpu.py " + " ".join(sys.argv[1:]),
        "server": " ".join(["eaglekv"] + cmd[1:]),
        "model": "SmolLM2-135M-Instruct fp32 + shipped EAGLE head (adaptive)",
        # the machine is shared: latencies depend on what else runs (1/5/15-min averages)
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        **res, "requests_total": res["answered_ok"] + res["failed"] + res["poisoned_total"]
        + len(res["poison_unexpected"]),
        "rss_mb_at_start": round(started_rss, 1),
        "rss_mb_after_warmup_first_minute_mean": round(statistics_mean(first_min), 1),
        "rss_mb_last_10s_mean": round(statistics_mean(after[-10:]), 1),
        "rss_growth_after_warmup_mb": None if growth is None else round(growth, 1),
        "rss_slope_after_warmup_mb_per_min": None if slope is None else round(slope, 2),
        "rss_bound_mb": RSS_BOUND_MB, "warmup_s": args.warmup,
        "idle_after": idle, "verdict": verdict, "ok": all(verdict.values()),
        "rss_samples": [(round(t, 1), round(m, 1)) for t, m in samples],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak_cpu.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.join(args.out, "soak_cpu.png"))
    print(json.dumps({k: v for k, v in out.items() if k != "rss_samples"}, indent=1))
    return 0 if out["ok"] else 1


def statistics_mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def slope_mb_per_min(points) -> float | None:
    """Least-squares slope of RSS over time, MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (m - mm) for t, m in points) / var if var else None


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s[0] for s in out["rss_samples"]]
    m = [s[1] for s in out["rss_samples"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, m, lw=1.5, label="server RSS")
    ax.axvline(out["warmup_s"], color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("RSS, MiB")
    ax.set_ylim(0, max(m) * 1.15 if m else 1)
    ax.set_title(f"eaglekv serve soak: {out['requests_total']} requests "
                 f"({out['poisoned_total']} poisoned, {out['failed']} failed), "
                 f"{out['concurrency']} clients, {out['duration_s']} s; RSS growth after warm-up "
                 f"{out['rss_growth_after_warmup_mb']} MiB\n{out['device']}, {out['date']}\n"
                 f"{out['command']}", fontsize=7)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
