"""Prometheus metrics of one server. Two families:

- `eaglekv:*` with vLLM's names and meanings (so a vLLM dashboard works after replacing the
  `vllm:` prefix): requests running/waiting, KV-cache usage, preemptions, token counters,
  TTFT, inter-token latency, end-to-end latency, finished requests by reason, and the
  speculative counters `spec_decode_num_drafts` (verify steps), `..._num_draft_tokens`
  (tokens proposed), `..._num_accepted_tokens` (drafts accepted, bonus excluded) and
  `..._num_accepted_tokens_per_pos{position}` (drafts whose token at that depth was accepted).
- the older `eaglekv_*` names, kept for existing scrapes.
- `eaglekv:cuda_memory_{allocated,reserved}_bytes`: the server process's torch CUDA memory,
  read at each scrape (bench/soak_gpu.py follows them over a soak).

Engine-side figures are read on the engine thread (`refresh`), whenever the loop has changed
something: after every step, and after every abort or submit between steps, so the gauges do
not lie while the engine idles.
"""

from __future__ import annotations

import functools
import time

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eaglekv.core import SpecStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)


def _cuda_memory(read: str) -> float:
    """torch.cuda.<read>() of the current device, 0 in a process that never used CUDA."""
    return float(getattr(torch.cuda, read)()) if torch.cuda.is_initialized() else 0.0


class Metrics:
    """One registry per app (several servers may live in one test process)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        m = {"registry": r}
        lbl = ["model_name"]
        self.model_name = model_name
        # ---- vLLM names --------------------------------------------------------------------
        self.running = Gauge("eaglekv:num_requests_running", "requests in the batch", lbl, **m)
        self.waiting = Gauge("eaglekv:num_requests_waiting", "requests queued", lbl, **m)
        self.kv_usage = Gauge("eaglekv:kv_cache_usage_perc", "KV slots in use (0..1)", lbl, **m)
        # ---- the server process's CUDA memory, read at every scrape (0 until CUDA is used) ----
        for name, read in (("allocated", "memory_allocated"), ("reserved", "memory_reserved")):
            Gauge(f"eaglekv:cuda_memory_{name}_bytes", f"torch.cuda.{read}() of the current "
                  "device", **m).set_function(functools.partial(_cuda_memory, read))
        self.preemptions = Counter("eaglekv:num_preemptions", "requests preempted", lbl, **m)
        self.prompt = Counter("eaglekv:prompt_tokens", "prompt tokens of finished requests",
                              lbl, **m)
        self.generation = Counter("eaglekv:generation_tokens", "generated tokens", lbl, **m)
        self.success = Counter("eaglekv:request_success", "finished requests",
                               lbl + ["finished_reason"], **m)
        self.ttft = Histogram("eaglekv:time_to_first_token_seconds", "submit to first token",
                              lbl, buckets=LATENCY_BUCKETS, **m)
        self.itl = Histogram("eaglekv:inter_token_latency_seconds",
                             "between two consecutive token deliveries of a request", lbl,
                             buckets=ITL_BUCKETS, **m)
        self.e2e = Histogram("eaglekv:e2e_request_latency_seconds", "submit to last token",
                             lbl, buckets=LATENCY_BUCKETS, **m)
        self.drafts = Counter("eaglekv:spec_decode_num_drafts", "verify steps (one per "
                              "request per speculative step)", lbl, **m)
        self.draft_tokens = Counter("eaglekv:spec_decode_num_draft_tokens",
                                    "draft tokens proposed (verify nodes minus the root)",
                                    lbl, **m)
        self.accepted = Counter("eaglekv:spec_decode_num_accepted_tokens",
                                "draft tokens accepted (bonus tokens not counted)", lbl, **m)
        self.accepted_pos = Counter("eaglekv:spec_decode_num_accepted_tokens_per_pos",
                                    "verify steps whose draft token at this depth was accepted",
                                    lbl + ["position"], **m)
        self.choices = Counter("eaglekv:spec_decode_steps_by_choice", "engine decode steps by "
                               "what adaptive speculation chose (plain, S3K1N4, "
                               "S3K1N4+plain: a split batch, ...)", lbl + ["choice"], **m)
        self.http = Counter("eaglekv:http_responses", "HTTP responses by status code",
                            ["status"], **m)
        # ---- older names -------------------------------------------------------------------
        self.requests = Counter("eaglekv_requests", "finished HTTP generation requests",
                                ["endpoint", "status"], **m)
        self.old_prompt = Counter("eaglekv_prompt_tokens", "prompt tokens", **m)
        self.old_generation = Counter("eaglekv_generation_tokens", "generated tokens", **m)
        self.old_verify = Counter("eaglekv_spec_verify_steps", "speculative verify steps", **m)
        self.old_accepted = Counter("eaglekv_spec_accepted_tokens",
                                    "draft tokens accepted (bonus tokens not counted)", **m)
        self.old_running = Gauge("eaglekv_num_requests_running", "requests in the batch", **m)
        self.old_waiting = Gauge("eaglekv_num_requests_waiting", "requests queued", **m)
        self.old_latency = Histogram("eaglekv_request_latency_seconds", "submit to last token",
                                     **m)
        self.old_ttft = Histogram("eaglekv_time_to_first_token_seconds",
                                  "submit to first token", **m)
        self._seen_spec = SpecStats(accept_histogram={})
        self._seen_preemptions = 0

    def _l(self, counter, **labels):
        return counter.labels(model_name=self.model_name, **labels)

    # ---- engine thread -------------------------------------------------------------------------
    def refresh(self, engine) -> None:
        """Gauges from the engine's books; speculation and preemption counters by difference."""
        running, waiting = len(engine.running), len(engine.waiting)
        for g, v in ((self.running, running), (self.waiting, waiting)):
            self._l(g).set(v)
        self.old_running.set(running)
        self.old_waiting.set(waiting)
        alloc = engine.allocator
        self._l(self.kv_usage).set(alloc.num_used() / alloc.size)
        if engine.num_preemptions > self._seen_preemptions:
            self._l(self.preemptions).inc(engine.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = engine.num_preemptions
        st = engine.spec_stats()
        if st is not None:
            self._count_spec(st)

    def _count_spec(self, st: SpecStats) -> None:
        seen = self._seen_spec
        for choice, count in (st.choices or {}).items():
            new = count - (seen.choices or {}).get(choice, 0)
            if new > 0:
                self._l(self.choices, choice=choice).inc(new)
        if st.choices:
            seen.choices = dict(st.choices)
        steps = st.verify_steps - seen.verify_steps
        if steps <= 0:
            return
        self._l(self.drafts).inc(steps)
        self._l(self.draft_tokens).inc(st.draft_tokens - seen.draft_tokens)
        self._l(self.accepted).inc(st.accepted_tokens - seen.accepted_tokens)
        self.old_verify.inc(steps)
        self.old_accepted.inc(st.accepted_tokens - seen.accepted_tokens)
        # histogram key k = tokens a step gave (accepted + bonus): depths 0..k-2 were accepted
        for k, count in st.accept_histogram.items():
            new = count - seen.accept_histogram.get(k, 0)
            for pos in range(k - 1):
                if new:
                    self._l(self.accepted_pos, position=str(pos)).inc(new)
        self._seen_spec = SpecStats(st.verify_steps, st.draft_tokens, st.accepted_tokens,
                                    dict(st.accept_histogram), seen.choices)

    def token_delivered(self, stream, now: float) -> None:
        """A delta with tokens reached a request's stream (engine thread)."""
        if stream.first_token_at is None:
            stream.first_token_at = now
        else:
            self._l(self.itl).observe(now - stream.last_token_at)
        stream.last_token_at = now

    # ---- asyncio side --------------------------------------------------------------------------
    def finished(self, stream, completion_tokens: int, finish_reason: str | None) -> None:
        now = time.perf_counter()
        n_prompt = len(stream.req.prompt_ids)
        self._l(self.prompt).inc(n_prompt)
        self._l(self.generation).inc(completion_tokens)
        self._l(self.success, finished_reason=finish_reason or "length").inc()
        self._l(self.e2e).observe(now - stream.submitted_at)
        self.old_prompt.inc(n_prompt)
        self.old_generation.inc(completion_tokens)
        self.old_latency.observe(now - stream.submitted_at)
        if stream.first_token_at is not None:
            self._l(self.ttft).observe(stream.first_token_at - stream.submitted_at)
            self.old_ttft.observe(stream.first_token_at - stream.submitted_at)
