"""Req: one request's tokens, KV bookkeeping, stop rules and incremental text."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from eaglekv.config import SamplingParams
from eaglekv.core import Output, SpecStats, StreamDelta
from eaglekv.engine.detok import IncrementalDetokenizer
from eaglekv.errors import RequestFailed


# eq=False: a request is itself (identity equality and hash). The generated field-by-field
# __eq__ made every `req in running` compare whole requests: 5 ms of a batch-64 step's host time
@dataclass(eq=False)
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)   # TokenLogprob per output token
    row: int = 0                       # ReqToTokenPool row, 0 = not placed
    kv_len: int = 0                    # tokens whose K/V are in the cache
    last_slot: int = -1                # slot of position kv_len - 1
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: Exception | None = None     # why, when finish_reason == "error"
    group: Hashable = None             # admission fairness: the call it came from (engine.py)
    preempted: bool = False            # waiting again after a preemption: admitted first
    text: str = ""
    tokenizer: object = None
    draft_state: object = None         # speculative: the draft's root ([0] logits, [1] hidden:
                                       # a RootRow or a tuple), or the adaptive worker's Lag
    spec_stats: SpecStats | None = None
    _sent_text: int = 0
    _sent_tokens: int = 0
    _text_tokens: int = 0              # how many output tokens `text` reflects
    _detok: IncrementalDetokenizer | None = None   # `text` while running (engine/detok.py)

    @property
    def all_ids(self) -> list[int]:
        """The prompt and the output, one new list (O(length): not for a per-step path)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_ids(self) -> int:
        """len(all_ids), without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """len(pending_ids), without building it."""
        return self.num_ids - self.kv_len

    @property
    def pending_ids(self) -> list[int]:
        """Tokens to extend by in the next forward (the prompt, or the last sampled token),
        sliced from the prompt and the output without joining the whole sequence (a decode
        step of a long context reads one token)."""
        k, p = self.kv_len, len(self.prompt_ids)
        if k >= p:
            return self.output_ids[k - p:]
        return self.prompt_ids[k:] + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: Exception) -> None:
        """Finish this request alone with `error`; the engine frees its KV and row as for an
        abort, and the other requests of the step go on."""
        self.finish_reason, self.error = "error", error

    def fail_sampling(self) -> None:
        """Its distribution was not finite, had p < 0 or no mass (see sampler.valid_probs)."""
        p = self.params
        self.fail(RequestFailed(
            f"request {self.rid}: the sampling distribution is not finite (temperature="
            f"{p.temperature}, top_p={p.top_p}, top_k={p.top_k}, repetition_penalty="
            f"{p.repetition_penalty}, presence_penalty={p.presence_penalty}, "
            f"frequency_penalty={p.frequency_penalty}); this request failed alone after "
            f"{len(self.output_ids)} tokens. Values that pass SamplingParams validation keep "
            f"it finite; if these did, the model's logits were not finite (try float32)"))

    def refresh_text(self) -> str:
        """Decode the output (lazily: plain generation decodes once, at the end; a stream
        incrementally while running, then once whole at the end)."""
        if self.tokenizer is not None and self._text_tokens != len(self.output_ids) \
                and not (self.params.stop and self.finished):
            self._decode_output()
        return self.text

    def _decode_output(self) -> None:
        """`text` from the output: one whole decode once finished (the exact text), else the
        incremental decoder's (O(new tokens); the same text where decoding composes)."""
        if self.finished:
            self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        else:
            if self._detok is None:
                self._detok = IncrementalDetokenizer(
                    lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            self.text = self._detok.update(self.output_ids)
        self._text_tokens = len(self.output_ids)

    def append_tokens(self, tokens: list[int], logprobs: list | None = None) -> int:
        """Append tokens one by one until a stop rule fires; returns how many were kept.
        `logprobs` (TokenLogprob per token, when the request asked) is kept alongside."""
        p = self.params
        if logprobs is None and not p.stop:
            return self._append_plain(tokens)
        kept = 0
        for t in tokens:
            self.output_ids.append(t)
            if logprobs is not None:
                self.output_logprobs.append(logprobs[kept])
            kept += 1
            if (not p.ignore_eos and t in self.eos_ids) or t in p.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_new_tokens:
                self.finish_reason = "length"
            if p.stop and self._hit_stop_string():
                self.finish_reason = "stop"
            if self.finished:
                break
        return kept

    def _append_plain(self, tokens: list[int]) -> int:
        """append_tokens without stop strings or logprobs, in a few list operations (a step
        of a batch-64 speculative run appends to 64 requests): the first token that is a
        stop token or reaches max_new_tokens ends it, a stop token winning a tie, as the
        token-by-token loop decides."""
        end, reason = self._stop_point(tokens)
        self.output_ids.extend(tokens[:end])
        if reason is not None:
            self.finish_reason = reason
        return end

    def tokens_kept(self, tokens: list[int]) -> int:
        """How many of `tokens` appending would keep by the stop ids and max_new_tokens (stop
        strings aside: they need the text), without appending them."""
        return self._stop_point(tokens)[0]

    def _stop_point(self, tokens: list[int]) -> tuple[int, str | None]:
        p = self.params
        stops = p.stop_token_ids if p.ignore_eos else self.eos_ids.union(p.stop_token_ids)
        end, reason = len(tokens), None
        for k, t in enumerate(tokens):
            if t in stops:
                end, reason = k + 1, "stop"
                break
        room = max(p.max_new_tokens - len(self.output_ids), 1)
        if room < end or (room == end and reason is None):
            end, reason = room, "length"
        return end, reason

    def _hit_stop_string(self) -> bool:
        old_len = len(self.text)
        self._decode_output()
        longest = max(len(s) for s in self.params.stop)
        start = max(0, old_len - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def stream_delta(self) -> StreamDelta | None:
        """New text and tokens since the last call; text that may still change is held back
        (an unfinished UTF-8 sequence, or a possible start of a stop string)."""
        self.refresh_text()
        end = len(self.text)
        if not self.finished:
            while end > self._sent_text and self.text[end - 1] == "\ufffd":
                end -= 1
            if self.params.stop:
                end = max(self._sent_text, end - (max(len(s) for s in self.params.stop) - 1))
        toks = self.output_ids[self._sent_tokens:]
        delta = self.text[self._sent_text:end]
        if not delta and not toks and not self.finished:
            return None
        lps = (self.output_logprobs[self._sent_tokens:] if self.params.logprobs is not None
               else None)
        self._sent_text, self._sent_tokens = end, len(self.output_ids)
        return StreamDelta(text=delta, token_ids=toks, finish_reason=self.finish_reason,
                           logprobs=lps)

    def to_output(self) -> Output:
        return Output(text=self.refresh_text(), token_ids=list(self.output_ids),
                      finish_reason=self.finish_reason or "length",
                      prompt_token_ids=list(self.prompt_ids), spec=self.spec_stats,
                      logprobs=(list(self.output_logprobs) if self.params.logprobs is not None
                                else None))
