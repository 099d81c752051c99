"""Server-sent events of one HTTP call's streams (its n choices of each prompt), with usage
(at the end, or so far in every chunk: vLLM's `continuous_usage_stats`) and spec stats."""

from __future__ import annotations

import asyncio
import json

from eaglekv.core import SpecStats
from eaglekv.server.http_errors import failure_json


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class SSE:
    """Stream i is choice i % n of prompt i // n. `chunk(text, finish_reason, i, logprobs=)`
    builds a chunk; `first(i)` choice i's opening chunk (chat); `logprobs(i, lps)` a chunk's
    logprobs block, when asked for (then every new token is sent, even one whose text is
    still held back). Every stream is aborted if the client leaves, whenever it leaves."""

    def __init__(self, loop, metrics, streams, n: int, endpoint: str, chunk, *,
                 include_usage: bool, continuous_usage: bool, first=None, logprobs=None):
        self.loop, self.metrics, self.streams, self.n = loop, metrics, streams, n
        self.endpoint, self.chunk, self.first, self.logprobs = endpoint, chunk, first, logprobs
        self.include_usage, self.continuous = include_usage, continuous_usage
        self.counts = [0] * len(streams)
        self.reasons: list[str | None] = [None] * len(streams)
        self.done = False

    @staticmethod
    def spec_json(stats: list[SpecStats | None]) -> dict | None:
        stats = [s for s in stats if s is not None]
        if not stats:
            return None
        total = SpecStats(verify_steps=sum(s.verify_steps for s in stats),
                          draft_tokens=sum(s.draft_tokens for s in stats),
                          accepted_tokens=sum(s.accepted_tokens for s in stats))
        return {"verify_steps": total.verify_steps, "draft_tokens": total.draft_tokens,
                "accepted_tokens": total.accepted_tokens,
                "accept_length_mean": total.accept_length_mean}

    def abort_all(self) -> None:
        """Also the response's background task: runs even if the client left before the first
        event, when the generator never started."""
        if not self.done:
            for s in self.streams:
                self.loop.abort(s)
            self.metrics.requests.labels(self.endpoint, "aborted").inc()
            self.done = True

    def _with_usage(self, c: dict, i: int) -> dict:
        if self.continuous:
            c["usage"] = usage(len(self.streams[i].req.prompt_ids), self.counts[i])
        return c

    async def events(self):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream):
            try:
                async for delta in stream:
                    queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - the engine failed this request
                queue.put_nowait((i, e))
        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            for i in range(len(self.streams) if self.first else 0):
                yield data(self._with_usage(self.first(i), i))
            left = len(self.streams)
            while left:
                i, delta = await queue.get()
                if delta is None:
                    left -= 1
                    continue
                if isinstance(delta, Exception):
                    raise delta
                self.counts[i] += len(delta.token_ids)
                self.reasons[i] = delta.finish_reason or self.reasons[i]
                lp = (self.logprobs(i, delta.logprobs) if self.logprobs and delta.token_ids
                      else None)
                if delta.text or delta.finish_reason or lp is not None \
                        or (self.continuous and delta.token_ids):
                    yield data(self._with_usage(
                        self.chunk(delta.text, delta.finish_reason, i, logprobs=lp), i))
            self.done = True
            for s, k, why in zip(self.streams, self.counts, self.reasons):
                self.metrics.finished(s, k, why)
            self.metrics.requests.labels(self.endpoint, "ok").inc()
            if self.include_usage:
                last = self.chunk("", None)
                last["choices"] = []
                n_prompt = sum(len(s.req.prompt_ids) for s in self.streams[::self.n])
                last["usage"] = usage(n_prompt, sum(self.counts))
                spec = self.spec_json([s.req.spec_stats for s in self.streams])
                if spec is not None:
                    last["spec"] = spec
                yield data(last)
        except Exception as e:  # noqa: BLE001 - the engine failed a request of this call
            self.done = True
            for s in self.streams:
                self.loop.abort(s)
            self.metrics.requests.labels(self.endpoint, "error").inc()
            yield data(failure_json(e)[1])
        finally:
            for t in pumps:
                t.cancel()
            self.abort_all()   # client disconnected (the generator was closed) or a crash
        yield "data: [DONE]\n\n"
