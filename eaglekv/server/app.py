"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models, /tokenize, /detokenize, /version, /health and Prometheus /metrics.

One request can harm no other: prompts are tokenized on worker threads, not on the engine
thread; a body over the limit is refused (413) before it is parsed; one call's sub-requests
(prompts x n) are capped and submitted in one visit to the engine thread, watched for a
hang-up from the start; a request whose sampling fails, fails alone. Every error has the
OpenAI shape `{"error": {"message", "type", "param", "code"}}` (see http_errors.py)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

import eaglekv
from eaglekv.errors import EaglekvError
from eaglekv.server.http_errors import (ModelNotFound, error_body, error_json,
                                        install_error_handlers)
from eaglekv.server.logprobs import LogprobFormatter
from eaglekv.server.loop import EngineLoop, Stream
from eaglekv.server.metrics import Metrics
from eaglekv.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from eaglekv.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     RequestRefused, TokenizeRequest)
from eaglekv.server.responses import SSE, usage
from eaglekv.server.settings import ServerConfig
from eaglekv.server.tokenize import Tokenization

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions
log = logging.getLogger("eaglekv.server")


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
            return error_body(500, f"{type(e).__name__}: {e}")
    return wrapper


def create_app(loop: EngineLoop, config: ServerConfig | str = "default",
               default_max_tokens: int | None = None) -> FastAPI:
    """`config`: the ServerConfig, or just the served model name (with `default_max_tokens`)."""
    if isinstance(config, str):
        config = ServerConfig(model_name=config, **(
            {} if default_max_tokens is None else {"default_max_tokens": default_max_tokens}))
    model_name = config.model_name
    app = FastAPI(title="eaglekv", version=eaglekv.__version__)
    metrics = Metrics(model_name)
    loop.on_change, loop.on_tokens = metrics.refresh, metrics.token_delivered
    tok = Tokenization(loop.engine.tokenizer, config.chat_template)
    app.state.loop, app.state.metrics, app.state.tokenization = loop, metrics, tok
    app.router.on_shutdown.append(tok.close)
    install_error_handlers(app)
    # outermost last: request id -> API key -> body limit -> routes
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware, metrics=metrics)
    calls = itertools.count(1)   # one group per HTTP call, for the scheduler's fairness rule
    max_len = loop.engine.max_context_len

    async def wait_disconnect(request: Request, every: float = 0.1) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(every)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFound(f"model '{name}' does not exist; this server serves "
                                f"'{model_name}'")

    def check_total(n_prompts: int, n: int) -> None:
        if n_prompts * n > config.max_sub_requests:
            raise RequestRefused(f"{n_prompts} prompts x n={n} = {n_prompts * n} sub-requests "
                                 f"exceed the limit of {config.max_sub_requests} per call "
                                 f"(--max-sub-requests)", "n" if n > 1 else "prompt")

    async def submit(request: Request, watch: asyncio.Future, ids: list[list[int]], body,
                     default_max: int) -> list[Stream] | None:
        """Stream i * n + j is choice j of prompt i. None when the client has already gone
        (nothing is left running for it)."""
        params = [body.sampling_params(default_max, j) for j in range(body.n)]
        if watch.done():
            return None
        streams = await loop.submit_many([(p, sp) for p in ids for sp in params],
                                         group=next(calls))
        if watch.done():   # it left while we were queueing: no work for nobody
            for s in streams:
                loop.abort(s)
            return None
        return streams

    def gone(endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, "aborted").inc()
        return JSONResponse(status_code=499, content=error_json(499, "client closed the "
                                                                "request"))

    async def collect(streams: list[Stream], endpoint: str, watch: asyncio.Future):
        """All outputs of a non-streaming request; None if the client went away first (then
        its requests are aborted and their KV freed)."""
        results = asyncio.gather(*(s.result() for s in streams))
        await asyncio.wait([results, watch], return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            results.cancel()
            results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
            for s in streams:
                loop.abort(s)
            return None
        try:
            outputs = results.result()
        except BaseException:
            for s in streams:
                loop.abort(s)
            metrics.requests.labels(endpoint, "error").inc()
            raise
        for s, o in zip(streams, outputs):
            metrics.finished(s, len(o.token_ids), o.finish_reason)
        metrics.requests.labels(endpoint, "ok").inc()
        return outputs

    def response(rid: str, obj: str, created: int, outputs, n: int, choices: list[dict]) -> dict:
        resp = {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in outputs[::n]),  # per prompt
                               sum(len(o.token_ids) for o in outputs))}
        spec = SSE.spec_json([o.spec for o in outputs])
        if spec is not None:
            resp["spec"] = spec
        return resp

    def request_id(request: Request, prefix: str) -> str:
        return f"{prefix}-{request.state.request_id}"

    async def generate(request: Request, body, endpoint: str, obj: str, prompts_ids,
                       default_max: int, chunk, choice, first=None, logprobs=None):
        """The part both endpoints share: submit, then stream or collect."""
        watch = request.state.watch
        try:
            ids = await prompts_ids()
            streams = await submit(request, watch, ids, body, default_max)
            if streams is None:
                return gone(endpoint)
            if body.stream:
                opts = body.stream_options
                sse = SSE(loop, metrics, streams, body.n, endpoint, chunk,
                          include_usage=bool(opts and opts.include_usage),
                          continuous_usage=bool(opts and opts.continuous_usage_stats),
                          first=first, logprobs=logprobs)
                return StreamingResponse(sse.events(), media_type="text/event-stream",
                                         background=BackgroundTask(sse.abort_all))
            outputs = await collect(streams, endpoint, watch)
            if outputs is None:
                return gone(endpoint)
            return response(request.state.rid, obj, request.state.created, outputs, body.n,
                            [choice(i, o) for i, o in enumerate(outputs)])
        finally:   # a stream's hang-up is seen by Starlette from here on
            watch.cancel()

    def begin(request: Request, prefix: str) -> None:
        """Watch for a hang-up from the first moment of a generation request."""
        request.state.watch = asyncio.ensure_future(wait_disconnect(request))
        request.state.rid = request_id(request, prefix)
        request.state.created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": eaglekv.__version__}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "eaglekv",
                "root": loop.engine.config.model, "parent": None, "max_model_len": max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    @answers_500
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        body.check()
        if body.messages is not None:
            ids = await tok.chat(body.conversation(), body.add_generation_prompt)
        else:
            ids = await tok.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids}

    @app.post("/detokenize")
    @answers_500
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        body.check_vocab(loop.engine.model_config.vocab_size)
        return {"prompt": await tok.decode(body.tokens)}

    @app.post("/v1/completions")
    @answers_500
    async def completions(body: CompletionRequest, request: Request):
        begin(request, "cmpl")
        check_model(body.model)
        body.refuse_unsupported()
        prompts = body.prompts()
        check_total(len(prompts), body.n)
        rid, created = request.state.rid, request.state.created
        fmt = LogprobFormatter(loop.engine.tokenizer) if body.logprobs is not None else None

        def chunk(text, finish_reason, index=0, logprobs=None):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [{"index": index, "text": text,
                                                      "logprobs": logprobs,
                                                      "finish_reason": finish_reason}]}
        offsets: dict[int, int] = {}

        def block(i, lps):   # each choice's text offsets run on across its chunks
            b, offsets[i] = fmt.completion(lps, offsets.get(i, 0))
            return b

        def choice(i, o):
            return chunk(o.text, o.finish_reason, i,
                         fmt.completion(o.logprobs)[0] if fmt else None)["choices"][0]
        return await generate(request, body, "completions", "text_completion",
                              lambda: tok.prompts(prompts), COMPLETIONS_DEFAULT_MAX_TOKENS,
                              chunk, choice, logprobs=block if fmt else None)

    @app.post("/v1/chat/completions")
    @answers_500
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        begin(request, "chatcmpl")
        check_model(body.model)
        body.refuse_unsupported()
        check_total(1, body.n)
        if loop.engine.tokenizer is None:
            raise RequestRefused("this model has no tokenizer, so no chat template; use "
                                 "/v1/completions with token ids", "messages")
        conversation = body.conversation()
        rid, created = request.state.rid, request.state.created
        fmt = LogprobFormatter(loop.engine.tokenizer) if body.logprobs else None

        def chunk(text, finish_reason, index=0, logprobs=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model_name,
                    "choices": [{"index": index, "delta": {"content": text} if text else {},
                                 "logprobs": logprobs, "finish_reason": finish_reason}]}

        def first(i):
            c = chunk("", None, i)
            c["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return c

        def choice(i, o):
            return {"index": i, "message": {"role": "assistant", "content": o.text},
                    "logprobs": fmt.chat(o.logprobs) if fmt else None,
                    "finish_reason": o.finish_reason}

        async def ids():
            return [await tok.chat(conversation)]
        return await generate(request, body, "chat", "chat.completion", ids,
                              config.default_max_tokens, chunk, choice, first=first,
                              logprobs=(lambda i, lps: fmt.chat(lps)) if fmt else None)

    return app
