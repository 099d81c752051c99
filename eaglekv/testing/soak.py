"""A soak load for `eaglekv serve` (issue 16): `concurrency` clients (the official openai
client) send completions and chat requests, streamed or not, greedy or sampled, for a bounded
time; a random `poison_rate` of them are poisoned:

    bad_sampling   an invalid sampling value (temperature -1, top_p 5, n 0, logprobs 99):
                   must be answered 400 (openai.BadRequestError)
    huge_body      a prompt past the server's body limit: must be answered 413
    hangup_stream  a stream closed by the client after its first chunk
    hangup_wait    a non-streaming request whose client gives up after 0.2 s

Besides, each client's second request is poisoned (client i with kind i % 4), so every
kind comes up in a run. Every other request must be answered: 200, text present, finish_reason "length" or "stop",
1 <= completion tokens <= max_tokens. `sample` (if given) is called about once a second and
its value recorded (the server's RSS in the benches). Used by bench/soak_cpu.py and by the
slow tier's short soak (tests/server/test_soak.py).
"""

from __future__ import annotations

import random
import statistics
import threading
import time

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "def fibonacci(n):", "List three primary colours.", "Once upon a time",
           "Explain what a KV cache is in one sentence."]
POISONS = ("bad_sampling", "huge_body", "hangup_stream", "hangup_wait")
BAD_SAMPLING = ({"temperature": -1.0}, {"top_p": 5.0}, {"n": 0}, {"logprobs": 99})


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = 0
        self.failed: list[str] = []
        self.poisoned = {p: 0 for p in POISONS}
        self.poison_unexpected: list[str] = []
        self.latencies: list[float] = []
        self.completion_tokens = 0

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                cur = getattr(self, k)
                if isinstance(cur, list):
                    cur.append(v)
                else:
                    setattr(self, k, cur + v)


def _normal(client, rng: random.Random, model: str, tally: Tally) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    max_tokens = rng.randint(2, 8)
    kw = dict(model=model, max_tokens=max_tokens, temperature=rng.choice([0.0, 0.7]),
              seed=rng.randrange(1000))
    prompt = rng.choice(PROMPTS)
    t0 = time.perf_counter()
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        if stream:
            text, finish, n = "", None, 0
            for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
                    n += 1
        else:
            r = client.chat.completions.create(messages=msgs, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            n = r.usage.completion_tokens
    else:
        if stream:
            text, finish, n = "", None, 0
            for ch in client.completions.create(prompt=prompt, stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].text or ""
                    finish = ch.choices[0].finish_reason or finish
                    n += 1
        else:
            r = client.completions.create(prompt=prompt, **kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            n = r.usage.completion_tokens
    if finish not in ("length", "stop") or text is None or not 1 <= n <= max_tokens + 1:
        raise AssertionError(f"bad answer: finish={finish!r} chunks/tokens={n} text={text!r}")
    tally.add(ok=1, latencies=time.perf_counter() - t0, completion_tokens=n)


def _poisoned(client, rng: random.Random, model: str, kind: str, huge: int,
              tally: Tally) -> None:
    import openai
    try:
        if kind == "bad_sampling":
            bad = rng.choice(BAD_SAMPLING)
            try:
                client.completions.create(model=model, prompt="Hi", max_tokens=4, **bad)
            except openai.BadRequestError:
                pass
            else:
                raise AssertionError(f"{bad} was accepted")
        elif kind == "huge_body":
            try:
                client.completions.create(model=model, prompt="x " * (huge // 2 + 1024),
                                          max_tokens=4)
            except openai.APIStatusError as e:
                if e.status_code != 413:
                    raise AssertionError(f"huge body answered {e.status_code}") from None
            else:
                raise AssertionError("a huge body was accepted")
        elif kind == "hangup_stream":
            s = client.completions.create(model=model, prompt=rng.choice(PROMPTS),
                                          max_tokens=64, stream=True)
            next(iter(s), None)
            s.close()
        else:   # hangup_wait
            try:
                client.with_options(timeout=0.2).completions.create(
                    model=model, prompt=rng.choice(PROMPTS), max_tokens=64)
            except (openai.APITimeoutError, openai.APIConnectionError):
                pass
        with tally.lock:
            tally.poisoned[kind] += 1
    except Exception as e:  # noqa: BLE001 - recorded, the caller judges
        tally.add(poison_unexpected=f"{kind}: {type(e).__name__}: {str(e)[:200]}")


def run_load(base_url: str, model: str, duration_s: float, concurrency: int = 8,
             poison_rate: float = 0.01, seed: int = 0, sample=None,
             huge_bytes: int = 4 * 2**20, every_kind: bool = True) -> dict:
    """Drive the server for `duration_s`; returns counts, latencies and the samples.
    `every_kind`: besides the random ones, client i's second request is poisoned with kind
    i % 4, so that every kind comes up while the other clients' requests run."""
    import openai
    tally = Tally()
    stop = threading.Event()
    t_start = time.perf_counter()
    samples: list[tuple[float, float]] = []

    def sampler():
        while not stop.is_set():
            samples.append((time.perf_counter() - t_start, sample()))
            stop.wait(1.0)

    def worker(i: int):
        rng = random.Random(seed * 1000 + i)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        sent = 0
        while time.perf_counter() - t_start < duration_s:
            sent += 1
            if every_kind and sent == 2:
                _poisoned(client, rng, model, POISONS[i % len(POISONS)], huge_bytes, tally)
                continue
            if rng.random() < poison_rate:
                _poisoned(client, rng, model, rng.choice(POISONS), huge_bytes, tally)
                continue
            try:
                _normal(client, rng, model, tally)
            except Exception as e:  # noqa: BLE001
                tally.add(failed=f"{type(e).__name__}: {str(e)[:200]}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(concurrency)]
    if sample is not None:
        threads.append(threading.Thread(target=sampler, daemon=True))
    for t in threads:
        t.start()
    for t in threads[:concurrency]:
        t.join()
    stop.set()
    for t in threads[concurrency:]:
        t.join()
    lat = sorted(tally.latencies)
    return {"duration_s": round(time.perf_counter() - t_start, 1), "concurrency": concurrency,
            "poison_rate": poison_rate, "answered_ok": tally.ok, "failed": len(tally.failed),
            "failures": tally.failed[:20], "poisoned": tally.poisoned,
            "poisoned_total": sum(tally.poisoned.values()),
            "poison_unexpected": tally.poison_unexpected[:20],
            "completion_tokens": tally.completion_tokens,
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
            "samples": samples}
