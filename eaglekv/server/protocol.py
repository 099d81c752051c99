"""OpenAI request bodies (the fields eaglekv serves) and their mapping to SamplingParams.

Unknown fields are refused with a 400 that names them (nothing is dropped silently); known
OpenAI fields that eaglekv does not implement are accepted only at their no-op values. Extras
as in vLLM: `top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`. Logprobs: `logprobs` (an int) for
completions, `logprobs` + `top_logprobs` for chat, at most 20 alternatives. Defaults follow the OpenAI API:
temperature 1.0, max_tokens 16 for completions, `default_max_tokens` of the server for chat.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from eaglekv.config import MAX_TOP_LOGPROBS, SamplingParams


MAX_N = 128   # choices of one request: each is a request of its own in the engine
SEED_RANGE = (-2**63, 2**64 - 1)   # what torch.Generator.manual_seed takes


class RequestRefused(ValueError):
    """A well-formed request that asks for something eaglekv does not do (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_text(value, param: str) -> None:
    """Strings must be encodable as UTF-8: JSON allows a lone surrogate ("\\ud800"), which no
    tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestRefused(f"{param} holds a lone surrogate at character {e.start} "
                                 f"({value[e.start]!r}): not valid Unicode text", param) from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_text(v, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: usage so far in every chunk


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
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
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
        if self.stream_options is not None and not self.stream:
            raise RequestRefused("stream_options is only allowed with stream=true",
                                 "stream_options")
        if self.seed is not None:
            lo, hi = SEED_RANGE[0], SEED_RANGE[1] - (self.n - 1)   # choice j is seeded seed + j
            if not lo <= self.seed <= hi:
                raise RequestRefused(f"seed={self.seed} must be in [{lo}, {hi}] (choice j of n="
                                     f"{self.n} uses seed + j, and seeds are 64-bit)", "seed")
        check_text(self.stop, "stop")

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
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
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
        check_text(self.prompt, "prompt")

    def prompts(self) -> list:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestRefused("prompt is empty", "prompt")
        return list(p)


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart], None]
    name: str | None = None

    def text(self, index: int) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does); None is
        allowed for an assistant turn only (a reply that held no text)."""
        where = f"messages.{index}.content"
        if self.content is None:
            if self.role != "assistant":
                raise RequestRefused(f"{where} is null; only an assistant message may have no "
                                     f"content", where)
            return ""
        if isinstance(self.content, str):
            check_text(self.content, where)
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise RequestRefused(f"{where}.{j}: content part of type {part.type!r} is not "
                                     f"supported (this model takes text parts only)", where)
            check_text(part.text, where)
            texts.append(part.text)
        return "\n".join(texts)


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
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them ("developer" is OpenAI's new "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(messages)]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestRefused("give exactly one of prompt and messages", "prompt")
        check_text(self.prompt, "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.tokens if not 0 <= t < vocab_size]
        if bad:
            raise RequestRefused(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                                 "tokens")
