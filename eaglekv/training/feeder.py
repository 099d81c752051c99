"""Keeping the engine full: a queue of jobs (a prompt, its SamplingParams, what to do with the
finished request) fed to `eaglekv.engine.Engine` with plain decoding, under a deadline.

The data stages (prompt_writer.py, selfgen.py) add requests in bulk and step the engine until
done; a finished request may queue more jobs (a follow-up question, a second turn).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from eaglekv.config import SamplingParams
from eaglekv.errors import RequestError


@dataclass
class Job:
    ids: list[int]
    params: SamplingParams
    done: object                  # done(req): called once the request finished (stop/length)


@dataclass
class Feeder:
    """Runs jobs on the engine: keeps up to `capacity` requests in it, steps it, hands each
    finished request to its job. New requests go in by batches of at least `admit_batch` (a
    quarter of the capacity by default): every admission is a prefill step, which breaks the
    engine's multi-step decode chain, so topping up one request per finished one would prefill
    nearly every step (on the H200 with 256 running, gen-data answered at 10k tok/s where plain
    batch-64 decoding runs 38k). Greedy and sampled requests are not mixed in the engine
    (`homogeneous`): only an all-greedy batch decodes multi-step chains inside CUDA graphs
    (ModelRunner.run_graph), so one sampled request among 255 greedy ones cost every one of
    them its chain. A job of the other kind waits (the first `lookahead` queued jobs are
    searched for one of the running kind) until the running ones end; then the kind switches.
    No job starts once the running ones could not end
    by `deadline` (drain = max_new x the mean step time); at `deadline` all still running are
    aborted and dropped. A step that raises fails only its requests (Engine.step): they are
    counted and dropped, and the run goes on (the error is raised after `max_errors`). Counts
    output tokens for tok/s."""

    engine: object
    capacity: int
    deadline: float = math.inf
    max_new: int = 256
    bar: object = None
    queue: deque = field(default_factory=deque)
    tokens: int = 0
    finished: int = 0
    aborted: int = 0              # stopped at the deadline, or once the caller had enough
    failed: int = 0               # an error, or too long for the context
    max_errors: int = 3
    cut: bool = False             # the deadline stopped it with work left
    seconds: float = 0.0
    _step_s: float = 0.0
    admit_batch: int | None = None    # None: capacity // 4 (at least 1)
    homogeneous: bool = True          # never greedy and sampled requests in the engine at once
    lookahead: int | None = None      # None: 4 x capacity
    switches: int = 0                 # how often the running kind was chosen afresh

    def _next_job(self, greedy: bool | None) -> Job | None:
        """The first queued job of kind `greedy` (any kind when None) among the first
        `lookahead`, taken out of the queue; None: there is none."""
        if not self.homogeneous or greedy is None:
            return self.queue.popleft()
        for i, job in enumerate(self.queue):
            if i >= (self.lookahead or 4 * self.capacity):
                break
            if job.params.greedy == greedy:
                del self.queue[i]
                return job
        return None

    def push(self, job: Job) -> None:
        self.queue.append(job)

    def run(self, refill=None, stop=None) -> None:
        """Until queue and engine are empty; `refill()` may push jobs when the queue runs
        short; `stop()` true: abort what runs and return (the caller has enough)."""
        active, t0, shown = {}, time.monotonic(), 0.0
        while True:
            if refill is not None and len(self.queue) < self.capacity:
                refill()
            now = time.monotonic()
            if now >= self.deadline or (stop is not None and stop()):
                self.cut = now >= self.deadline and bool(active or self.queue)
                break
            batch = self.admit_batch or max(1, self.capacity // 4)
            room = self.capacity - len(active) >= min(batch, len(self.queue)) or not active
            if room and now + min(self.max_new * self._step_s,
                                  0.5 * (self.deadline - t0)) < self.deadline:
                kind = next(iter(active.values())).params.greedy if active else None
                while self.queue and len(active) < self.capacity:
                    job = self._next_job(kind)
                    if job is None:           # only the other kind is queued: it waits
                        break
                    if kind is None and self.homogeneous:
                        kind = job.params.greedy
                        self.switches += 1
                    try:
                        active[self.engine.add_request(job.ids, job.params)] = job
                    except RequestError:      # too long for the context: skipped
                        self.failed += 1
            if not active:
                self.cut = bool(self.queue)
                break
            ts = time.monotonic()
            try:
                stepped = self.engine.step()
            except Exception as e:       # the step's requests failed; the engine serves on
                self.max_errors -= 1
                if self.max_errors < 0:
                    raise
                print(f"feeder: a step failed ({type(e).__name__}: {e}); its requests are "
                      f"dropped", file=sys.stderr)
                stepped = [r for r in active if r.finished]
            for req in stepped:
                if req.finished and req in active:
                    job = active.pop(req)
                    self.tokens += len(req.output_ids)
                    if req.finish_reason in ("stop", "length"):
                        self.finished += 1
                        job.done(req)
                    else:
                        self.failed += 1
            dt = time.monotonic() - ts
            self._step_s = dt if not self._step_s else 0.9 * self._step_s + 0.1 * dt
            if self.bar is not None and time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                live = self.tokens + sum(len(r.output_ids) for r in active)
                self.bar.set_postfix(tok=live, tok_s=f"{live / (shown - t0):.0f}",
                                     run=len(active))
        for req in list(active):
            self.engine.abort(req)
            self.tokens += len(req.output_ids)
            self.aborted += 1
        self.seconds += time.monotonic() - t0

    def stats(self) -> dict:
        return {"seconds": round(self.seconds, 2), "output_tokens": self.tokens,
                "tok_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
                "finished": self.finished, "aborted": self.aborted, "failed": self.failed,
                "cut_by_budget": self.cut, "kind_switches": self.switches}


def progress_bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="seq", disable=not progress, dynamic_ncols=True,
                file=sys.stderr)


def default_capacity(engine, capacity: int | None) -> int:
    """Requests kept in the engine: what it runs (a waiting one would be admitted, and
    prefilled, as soon as any request ends; see Feeder.admit_batch)."""
    return capacity or engine.config.max_running_requests


def sampled(temperature: float, rng: random.Random, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=kw.pop("top_p", 0.95),
                          seed=rng.randrange(2 ** 62), **kw)
