"""The server's own settings (the engine's live in EngineConfig), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from eaglekv.errors import ConfigError

MAX_REQUEST_BYTES = 4 * 2**20   # a request body above this is answered 413
MAX_SUB_REQUESTS = 256          # prompts x n of one call


@dataclass(frozen=True)
class ServerConfig:
    """`model_name`: the `model` clients must send. `default_max_tokens`: max_tokens of a chat
    request that does not set it. `api_key`: when set, every /v1 route and /tokenize,
    /detokenize need `Authorization: Bearer <key>` (401 otherwise). `chat_template`: a Jinja
    template used instead of the tokenizer's own. `max_request_bytes`: larger bodies get 413.
    `max_sub_requests`: prompts x n of one call (each is a request of its own in the engine)."""

    model_name: str = "default"
    default_max_tokens: int = 256
    api_key: str | None = None
    chat_template: str | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_sub_requests: int = MAX_SUB_REQUESTS

    def __post_init__(self):
        if not self.model_name:
            raise ConfigError("model_name must be a non-empty string")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens={self.default_max_tokens} must be >= 1")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must be non-empty when given (or None: no auth)")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes={self.max_request_bytes} must be >= 1024")
        if self.max_sub_requests < 1:
            raise ConfigError(f"max_sub_requests={self.max_sub_requests} must be >= 1")
