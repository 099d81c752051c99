"""top-p over the largest TOP_P_CANDIDATES probabilities (torch.topk) instead of a full sort:
bit for bit the full sort's result, in the peaked rows where the candidates cover top_p and in
the flat ones that fall back, for `target_probs` and `batched_target_probs` alike."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.sampling import batched_target_probs, target_probs, top_p_filter


def full_sort_reference(probs: torch.Tensor, top_p) -> torch.Tensor:
    vals, order = torch.sort(probs, dim=-1, descending=True)
    drop = (torch.cumsum(vals, -1) - vals) >= top_p
    drop[..., 0] = False
    kept = torch.zeros_like(probs).scatter_(-1, order, vals.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("V", [1000, 1025, 49152])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.9, 0.95, 0.999])
def test_top_p_filter_equals_the_full_sort(V, scale, top_p):
    g = torch.Generator().manual_seed(V + int(scale * 10))
    probs = torch.softmax(torch.randn(2, 3, V, generator=g) * scale, -1)
    assert torch.equal(top_p_filter(probs, top_p), full_sort_reference(probs, top_p))


def test_batched_rows_with_and_without_top_p(monkeypatch):
    """A batch mixing flat and peaked rows, top_p 1 (untouched), tiny and usual values, and a
    top_k: the same bits with the candidates as with a full sort (the flat row makes the batch
    fall back; the peaked rows alone take the candidates), and each row equals target_probs of
    its own params (to fp32 rounding: a batched softmax may round a last bit differently, as it
    did before the candidates)."""
    import eaglekv.sampling as sampling
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 49152, generator=g) * torch.tensor([[0.2], [8.0], [8.0], [3.0], [8.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, top_p=0.5, top_k=50),
              SamplingParams(temperature=0.7, top_p=0.95, top_k=2000)]
    batched = batched_target_probs(logits, params)
    peaked = batched_target_probs(logits[1:], params[1:])
    rows = [target_probs(logits[r], p) for r, p in enumerate(params)]
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 10 ** 9)
    assert torch.equal(batched, batched_target_probs(logits, params))
    assert torch.equal(peaked, batched_target_probs(logits[1:], params[1:]))
    for r, p in enumerate(params):
        assert torch.equal(rows[r], target_probs(logits[r], p)), r
        torch.testing.assert_close(batched[r], rows[r], rtol=0, atol=1e-7)
    assert int((batched[0] > 0).sum()) > 1024            # the flat row: beyond the candidates


def test_tiny_top_p_keeps_the_top_token_over_a_large_vocabulary():
    p = SamplingParams(temperature=1.0)
    object.__setattr__(p, "top_p", 1e-300)
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(3))
    probs = target_probs(logits, p)
    assert torch.equal(probs, torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, True), 1))
