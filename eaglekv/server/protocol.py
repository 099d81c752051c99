"""OpenAI request bodies (the fields eaglekv serves) and their mapping to SamplingParams.

Unknown fields are refused with a 400 that names them (nothing is dropped silently); known
OpenAI fields that eaglekv does not implement are accepted only at their no-op values. Extras
as in vLLM: `top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`. Logprobs: `logprobs` (an int) for
completions, `logprobs` + `top_logprobs` for chat, at most 20 alternatives. Defaults follow the OpenAI API:
temperature 1.0, max_tokens 16 for completions, `default_max_tokens` of the server for chat.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from eaglekv.config import MAX_TOP_LOGPROBS, SamplingParams


MAX_N = 128   # choices of one request: each is a request of its own in the engine


class RequestRefused(ValueError):
    """A well-formed request that asks for something eaglekv does not do (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0                # a vLLM extra
    user: str | None = None                        # an end-user id: accepted, not used
    # OpenAI fields accepted only at their no-op values
    logit_bias: dict | None = None

    def refuse_unsupported(self) -> None:
        for name, default in (("logit_bias", None),):
            if getattr(self, name) not in (default, {}):
                raise RequestRefused(f"{name}={getattr(self, name)!r} is not supported "
                                     f"(only {default!r})", name)
        if not 1 <= self.n <= MAX_N:
            raise RequestRefused(f"n={self.n} must be in [1, {MAX_N}]", "n")

    def sampling_params(self, default_max_tokens: int, index: int = 0) -> SamplingParams:
        """`index` (0..n-1) offsets the seed, so the n choices of one request differ."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if max_tokens < 1:
            raise RequestRefused(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids),
                              seed=None if self.seed is None else self.seed + index,
                              ignore_eos=self.ignore_eos, logprobs=self.engine_logprobs(),
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty)

    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many alternatives each token gets."""
        return None


def check_top(name: str, value: int) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestRefused(f"{name}={value} must be in [0, {MAX_TOP_LOGPROBS}]", name)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None      # the legacy API: the chosen token's and the top N

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            check_top("logprobs", self.logprobs)
        if self.echo:
            raise RequestRefused("echo=true is not supported", "echo")
        if self.suffix:
            raise RequestRefused("suffix is not supported", "suffix")
        if self.best_of not in (None, 1, self.n):
            raise RequestRefused(f"best_of={self.best_of} is not supported", "best_of")

    def prompts(self) -> list:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestRefused("prompt is empty", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestRefused("top_logprobs needs logprobs=true", "top_logprobs")
            check_top("top_logprobs", self.top_logprobs)
        if not self.messages:
            raise RequestRefused("messages is empty", "messages")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise RequestRefused("max_tokens and max_completion_tokens differ",
                                     "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                for m in self.messages]
