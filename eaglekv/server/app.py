"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models, /health and Prometheus /metrics. Errors are OpenAI-style bodies:
`{"error": {"message", "type", "param", "code"}}` with 400 for a bad request, 404 for an
unknown model, 500 when the engine failed the request's batch (the server keeps serving)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from eaglekv.core import Output, SpecStats
from eaglekv.errors import EaglekvError, KVIndexError
from eaglekv.server.logprobs import LogprobFormatter
from eaglekv.server.loop import EngineLoop, Stream
from eaglekv.server.protocol import ChatCompletionRequest, CompletionRequest, RequestRefused

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions
log = logging.getLogger("eaglekv.server")


class ModelNotFound(LookupError):
    pass


class Metrics:
    """One registry per app (several servers may live in one test process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("eaglekv_requests", "finished HTTP generation requests",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("eaglekv_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("eaglekv_generation_tokens", "generated tokens",
                                         registry=r)
        self.verify_steps = Counter("eaglekv_spec_verify_steps", "speculative verify steps",
                                    registry=r)
        self.accepted = Counter("eaglekv_spec_accepted_tokens",
                                "draft tokens accepted (bonus tokens not counted)", registry=r)
        self.running = Gauge("eaglekv_num_requests_running", "requests in the batch",
                             registry=r)
        self.waiting = Gauge("eaglekv_num_requests_waiting", "requests queued", registry=r)
        self.latency = Histogram("eaglekv_request_latency_seconds", "submit to last token",
                                 registry=r)
        self.ttft = Histogram("eaglekv_time_to_first_token_seconds", "submit to first token",
                              registry=r)

    def on_step(self, engine) -> None:
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))

    def finished(self, stream: Stream, completion_tokens: int, spec: SpecStats | None) -> None:
        now = time.perf_counter()
        self.prompt_tokens.inc(len(stream.req.prompt_ids))
        self.generation_tokens.inc(completion_tokens)
        self.latency.observe(now - stream.submitted_at)
        if stream.first_token_at is not None:
            self.ttft.observe(stream.first_token_at - stream.submitted_at)
        if spec is not None:
            self.verify_steps.inc(spec.verify_steps)
            self.accepted.inc(spec.accepted_tokens)


def error_json(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_body(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_json(status, message, type_, param))


def answers_500(route):
    """Any unexpected exception of a route becomes an OpenAI-style 500 here. (Starlette's
    catch-all handler re-raises after answering, and the connection may be reset before the
    client reads the body.) The known errors go on to their own handlers."""
    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except (EaglekvError, RequestRefused, ModelNotFound):
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("request failed")
            return error_body(500, f"{type(e).__name__}: {e}", "internal_error")
    return wrapper


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


def create_app(loop: EngineLoop, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    """`default_max_tokens`: max_tokens of a chat request that does not set it."""
    app = FastAPI(title="eaglekv", version="0.1.0")
    metrics = Metrics()
    loop.on_step = metrics.on_step
    app.state.loop, app.state.metrics = loop, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        msg = (f"unknown field '{where}'" if err.get("type") == "extra_forbidden"
               else f"{where}: {err.get('msg')}")
        return error_body(400, msg, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(RequestRefused)
    async def _refused(_, exc: RequestRefused):
        return error_body(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(EaglekvError)
    async def _engine_refused(_, exc: EaglekvError):
        if isinstance(exc, KVIndexError):
            return error_body(500, f"{type(exc).__name__}: {exc}", "internal_error")
        return error_body(400, f"{type(exc).__name__}: {exc}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):   # a bug, not the client's fault: still a JSON body
        return error_body(500, f"{type(exc).__name__}: {exc}", "internal_error")

    @app.exception_handler(ModelNotFound)
    async def _no_model(_, exc: ModelNotFound):
        return error_body(404, str(exc), "invalid_request_error", "model")

    async def wait_disconnect(request: Request, every: float = 0.2) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(every)

    def check_model(name: str) -> None:
        if name != model_name:
            raise ModelNotFound(f"model '{name}' does not exist; this server serves "
                                f"'{model_name}'")

    async def submit_all(prompts: list, body, default_max: int) -> list[Stream]:
        streams: list[Stream] = []
        try:
            for p in prompts:
                for j in range(body.n):
                    streams.append(await loop.submit(p, body.sampling_params(default_max, j)))
        except BaseException:
            for s in streams:
                loop.abort(s)
            raise
        return streams

    async def collect(streams: list[Stream], endpoint: str, request: Request):
        """All outputs of a non-streaming request; None if the client went away first (then
        its requests are aborted and their KV freed)."""
        results = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait([results, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not results.done():
            results.cancel()
            for s in streams:
                loop.abort(s)
            metrics.requests.labels(endpoint, "aborted").inc()
            return None
        try:
            outputs = results.result()
        except BaseException:
            for s in streams:
                loop.abort(s)
            metrics.requests.labels(endpoint, "error").inc()
            raise
        for s, o in zip(streams, outputs):
            metrics.finished(s, len(o.token_ids), o.spec)
        metrics.requests.labels(endpoint, "ok").inc()
        return outputs

    def response(rid: str, obj: str, created: int, outputs: list[Output], n: int,
                 choices: list[dict]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])   # once per prompt
        completion = sum(len(o.token_ids) for o in outputs)
        resp = {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
        spec = spec_json([o.spec for o in outputs])
        if spec is not None:
            resp["spec"] = spec
        return resp

    async def sse(streams: list[Stream], n: int, endpoint: str, chunk, include_usage: bool,
                  first=None, logprobs=None):
        """Server-sent events of one request's streams (its n choices of each prompt, stream i
        being choice i), interleaved as their tokens come; every stream is aborted if the
        client leaves. `first(i)` is choice i's opening chunk; `logprobs(i, lps)` a chunk's
        logprobs block, when they were asked for (then every new token is sent, even one
        whose text is still held back)."""
        done, counts = False, [0] * len(streams)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: Stream):
            try:
                async for delta in stream:
                    queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - the engine failed this request's batch
                queue.put_nowait((i, e))
        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            for i in range(len(streams) if first else 0):
                yield f"data: {json.dumps(first(i))}\n\n"
            left = len(streams)
            while left:
                i, delta = await queue.get()
                if delta is None:
                    left -= 1
                    continue
                if isinstance(delta, Exception):
                    raise delta
                counts[i] += len(delta.token_ids)
                lp = logprobs(i, delta.logprobs) if logprobs and delta.token_ids else None
                if delta.text or delta.finish_reason or lp is not None:
                    c = chunk(delta.text, delta.finish_reason, i, logprobs=lp)
                    yield f"data: {json.dumps(c)}\n\n"
            done = True
            for s, k in zip(streams, counts):
                metrics.finished(s, k, s.req.spec_stats)
            metrics.requests.labels(endpoint, "ok").inc()
            if include_usage:
                n_prompt = sum(len(s.req.prompt_ids) for s in streams[::n])   # once a prompt
                last = chunk("", None)
                last["choices"] = []
                last["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": sum(counts),
                                 "total_tokens": n_prompt + sum(counts)}
                spec = spec_json([s.req.spec_stats for s in streams])
                if spec is not None:
                    last["spec"] = spec
                yield f"data: {json.dumps(last)}\n\n"
        except Exception as e:  # noqa: BLE001 - the engine failed this request's batch
            done = True
            for s in streams:
                loop.abort(s)
            metrics.requests.labels(endpoint, "error").inc()
            err = error_json(500, f"{type(e).__name__}: {e}", "internal_error")
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            for t in pumps:
                t.cancel()
            if not done:   # client disconnected (the generator was closed) or a crash
                for s in streams:
                    loop.abort(s)
                metrics.requests.labels(endpoint, "aborted").inc()
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "eaglekv"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    @answers_500
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.refuse_unsupported()
        prompts = body.prompts()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await submit_all(prompts, body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        fmt = LogprobFormatter(loop.engine.tokenizer) if body.logprobs is not None else None

        def chunk(text, finish_reason, index=0, logprobs=None):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [{"index": index, "text": text,
                                                      "logprobs": logprobs,
                                                      "finish_reason": finish_reason}]}
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            offsets = [0] * len(streams)

            def block(i, lps):   # each choice's text offsets run on across its chunks
                b, offsets[i] = fmt.completion(lps, offsets[i])
                return b
            return StreamingResponse(sse(streams, body.n, "completions", chunk, include,
                                         logprobs=block if fmt else None),
                                     media_type="text/event-stream")
        outputs = await collect(streams, "completions", request)
        if outputs is None:
            return JSONResponse(status_code=499, content=error_json(499, "client closed the "
                                "request", "aborted"))
        return response(rid, "text_completion", created, outputs, body.n,
                        [chunk(o.text, o.finish_reason, i,
                               fmt.completion(o.logprobs)[0] if fmt else None)["choices"][0]
                         for i, o in enumerate(outputs)])

    @app.post("/v1/chat/completions")
    @answers_500
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.refuse_unsupported()
        engine = loop.engine
        if engine.tokenizer is None:
            raise RequestRefused("this model has no tokenizer, so no chat template; use "
                                 "/v1/completions with token ids", "messages")
        conversation = body.conversation()   # tokenized on the engine thread, like prompts
        ids = await asyncio.wrap_future(loop.call(lambda e: e.apply_chat_template(conversation)))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await submit_all([ids], body, default_max_tokens)
        fmt = LogprobFormatter(engine.tokenizer) if body.logprobs else None

        def chunk(text, finish_reason, index=0, logprobs=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model_name,
                    "choices": [{"index": index, "delta": {"content": text} if text else {},
                                 "logprobs": logprobs, "finish_reason": finish_reason}]}
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)

            def first(i):
                c = chunk("", None, i)
                c["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                return c
            return StreamingResponse(sse(streams, body.n, "chat", chunk, include, first,
                                         logprobs=(lambda i, lps: fmt.chat(lps)) if fmt
                                         else None),
                                     media_type="text/event-stream")
        outputs = await collect(streams, "chat", request)
        if outputs is None:
            return JSONResponse(status_code=499, content=error_json(499, "client closed the "
                                "request", "aborted"))
        return response(rid, "chat.completion", created, outputs, body.n,
                        [{"index": i, "message": {"role": "assistant", "content": o.text},
                          "logprobs": fmt.chat(o.logprobs) if fmt else None,
                          "finish_reason": o.finish_reason}
                         for i, o in enumerate(outputs)])

    return app
