"""Logprobs in the OpenAI response formats, from the engine's TokenLogprob lists.

Each token is shown as its own decoded text (`tokenizer.decode([id])`, as vLLM does), or as
`token_id:N` for a model without a tokenizer. Completions get the legacy format (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`); chat gets `content`, a
list of {token, logprob, bytes, top_logprobs}.
"""

from __future__ import annotations

from eaglekv.core import TokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token(self, tid: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])

    def completion(self, lps: list[TokenLogprob], offset: int = 0) -> tuple[dict, int]:
        """The legacy block for `lps`, whose first token starts at text offset `offset`;
        returns it and the offset after the last token (for the next stream chunk)."""
        tokens, offsets = [], []
        for lp in lps:
            tokens.append(self.token(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        block = {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                 "top_logprobs": [{self.token(t): v for t, v in lp.top} for lp in lps],
                 "text_offset": offsets}
        return block, offset

    def _entry(self, tid: int, logprob: float) -> dict:
        text = self.token(tid)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, lps: list[TokenLogprob]) -> dict:
        return {"content": [self._entry(lp.token_id, lp.logprob)
                            | {"top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps],
                "refusal": None}
