"""Host time of streaming text at batch B: B requests (SmolLM2's tokenizer) grow by chains of K
tokens (a CUDA-graph decode chain) up to L tokens each; after every chain each request's
`stream_delta()` runs, as the server's engine loop does. Times the stream_delta calls of the
chains past L/2 (ms a chain for the whole batch). No model runs: the token runs are a real
SmolLM2 text's, cycled. Run it in two trees to compare commits (the text path of the tree on
sys.path is the one timed).

    python bench/stream_detok.py [--batch 64] [--chain 32] [--length 2000] [--stop] [--out F]
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

import torch  # noqa: E402

from eaglekv.config import SamplingParams  # noqa: E402
from eaglekv.engine.request import Req  # noqa: E402
from eaglekv.model.loader import default_model_path  # noqa: E402
from eaglekv.model.tokenizer import load_gguf_tokenizer  # noqa: E402

TEXT = ("Streaming detokenization: café, naïve, Grüße, 東京, 🙂 — each chunk of tokens becomes "
        "text the client sees as it comes. def f(x):\n    return [x ** 2 for x in range(9)]\n")


def run(batch: int, chain: int, length: int, stop: bool) -> dict:
    tok = load_gguf_tokenizer(default_model_path())
    run_ids = tok.encode(TEXT * (length // 20 + 2), add_special_tokens=False)[:length]
    params = SamplingParams(max_new_tokens=length, ignore_eos=True,
                            stop=("<never seen>",) if stop else ())
    reqs = [Req(rid=i, prompt_ids=[1], params=params, generator=torch.Generator(),
                eos_ids=frozenset(), tokenizer=tok) for i in range(batch)]
    times, sent = [], [0] * batch
    for start in range(0, length, chain):
        t = time.perf_counter()
        for i, r in enumerate(reqs):
            r.append_tokens(run_ids[start:start + chain])
            d = r.stream_delta()
            sent[i] += len(d.text) if d else 0
        if start >= length // 2:
            times.append(time.perf_counter() - t)
    assert all(r.finished for r in reqs)
    return {"batch": batch, "chain": chain, "length": length, "stop_strings": stop,
            "ms_per_chain_median": 1e3 * statistics.median(times),
            "ms_per_chain_all": [1e3 * x for x in times], "chars_sent": sent[0],
            "text_equals_whole_decode": reqs[0].text == tok.decode(run_ids,
                                                                   skip_special_tokens=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--stop", action="store_true", help="with a stop string (never hit)")
    ap.add_argument("--out")
    a = ap.parse_args()
    r = run(a.batch, a.chain, a.length, a.stop)
    print(f"batch {a.batch} chain {a.chain} length {a.length} stop {a.stop}: "
          f"{r['ms_per_chain_median']:.2f} ms a chain (second half)")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": f"host only, {platform.processor() or platform.machine()}",
            "command": "python " + " ".join(sys.argv), **r}, indent=1))


if __name__ == "__main__":
    main()
