"""What the routes of one app share, built once by `create_app` and kept on
`app.state.server`: the engine loop, the server's config, its metrics and tokenization, the
model card's facts, and the call counter behind the scheduler's fairness groups. Routes get it
through the `Server` dependency."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Annotated, Iterator

from fastapi import Depends, Request

from eaglekv.server.http_errors import ModelNotFound
from eaglekv.server.loop import EngineLoop
from eaglekv.server.metrics import Metrics
from eaglekv.server.protocol import RequestRefused
from eaglekv.server.settings import ServerConfig
from eaglekv.server.tokenize import Tokenization


@dataclass
class ServerState:
    loop: EngineLoop
    config: ServerConfig
    metrics: Metrics
    tokenization: Tokenization
    max_model_len: int
    calls: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def start(cls, loop: EngineLoop, config: ServerConfig) -> ServerState:
        """Metrics hooked to the loop (gauges on every change, a count per token delivered),
        then the tokenizer's worker threads."""
        metrics = Metrics(config.model_name)
        loop.on_change, loop.on_tokens = metrics.refresh, metrics.token_delivered
        tokenization = Tokenization(loop.engine.tokenizer, config.chat_template)
        return cls(loop, config, metrics, tokenization, loop.engine.max_context_len)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def next_group(self) -> int:
        """One group per HTTP call, for the scheduler's fairness rule."""
        return next(self.calls)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "eaglekv",
                "root": self.loop.engine.config.model, "parent": None,
                "max_model_len": self.max_model_len}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'")

    def check_total(self, n_prompts: int, n: int) -> None:
        limit = self.config.max_sub_requests
        if n_prompts * n > limit:
            raise RequestRefused(f"{n_prompts} prompts x n={n} = {n_prompts * n} sub-requests "
                                 f"exceed the limit of {limit} per call "
                                 f"(--max-sub-requests)", "n" if n > 1 else "prompt")


def server_state(request: Request) -> ServerState:
    return request.app.state.server


Server = Annotated[ServerState, Depends(server_state)]
