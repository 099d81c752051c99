"""The generation flow both /v1/completions and /v1/chat/completions share, as plain
functions over the ServerState: `begin` watches for a hang-up from the first moment; then
`generate` tokenizes, submits every sub-request in one visit to the engine thread, and either
streams them (SSE) or collects them into one response. A client that leaves is answered 499
and nothing is left running for it."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from eaglekv.server.http_errors import error_json
from eaglekv.server.loop import Stream
from eaglekv.server.responses import SSE, usage
from eaglekv.server.state import ServerState


async def wait_disconnect(request: Request, every: float = 0.1) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(every)


def begin(st: ServerState, request: Request, body, prefix: str) -> None:
    """Watch for a hang-up from the first moment of a generation request; then refuse it if
    it asks for another model or for what is not served."""
    request.state.watch = asyncio.ensure_future(wait_disconnect(request))
    request.state.rid = f"{prefix}-{request.state.request_id}"
    request.state.created = int(time.time())
    st.check_model(body.model)
    body.refuse_unsupported()


async def submit(st: ServerState, watch: asyncio.Future, ids: list[list[int]], body,
                 default_max: int) -> list[Stream] | None:
    """Stream i * n + j is choice j of prompt i. None when the client has already gone
    (nothing is left running for it)."""
    params = [body.sampling_params(default_max, j) for j in range(body.n)]
    if watch.done():
        return None
    streams = await st.loop.submit_many([(p, sp) for p in ids for sp in params],
                                        group=st.next_group())
    if watch.done():   # it left while we were queueing: no work for nobody
        for s in streams:
            st.loop.abort(s)
        return None
    return streams


def gone(st: ServerState, endpoint: str) -> JSONResponse:
    st.metrics.requests.labels(endpoint, "aborted").inc()
    return JSONResponse(status_code=499, content=error_json(499, "client closed the request"))


async def collect(st: ServerState, streams: list[Stream], endpoint: str, watch: asyncio.Future):
    """All outputs of a non-streaming request; None if the client went away first (then its
    requests are aborted and their KV freed)."""
    results = asyncio.gather(*(s.result() for s in streams))
    await asyncio.wait([results, watch], return_when=asyncio.FIRST_COMPLETED)
    if not results.done():
        results.cancel()
        results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        for s in streams:
            st.loop.abort(s)
        return None
    try:
        outputs = results.result()
    except BaseException:
        for s in streams:
            st.loop.abort(s)
        st.metrics.requests.labels(endpoint, "error").inc()
        raise
    for s, o in zip(streams, outputs):
        st.metrics.finished(s, len(o.token_ids), o.finish_reason)
    st.metrics.requests.labels(endpoint, "ok").inc()
    return outputs


def response(st: ServerState, request: Request, obj: str, outputs, n: int,
             choices: list[dict]) -> dict:
    resp = {"id": request.state.rid, "object": obj, "created": request.state.created,
            "model": st.model_name, "choices": choices,
            "usage": usage(sum(len(o.prompt_token_ids) for o in outputs[::n]),  # per prompt
                           sum(len(o.token_ids) for o in outputs))}
    spec = SSE.spec_json([o.spec for o in outputs])
    if spec is not None:
        resp["spec"] = spec
    return resp


def stream(st: ServerState, streams: list[Stream], body, endpoint: str, chunk, first,
           logprobs) -> StreamingResponse:
    opts = body.stream_options
    sse = SSE(st.loop, st.metrics, streams, body.n, endpoint, chunk,
              include_usage=bool(opts and opts.include_usage),
              continuous_usage=bool(opts and opts.continuous_usage_stats),
              first=first, logprobs=logprobs)
    return StreamingResponse(sse.events(), media_type="text/event-stream",
                             background=BackgroundTask(sse.abort_all))


async def generate(st: ServerState, request: Request, body, endpoint: str, obj: str,
                   prompts_ids, default_max: int, chunk, choice, first=None, logprobs=None):
    """The part both endpoints share: submit, then stream or collect. `prompts_ids()` gives
    the token ids of every prompt; `chunk`, `first` and `logprobs` build the SSE events (see
    SSE), `choice(i, output)` a non-streaming response's choice i."""
    watch = request.state.watch
    try:
        ids = await prompts_ids()
        streams = await submit(st, watch, ids, body, default_max)
        if streams is None:
            return gone(st, endpoint)
        if body.stream:
            return stream(st, streams, body, endpoint, chunk, first, logprobs)
        outputs = await collect(st, streams, endpoint, watch)
        if outputs is None:
            return gone(st, endpoint)
        return response(st, request, obj, outputs, body.n,
                        [choice(i, o) for i, o in enumerate(outputs)])
    finally:   # a stream's hang-up is seen by Starlette from here on
        watch.cancel()
