"""A short stream's time to first token beside a long prompt and beside a 128-way fan-out, on
`eaglekv serve` (in process, SmolLM2 on CPU), under the fairness rule (engine/fairness.py)
and, side by side in the same process and engine, under the previous commit's rule (prefill
budget in arrival order, admission first come first served), at two chunked_prefill_size.

    PYTHONPATH=. .venv/bin/python bench/serve_fairness.py [OUT_DIR]

Each scenario: the heavy call is sent, the short stream (max_tokens 4, greedy) starts 0.5 s
later, and its TTFT is taken at its first token; then the heavy call hangs up (its requests
are aborted). Writes serve_fairness_cpu.json and .png to OUT_DIR (default bench/results).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from unittest import mock

import httpx

from eaglekv.config import EngineConfig
from eaglekv.engine import Engine
from eaglekv.server.local import LocalServer

MODEL = "bench"
SHORT = "Say hello."
LONG_TOKENS = 4000
FANOUT_N = 128


def fifo_shares(demands, budget):   # the previous rule: the budget in arrival order
    out, left = [], max(budget, 0)
    for d in demands:
        out.append(min(d, left))
        left -= out[-1]
    return out


def fifo_next(waiting, per_group):  # the previous rule: first come, first served
    return 0


def short_ttft(url: str) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": SHORT, "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - t0
    raise RuntimeError("the short stream gave no text")


def heavy(url: str, body: dict, stop: threading.Event) -> None:
    """Send the heavy call as a stream and hang up when told (its requests are aborted)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=300,
                          json={"model": MODEL, "stream": True, **body}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass


def scenario(server: LocalServer, kind: str, long_ids: list[int]) -> float:
    bodies = {"long": {"prompt": long_ids, "max_tokens": 4},
              "fanout": {"prompt": "Count to ten.", "n": FANOUT_N, "max_tokens": 32,
                         "ignore_eos": True}}
    if kind == "alone":
        return short_ttft(server.url)
    stop = threading.Event()
    t = threading.Thread(target=heavy, args=(server.url, bodies[kind], stop), daemon=True)
    t.start()
    time.sleep(0.5)
    try:
        return short_ttft(server.url)
    finally:
        stop.set()
        t.join(300)
        server.wait_idle(300)


def main(out_dir: str = "bench/results") -> dict:
    engine = Engine(EngineConfig(model="default", max_total_tokens=16384,
                                 max_running_requests=8))
    long_ids = [int(x) for x in (list(range(1000, 1000 + LONG_TOKENS)))]
    server = LocalServer(engine, MODEL, max_sub_requests=FANOUT_N)
    rows = []
    try:
        short_ttft(server.url)   # warm-up
        for chunk in (2048, 512):
            engine.config = dataclasses.replace(engine.config, chunked_prefill_size=chunk)
            for rule in ("fair", "previous"):
                patches = ([] if rule == "fair" else
                           [mock.patch("eaglekv.engine.scheduler.prefill_shares", fifo_shares),
                            mock.patch("eaglekv.engine.scheduler.next_to_admit", fifo_next)])
                for p in patches:
                    p.start()
                try:
                    for kind in ("alone", "long", "fanout"):
                        ttfts = [scenario(server, kind, long_ids) for _ in range(2)]
                        rows.append({"chunked_prefill_size": chunk, "rule": rule,
                                     "beside": kind, "ttft_s": ttfts,
                                     "ttft_median_s": statistics.median(ttfts)})
                        print(json.dumps(rows[-1]), flush=True)
                finally:
                    for p in patches:
                        p.stop()
    finally:
        server.stop()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": f"cpu ({platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores)",
              "command": "PYTHONPATH=. .venv/bin/python bench/serve_fairness.py " + out_dir,
              "model": "SmolLM2-135M-Instruct fp32", "long_prompt_tokens": LONG_TOKENS,
              "fanout_n": FANOUT_N, "max_running_requests": 8, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "serve_fairness_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "serve_fairness_cpu.png"))
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    labels = [f"{r['beside']}\nchunk {r['chunked_prefill_size']}" for r in rows
              if r["rule"] == "fair"]
    fair = [r["ttft_median_s"] for r in rows if r["rule"] == "fair"]
    prev = [r["ttft_median_s"] for r in rows if r["rule"] == "previous"]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], prev, 0.4, label="previous rule (arrival order, FCFS)")
    ax.bar([i + 0.2 for i in x], fair, 0.4, label="fair rule (max-min prefill, per-call)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("short stream TTFT, s (median of 2)")
    ax.set_title(f"TTFT beside a {LONG_TOKENS}-token prompt / an n={FANOUT_N} call\n"
                 f"{result['device']}, {result['date']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
