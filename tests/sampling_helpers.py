"""Shared helpers of the sampling-law tests (test_spec_sampling, test_penalties,
test_spec_families): one prompt and sampling setting, the target's exact joint law of the
first three output tokens, a noisy self-drafter, and the chi-square statistic with its bound."""

from __future__ import annotations

import torch

from eaglekv import SamplingParams
from eaglekv.attention import TorchAttentionBackend
from eaglekv.core import ForwardBatch
from eaglekv.sampling import target_probs
from eaglekv.memory import KVPool, ReqToTokenPool
from eaglekv.speculative.drafter import Drafter, DraftOut

PROMPT = [5, 17, 42, 9]
PARAMS = SamplingParams(max_new_tokens=3, temperature=1.3, top_k=3, ignore_eos=True)
N_SAMPLES = 3000


def last_logits(model, contexts: list[list[int]]) -> torch.Tensor:
    """(n, V) the model's logits after each context, from a fresh prefill on a scratch pool."""
    cfg = model.cfg
    total = sum(len(c) for c in contexts)
    pool = KVPool(total + 1, 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    r2t = ReqToTokenPool(len(contexts), max(len(c) for c in contexts))
    slots, start = [], 1
    for i, c in enumerate(contexts):
        s = torch.arange(start, start + len(c))
        r2t.req_to_token[i + 1, :len(c)] = s.to(torch.int32)
        slots.append(s)
        start += len(c)
    batch = ForwardBatch.build(contexts, [0] * len(contexts), list(range(1, len(contexts) + 1)),
                               torch.cat(slots))
    out = model.forward(batch, TorchAttentionBackend(pool, r2t),
                        logits_indices=batch.last_token_indices)
    return out.logits


class NoisySelfDrafter(Drafter):
    """Drafts with the target's own logits plus Gaussian noise (q close to p, not equal)."""

    needs_contexts = True

    def __init__(self, model, noise: float = 1.0):
        self.model, self.noise = model, noise
        self.g = torch.Generator().manual_seed(1234)

    def _out(self, contexts):
        logits = last_logits(self.model, contexts)
        return DraftOut(logits + self.noise * torch.randn(logits.shape, generator=self.g))

    def extend(self, batch, hidden, contexts=None):
        return self._out(contexts)

    def decode(self, tokens, positions, hidden, meta, contexts=None):
        return self._out(contexts)


def exact_joint(model) -> dict[tuple[int, ...], float]:
    """P(o0, o1, o2) under PARAMS, by enumerating the top-k supports."""
    probs = {}
    frontier = {(): 1.0}
    for _ in range(3):
        ctxs = list(frontier)
        p = target_probs(last_logits(model, [PROMPT + list(c) for c in ctxs]), PARAMS)
        nxt = {}
        for c, row in zip(ctxs, p):
            for tok in row.nonzero().view(-1).tolist():
                nxt[c + (tok,)] = frontier[c] * float(row[tok])
        frontier = nxt
    probs.update(frontier)
    return probs


def chi_square(samples: list[tuple[int, ...]], probs: dict) -> tuple[float, int]:
    """Pearson statistic over the sequences (rare ones pooled), and its degrees of freedom."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(probs), "a sequence outside the target's support was sampled"
    bins, pooled_e, pooled_o = [], 0.0, 0
    for seq, p in probs.items():
        if n * p >= 5:
            bins.append((counts.get(seq, 0), n * p))
        else:
            pooled_e += n * p
            pooled_o += counts.get(seq, 0)
    if pooled_e > 0:
        bins.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1


CHI2_999 = {k: k + 3.3 * (2 * k) ** 0.5 + 4 for k in range(1, 80)}  # generous p ~ 1e-3 bound
