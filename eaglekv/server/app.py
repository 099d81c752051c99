"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models, /tokenize, /detokenize, /version, /health and Prometheus /metrics.

One request can harm no other: prompts are tokenized on worker threads, not on the engine
thread; a body over the limit is refused (413) before it is parsed; one call's sub-requests
(prompts x n) are capped and submitted in one visit to the engine thread, watched for a
hang-up from the start; a request whose sampling fails, fails alone. Every error has the
OpenAI shape `{"error": {"message", "type", "param", "code"}}` (see http_errors.py).

Layout: state.py (what the routes share), generate.py (the generation flow),
routes_openai.py (completions, chat), routes_misc.py (the rest), middleware.py."""

from __future__ import annotations

from fastapi import FastAPI

from eaglekv.version import __version__
from eaglekv.server import routes_misc, routes_openai
from eaglekv.server.http_errors import answers_500, install_error_handlers
from eaglekv.server.loop import EngineLoop
from eaglekv.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from eaglekv.server.settings import ServerConfig
from eaglekv.server.state import ServerState

__all__ = ["answers_500", "create_app"]


def create_app(loop: EngineLoop, config: ServerConfig | str = "default",
               default_max_tokens: int | None = None) -> FastAPI:
    """`config`: the ServerConfig, or just the served model name (with `default_max_tokens`)."""
    if isinstance(config, str):
        config = ServerConfig(model_name=config, **(
            {} if default_max_tokens is None else {"default_max_tokens": default_max_tokens}))
    app = FastAPI(title="eaglekv", version=__version__)

    # 1. state: what every route reads (request.app.state.server)
    st = ServerState.start(loop, config)
    app.state.server = st
    app.state.loop, app.state.metrics, app.state.tokenization = loop, st.metrics, st.tokenization
    app.router.on_shutdown.append(st.tokenization.close)

    # 2. error handlers: every error in the OpenAI shape
    install_error_handlers(app)

    # 3. middleware, outermost last: request id -> API key -> body limit -> routes
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware, metrics=st.metrics)

    # 4. routers
    app.include_router(routes_misc.router)
    app.include_router(routes_openai.router)
    return app
