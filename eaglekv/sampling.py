"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling.

`target_probs` is the distribution sampling draws from, kept separate so that speculative
acceptance can use exactly the same p. A row whose distribution is unusable (`valid_probs`,
`valid_argmax`) gives no token: its request fails alone, the rest of the batch goes on.
"""

from __future__ import annotations

import torch

from eaglekv.config import SamplingParams
from eaglekv.core import TokenLogprob


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return probs


TOP_P_CANDIDATES = 1024


def top_p_filter(probs: torch.Tensor, top_p, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) probabilities -> the smallest descending prefix whose mass reaches `top_p` (a
    float, or a tensor broadcasting against (..., 1)), renormalised; the first token always
    stays, even where top_p rounds to 0 in fp32. `rows` (..., 1) bool: only these rows must be
    right (the caller discards the others).

    On the CPU a full sort of a 49k vocabulary costs ~3.5 ms a row (a fifth of a sampled
    speculative step there), so the prefix is looked for among the `TOP_P_CANDIDATES` largest
    (torch.topk, ~8x cheaper): when their mass reaches top_p in every row that counts, every
    later token is dropped by the same rule (its exclusive prefix sum is at least theirs), so
    the result is the full sort's. Otherwise, and on other devices (where the check would be a
    host sync), the full sort."""
    V = probs.shape[-1]
    k = min(V, TOP_P_CANDIDATES)
    if probs.device.type == "cpu" and k < V:
        vals, order = torch.topk(probs, k, dim=-1)                      # sorted, descending
        covered = vals.sum(-1, keepdim=True) >= top_p
        if rows is not None:
            covered = covered | ~rows
        if not bool(covered.all()):
            vals, order = torch.sort(probs, dim=-1, descending=True)
    else:
        vals, order = torch.sort(probs, dim=-1, descending=True)
    drop = (torch.cumsum(vals, -1) - vals) >= top_p
    drop[..., 0] = False
    kept = torch.zeros_like(probs).scatter_(-1, order, vals.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def batched_target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(R, V) logits, one SamplingParams per row -> (R, V) float32: row r equals
    `target_probs(logits[r], params[r])` to fp32 rounding (a batched softmax and normalisation
    may round a last bit differently, ~3e-8; tests/engine/test_top_p.py), computed for all
    rows at once (one sort for top-k, one top-p filter) instead of a dozen kernels per row."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]   # (R, 1)
    x = logits.float() / temp
    V = x.shape[-1]
    ks = [p.top_k if p.top_k and p.top_k < V else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, device=dev)[:, None]                               # (R, 1)
        sx = torch.sort(x, dim=-1, descending=True).values                      # (R, V)
        kth = sx.gather(-1, (k - 1).clamp_min(0))                                # (R, 1)
        kth = torch.where(k > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))                                # as target_probs
    probs = torch.softmax(x, dim=-1)
    cut = [p.top_p < 1.0 for p in params]
    if any(cut):
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]    # (R, 1)
        cut_rows = torch.tensor(cut, device=dev)[:, None]                        # (R, 1)
        kept = top_p_filter(probs, top_p, cut_rows)
        probs = torch.where(cut_rows, kept, probs)                               # top_p = 1 rows as is
    return probs


def valid_probs(probs: torch.Tensor) -> torch.Tensor:
    """(B, ..., V) distributions -> (B,) bool: every distribution of row b can be sampled,
    i.e. all p >= 0 (NaN fails), sum(p) finite and > 0 (what torch.multinomial demands)."""
    flat = probs.reshape(probs.shape[0], -1, probs.shape[-1])                 # (B, n, V)
    mass = flat.sum(-1)                                                        # (B, n)
    return ((flat >= 0).all(-1) & torch.isfinite(mass) & (mass > 0)).all(-1)  # (B,)


def valid_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B, ..., V) logits -> (B,) bool: every argmax of row b is well defined, i.e. no logit
    is NaN or +inf and at least one is finite (-inf alone is allowed: a masked token)."""
    flat = logits.reshape(logits.shape[0], -1, logits.shape[-1])              # (B, n, V)
    return ((flat < float("inf")).all(-1) & (flat > float("-inf")).any(-1)).all(-1)


def sample_next(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[int | None]:
    """(B, V) logits -> B tokens, None for a row whose distribution is unusable (that request
    fails alone). One host sync for the batch: the validity flags come back with the tokens."""
    ok = valid_argmax(logits)                                                  # (B,)
    tokens = logits.argmax(-1)                                                 # (B,)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        # the sampled rows' distributions in one batch; each row then draws with its own
        # generator (its seed's stream). An unusable row draws from a stand-in (all mass on
        # token 0) whose token is dropped: multinomial never sees NaN, inf, p < 0 or a zero sum
        idx = torch.tensor(rows, device=logits.device)                           # (R,)
        probs = batched_target_probs(logits[idx], [params[b] for b in rows])    # (R, V)
        good = valid_probs(probs)                                                # (R,)
        stand_in = torch.zeros_like(probs[0])
        stand_in[0] = 1.0
        probs = torch.where(good[:, None], probs, stand_in)
        drawn = torch.stack([torch.multinomial(probs[r], 1, generator=generators[b])[0]
                             for r, b in enumerate(rows)])                       # (R,)
        tokens = tokens.index_copy(0, idx, drawn)
        ok = ok.index_copy(0, idx, ok[idx] & good)
    host = torch.stack([tokens, ok.long()], 1).tolist()                        # the sync
    return [t if good else None for t, good in host]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """(n, V) logits of the positions that emitted `tokens` (n) -> their TokenLogprob, row i
    with its `top[i]` most likely alternatives. One host sync for all of them."""
    lp = torch.log_softmax(logits.float(), -1)                                  # (n, V)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]
    k = max(top)
    vals, ids = (torch.topk(lp, k, -1) if k else (lp[:, :0], lp[:, :0].long()))  # (n, k)
    chosen, vals, ids = chosen.tolist(), vals.tolist(), ids.tolist()
    return [TokenLogprob(t, c, list(zip(i[:n], v[:n])))
            for t, c, i, v, n in zip(tokens, chosen, ids, vals, top)]


def batch_logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
                   ) -> list[list[TokenLogprob] | None]:
    """One new token per request (logits (B, V)): [its TokenLogprob] where the request asked
    for logprobs, else None (also where its token is None: it failed); nothing is computed
    when none did."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(params)
    if want:
        rows = token_logprobs(logits[want], [tokens[i] for i in want],
                              [params[i].logprobs for i in want])
        for i, lp in zip(want, rows):
            out[i] = [lp]
    return out


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    outputs: list[list[int]], contexts: list[list[int]]) -> torch.Tensor:
    """(n, V) logits of n positions -> the same with each row's penalties applied, in vLLM's
    order: the repetition penalty on every token of `contexts[i]` (prompt and output: positive
    logits divided by it, negative ones multiplied), then the frequency and presence penalties
    on the tokens of `outputs[i]` (minus count x frequency, minus presence where count > 0).
    Rows without penalties are left as they are; returns `logits` itself when none has any."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    out = logits.float().clone()
    V, dev = out.shape[-1], out.device
    for i in rows:
        p, x = params[i], out[i]
        if p.repetition_penalty != 1.0 and contexts[i]:
            seen = torch.zeros(V, dtype=torch.bool, device=dev)
            seen[torch.tensor(contexts[i], device=dev)] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                              x * p.repetition_penalty), x)
        if (p.frequency_penalty or p.presence_penalty) and outputs[i]:
            count = torch.bincount(torch.tensor(outputs[i], device=dev), minlength=V)
            x = x - p.frequency_penalty * count - p.presence_penalty * (count > 0)
        out[i] = x
    return out


def sample_requests(logits: torch.Tensor, reqs: list) -> tuple[list[int | None], list]:
    """The one penalise -> sample -> logprobs block, for both runners. (B, V) raw logits of
    the requests' last positions -> (token or None per request, TokenLogprob lists or None):
    penalties on each request's output and context, sampling (one host sync), logprobs of the
    raw logits. A None token means the request's distribution was unusable: it fails alone."""
    params = [r.params for r in reqs]
    # a request's whole context is joined only where a penalty reads it (O(length) each)
    penalized = apply_penalties(logits, params, [r.output_ids for r in reqs],
                                [r.all_ids if p.has_penalties else [] for r, p in
                                 zip(reqs, params)])
    tokens = sample_next(penalized, params, [r.generator for r in reqs])    # the step's sync
    return tokens, batch_logprobs(logits, tokens, params)
