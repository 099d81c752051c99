"""GPU soak of `eaglekv serve` (issue 16): the server on CUDA with the GPU fast path (Triton
attention, CUDA graphs on, speculation `--spec eagle --draft default`), in its own process,
under `--concurrency` clients (default 64) for `--seconds` (default 240); a random
`--poison-rate` (1%) of the requests poisoned as in the CPU soak (eaglekv/testing/soak.py):

    bad_sampling   temperature -1, top_p 5, n 0 or logprobs 99: must be answered 400
    huge_body      a prompt past the server's 4 MiB body limit: must be answered 413
    hangup_stream  a stream whose client closes the socket after the first chunk
    hangup_wait    a non-streaming request whose client gives up after 0.2 s

and each client's second request poisoned with kind i % 4, so every kind comes up. Every
request's outcome is recorded; every second the server's RSS (/proc) and its torch CUDA
memory (allocated / reserved: the `eaglekv:cuda_memory_*_bytes` gauges of /metrics, read in
the server process). The client side is the standard library alone (the GPU machine has no
openai client); the server needs fastapi, uvicorn and prometheus-client (carry them as wheels
where they are missing) and, for the default model, the staged GGUF (`--model PATH`).

    PYTHONPATH=. python3 bench/soak_gpu.py [--seconds 240] [--concurrency 64]
        [--model default] [--device cuda] [--dtype bfloat16] [--out bench/results]
    PYTHONPATH=. .venv/bin/python bench/soak_gpu.py --device cpu --seconds 20   # smoke test

Writes soak_<device>_gpu-path.json (date, device, exact command, every request, the memory
samples, the verdicts) and .png (RSS and CUDA memory over time) under --out. Exit status 1 if
a normal request failed, a poisoned one was answered wrongly, the server did not end idle
with no KV slot in use, or memory grew past its bound after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three primary colours.", "Once upon a time",
           "Explain what a KV cache is in one sentence."]
POISONS = ("bad_sampling", "huge_body", "hangup_stream", "hangup_wait")
BAD_SAMPLING = ({"temperature": -1.0}, {"top_p": 5.0}, {"n": 0}, {"logprobs": 99})
HUGE_BYTES = 4 * 2**20            # eaglekv/server/settings.py MAX_REQUEST_BYTES
RSS_BOUND_MB = 100.0              # growth allowed from the first post-warm-up minute to the end
CUDA_BOUND_MB = 64.0              # the same for torch's reserved CUDA memory


# ---- the client: http.client over one connection per request ----------------------------------
def post(port: int, path: str, body: dict | bytes, timeout: float = 300.0, first_only=False):
    """(status, parsed JSON or list of SSE events); first_only: close after the first chunk."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if first_only:
            r.readline()
            return r.status, None                         # the socket closes below: a hang-up
        if r.getheader("content-type", "").startswith("text/event-stream"):
            events = []
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
            return r.status, events
        raw = r.read()
        return r.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def normal(port: int, rng: random.Random) -> dict:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    max_tokens = rng.randint(4, 16)
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.7]),
            "seed": rng.randrange(1000), "stream": stream}
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    status, res = post(port, "/v1/chat/completions" if chat else "/v1/completions", body)
    rec = {"kind": "chat" if chat else "completion", "stream": stream, "status": status}
    if status != 200:
        raise AssertionError(f"status {status}: {str(res)[:200]}")
    if stream:
        text, finish, n = "", None, 0
        for ev in res:
            for c in ev.get("choices", []):
                text += (c.get("delta", {}).get("content") if chat else c.get("text")) or ""
                finish = c.get("finish_reason") or finish
                n += 1
    else:
        c = res["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        finish, n = c["finish_reason"], res["usage"]["completion_tokens"]
    if finish not in ("length", "stop") or text is None or not 1 <= n <= max_tokens + 1:
        raise AssertionError(f"bad answer: finish={finish!r} chunks/tokens={n} text={text!r}")
    return {**rec, "tokens": n}


def poisoned(port: int, rng: random.Random, kind: str) -> dict:
    if kind == "bad_sampling":
        bad = rng.choice(BAD_SAMPLING)
        status, _ = post(port, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                   "max_tokens": 4, **bad})
        if status != 400:
            raise AssertionError(f"{bad} answered {status}")
    elif kind == "huge_body":
        status, _ = post(port, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x " * (HUGE_BYTES // 2 + 1024), "max_tokens": 4}).encode())
        if status != 413:
            raise AssertionError(f"a huge body answered {status}")
    elif kind == "hangup_stream":
        status, _ = post(port, "/v1/completions", {"model": MODEL, "prompt": rng.choice(PROMPTS),
                                                   "max_tokens": 64, "stream": True},
                         first_only=True)
    else:
        try:
            status, _ = post(port, "/v1/completions", {"model": MODEL, "max_tokens": 64,
                                                       "prompt": rng.choice(PROMPTS)},
                             timeout=0.2)
        except (socket.timeout, TimeoutError, ConnectionError):
            status = None
    return {"kind": kind, "status": status}


def run_load(port: int, seconds: float, concurrency: int, rate: float, seed: int) -> list:
    """Every request's record: client, start time, kind, status, latency, ok / error."""
    records, lock = [], threading.Lock()
    t0 = time.perf_counter()

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        sent = 0
        while time.perf_counter() - t0 < seconds:
            sent += 1
            kind = (POISONS[i % 4] if sent == 2 else
                    rng.choice(POISONS) if rng.random() < rate else None)
            start = time.perf_counter()
            rec = {"client": i, "t": round(start - t0, 3), "poison": kind is not None}
            try:
                rec.update(poisoned(port, rng, kind) if kind else normal(port, rng))
                rec["ok"] = True
            except Exception as e:  # noqa: BLE001 - recorded, the verdict judges
                rec.update(kind=rec.get("kind", kind or "normal"), ok=False,
                           error=f"{type(e).__name__}: {str(e)[:200]}")
            rec["latency_s"] = round(time.perf_counter() - start, 4)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


# ---- the server and its memory ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(port: int) -> dict[str, float]:
    """Every unlabelled-or-summed `eaglekv:` sample of /metrics, by name."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("eaglekv:"):
                name = line.split("{")[0].split(" ")[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sample_memory(port: int, pid: int, t0: float, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        try:
            m = metrics(port)
            out.append((round(time.perf_counter() - t0, 1), round(rss_mb(pid), 1),
                        round(m.get("eaglekv:cuda_memory_allocated_bytes", 0) / 2**20, 1),
                        round(m.get("eaglekv:cuda_memory_reserved_bytes", 0) / 2**20, 1),
                        m.get("eaglekv:num_requests_running", 0)))
        except Exception:  # noqa: BLE001 - a missed sample is only a gap in the curve
            pass
        stop.wait(1.0)


def wait_up(port: int, server: subprocess.Popen, log: str, limit: float = 900) -> None:
    deadline = time.time() + limit
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"the server did not come up in {limit} s; see {log}")
        time.sleep(0.5)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def growth(samples: list, col: int, warmup: float):
    """Mean of the last 10 samples minus the mean of the first post-warm-up minute."""
    after = [s[col] for s in samples if s[0] >= warmup]
    first = [s[col] for s in samples if warmup <= s[0] < warmup + 60] or after[:1]
    if not after:
        return None
    return round(sum(after[-10:]) / len(after[-10:]) - sum(first) / len(first), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--poison-rate", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before memory counts (default: a quarter of --seconds)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    warmup = args.warmup if args.warmup is not None else args.seconds / 4
    port = free_port()
    env = dict(os.environ)
    env.setdefault("EAGLEKV_CACHE", tempfile.mkdtemp(prefix="eaglekv_soak_"))
    cmd = [sys.executable, "-m", "eaglekv.cli", "serve", "--model", args.model, "--spec",
           "eagle", "--draft", "default", "--device", args.device, "--dtype", dtype, "--port",
           str(port), "--served-model-name", MODEL, "--max-running-requests",
           str(args.concurrency)]
    log = os.path.join(tempfile.gettempdir(), f"eaglekv_soak_{args.device}_server.log")
    with open(log, "w") as logf:
        server = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
    samples: list = []
    stop = threading.Event()
    try:
        wait_up(port, server, log)
        t0 = time.perf_counter()
        sampler = threading.Thread(target=sample_memory,
                                   args=(port, server.pid, t0, stop, samples), daemon=True)
        sampler.start()
        records = run_load(port, args.seconds, args.concurrency, args.poison_rate, args.seed)
        idle_deadline = time.time() + 120          # hung-up requests are aborted, then idle
        while True:
            m = metrics(port)
            busy = (m.get("eaglekv:num_requests_running", 0)
                    + m.get("eaglekv:num_requests_waiting", 0)
                    + m.get("eaglekv:kv_cache_usage_perc", 0))
            if not busy or time.time() > idle_deadline:
                break
            time.sleep(0.5)
        stop.set()
        sampler.join()
        alive = server.poll() is None
    finally:
        stop.set()
        server.terminate()
        server.wait(60)
    normal_recs = [r for r in records if not r["poison"]]
    poison_recs = [r for r in records if r["poison"]]
    lat = sorted(r["latency_s"] for r in normal_recs if r["ok"])
    g_rss, g_cuda = growth(samples, 1, warmup), growth(samples, 3, warmup)
    verdict = {
        "every_request_answered": all(r["ok"] for r in normal_recs) and bool(normal_recs),
        "poison_answered_as_expected": all(r["ok"] for r in poison_recs),
        "server_idle_no_kv_in_use": not busy,
        "server_alive": alive,
        "rss_flat_after_warmup": g_rss is not None and g_rss < RSS_BOUND_MB,
        "cuda_reserved_flat_after_warmup": not cuda or (g_cuda is not None
                                                        and g_cuda < CUDA_BOUND_MB),
    }
    tokens = sum(r.get("tokens", 0) for r in normal_recs if r["ok"])
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "command": "PYTHONPATH=. python3 bench/soak_gpu.py " + " ".join(sys.argv[1:]),
        "server": " ".join(["python3"] + cmd[1:]),
        "fast_path": ("Triton attention, CUDA graphs (decode, verify, speculative step), "
                      "EAGLE head (--spec eagle --draft default)") if cuda else
                     "CPU rehearsal: the same server and load, no CUDA graphs",
        "dtype": dtype, "seconds": args.seconds, "concurrency": args.concurrency,
        "poison_rate": args.poison_rate, "warmup_s": warmup,
        "requests_total": len(records), "normal_ok": sum(r["ok"] for r in normal_recs),
        "normal_failed": sum(not r["ok"] for r in normal_recs),
        "poisoned": {k: sum(r["kind"] == k for r in poison_recs) for k in POISONS},
        "poison_unexpected": [r for r in poison_recs if not r["ok"]][:20],
        "failures": [r for r in normal_recs if not r["ok"]][:20],
        "completion_tokens": tokens,
        "latency_p50_s": lat[len(lat) // 2] if lat else None,
        "latency_p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
        "rss_growth_after_warmup_mb": g_rss, "rss_bound_mb": RSS_BOUND_MB,
        "cuda_reserved_growth_after_warmup_mb": g_cuda, "cuda_bound_mb": CUDA_BOUND_MB,
        "verdict": verdict, "ok": all(verdict.values()),
        "samples_columns": ["t_s", "rss_mb", "cuda_allocated_mb", "cuda_reserved_mb",
                            "running"],
        "samples": samples, "requests": records,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"soak_{'gpu' if cuda else 'cpu_gpu-path'}")
    with open(stem + ".json", "w") as f:
        json.dump(out, f, indent=1)
    plot(out, stem + ".png")
    print(json.dumps({k: v for k, v in out.items() if k not in ("samples", "requests")},
                     indent=1))
    return 0 if out["ok"] else 1


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = out["samples"]
    t = [x[0] for x in s]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [x[1] for x in s], lw=1.5, label="server RSS")
    ax.plot(t, [x[2] for x in s], lw=1.5, label="CUDA allocated (torch)")
    ax.plot(t, [x[3] for x in s], lw=1.5, ls="--", label="CUDA reserved (torch)")
    ax.axvline(out["warmup_s"], color="grey", ls=":", lw=1, label="end of warm-up")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("MiB")
    ax.set_title(f"eaglekv serve soak: {out['requests_total']} requests "
                 f"({sum(out['poisoned'].values())} poisoned, {out['normal_failed']} failed), "
                 f"{out['concurrency']} clients, {out['seconds']} s; growth after warm-up RSS "
                 f"{out['rss_growth_after_warmup_mb']} MiB, CUDA reserved "
                 f"{out['cuda_reserved_growth_after_warmup_mb']} MiB\n{out['device']}, "
                 f"{out['date']}\n{out['command']}", fontsize=7)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
