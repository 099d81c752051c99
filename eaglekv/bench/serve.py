"""`eaglekv bench-serve`: the OpenAI server under concurrent clients vs the engine called
directly, side by side in one run.

The same chat prompts go (1) straight to `Engine.chat`, one at a time and as one batch (no
HTTP: the ceilings), and (2) to an in-process server (uvicorn, `eaglekv.server`) from the official `openai` client
(AsyncOpenAI, streaming) at each concurrency level; greedy with EOS ignored, so every run
makes the same tokens. Reported per run: output tokens/s over the wall time, time to first
token and request latency (median and p90), and whether every server answer equals the
direct one. With --spec the same is repeated on a speculative engine.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import statistics
import time

from eaglekv.config import EngineConfig, SamplingParams, SpecConfig
from eaglekv.engine import Engine

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a bicycle stays upright.", "List five uses of vinegar.",
           "What is the difference between weather and climate?",
           "Give me a recipe for pancakes.", "Describe the water cycle.",
           "Why do cats purr?", "Summarise the plot of Romeo and Juliet."]
MODEL_NAME = "bench"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _clients(url: str, concurrency: int, max_tokens: int) -> tuple[float, list[dict]]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    todo = list(enumerate(PROMPTS))
    done: list[dict] = []

    async def worker():
        while todo:
            i, prompt = todo.pop(0)
            t0 = time.perf_counter()
            first, parts, tokens = None, [], 0
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    first = first or time.perf_counter()
                    parts.append(c.choices[0].delta.content)
                if c.usage is not None:
                    tokens = c.usage.completion_tokens
            done.append({"i": i, "text": "".join(parts), "tokens": tokens,
                         "ttft": (first or time.perf_counter()) - t0,
                         "latency": time.perf_counter() - t0})
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, sorted(done, key=lambda d: d["i"])


def bench_engine(engine: Engine, label: str, levels: list[int], max_tokens: int) -> list[dict]:
    from eaglekv.server.local import LocalServer
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    rows = []
    for mode, batches in (("direct Engine.chat, one at a time", [[c] for c in convs]),
                          ("direct Engine.chat, one batch", [convs])):
        t0 = time.perf_counter()
        direct = [o for b in batches for o in engine.chat(b, params)]
        wall = time.perf_counter() - t0
        n_tok = sum(len(o.token_ids) for o in direct)
        rows.append({"engine": label, "mode": mode, "concurrency": len(batches[0]),
                     "output_tokens": n_tok, "wall_s": wall, "tokens_per_s": n_tok / wall})
    server = LocalServer(engine, MODEL_NAME)
    try:
        for c in levels:
            wall, res = asyncio.run(_clients(server.url, c, max_tokens))
            toks = sum(r["tokens"] for r in res)
            rows.append({
                "engine": label, "mode": "server, openai client, streaming", "concurrency": c,
                "output_tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
                "ttft_s_p50": statistics.median(r["ttft"] for r in res),
                "ttft_s_p90": _quantile([r["ttft"] for r in res], 0.9),
                "latency_s_p50": statistics.median(r["latency"] for r in res),
                "latency_s_p90": _quantile([r["latency"] for r in res], 0.9),
                "identical_to_direct": [r["text"] for r in res] == [o.text for o in direct]})
    finally:
        server.stop()
    return rows


def main(args) -> None:
    levels = [int(x) for x in args.concurrency.split(",")]
    base = dict(model=args.model, dtype=args.dtype, device=args.device,
                page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                max_running_requests=args.max_running_requests)
    engines = [("plain", SpecConfig())]
    if args.spec != "none":
        engines.append((args.spec, SpecConfig(algorithm=args.spec, draft_model=args.draft,
                                              num_steps=args.num_steps, topk=args.topk,
                                              num_draft_tokens=args.num_draft_tokens)))
    rows = []
    for label, spec in engines:
        engine = Engine(EngineConfig(**base, speculative=spec))
        rows += bench_engine(engine, label, levels, args.max_tokens)
        del engine
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {platform.processor() or ''} "
                         f"{os.cpu_count()} cpus".strip(),
              "command": getattr(args, "command_line", "eaglekv bench-serve"),
              "prompts": len(PROMPTS), "max_tokens": args.max_tokens, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
