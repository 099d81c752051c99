"""The draft loop's chain path (topk == 1: an argmax instead of a top-k select, scores 0, the
one child kept without a select or gather) against the candidate pool written out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eaglekv.speculative.draft_loop import DraftLoop
from eaglekv.speculative.tree import organize


class StepDrafter:
    """Draft forward i returns fixed random logits and hidden states; records its inputs."""
    needs_contexts = False

    def __init__(self, B: int, S: int, V: int, H: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(S, B, V, generator=g) * 3
        self.hidden = torch.randn(S, B, H, generator=g)
        self.calls = []

    def decode(self, tokens, positions, hidden, meta, ctx):
        i = len(self.calls)
        self.calls.append((tokens.clone(), positions.clone(), hidden.clone()))
        return SimpleNamespace(logits=self.logits[i], hidden=self.hidden[i])


@pytest.mark.parametrize("B,S,seed", [(1, 1, 0), (1, 5, 1), (3, 4, 2), (8, 6, 3)])
def test_chain_pool_is_argmax_chain_with_zero_scores(B, S, seed):
    V, H = 50, 8
    g = torch.Generator().manual_seed(100 + seed)
    root_logits, root_hidden = torch.randn(B, V, generator=g) * 3, torch.randn(B, H, generator=g)
    seq_lens = torch.randint(3, 20, (B,), generator=g)
    drafter = StepDrafter(B, S, V, H, seed)
    reqs = [SimpleNamespace(kv_len=int(n), params=SimpleNamespace(greedy=True)) for n in seq_lens]
    pool = DraftLoop(drafter, S, 1).run(
        reqs, root_logits, root_hidden, seq_lens, torch.zeros(B, 1, S, dtype=torch.long),
        lambda step, kv_lens, kv_len: None, None, None)
    logits = [root_logits] + [drafter.logits[i] for i in range(S - 1)]
    lp = [torch.log_softmax(x, -1) for x in logits]
    tokens = torch.stack([x.argmax(-1) for x in lp], 1)                        # (B, S)
    assert torch.equal(pool.tokens, tokens)
    assert torch.equal(pool.scores, torch.zeros(B, S))
    # the tree a chain's scores select is its first N - 1 nodes, with the cumulative
    # log-probs (what they were until 2026-12-05) as with zeros, for every N
    cumulative = torch.stack([x.max(-1).values for x in lp], 1).cumsum(1)
    for N in range(2, S + 2):
        assert torch.equal(organize(pool.scores, N), organize(cumulative, N))
        assert torch.equal(organize(pool.scores, N), torch.arange(N - 1).expand(B, N - 1))
    assert torch.equal(pool.parents, torch.arange(-1, S - 1).expand(B, S))
    assert pool.probs is None
    # draft forward i reads the token picked at step i at position seq_len + i, and the
    # hidden state of the forward before it (the root's for the first)
    for i, (tok, pos, hid) in enumerate(drafter.calls):
        assert torch.equal(tok, tokens[:, i])
        assert torch.equal(pos, seq_lens + i)
        assert torch.equal(hid, root_hidden if i == 0 else drafter.hidden[i - 1])


def test_chain_pool_with_the_device_pick(monkeypatch):
    """The CUDA branch of a greedy chain's pick (`greedy_pick`, whose (n, 2) result is read
    as a strided (n, 1) view) makes the same pool as the CPU's argmax, through every view
    the loop takes of it."""
    from eaglekv.speculative import draft_loop
    B, S, V, H = 8, 6, 50, 8
    pools = []
    for device_pick in (False, True):
        monkeypatch.setattr(draft_loop, "use_triton", lambda x, on=device_pick: on)
        g = torch.Generator().manual_seed(7)
        root_logits, root_hidden = torch.randn(B, V, generator=g), torch.randn(B, H, generator=g)
        seq_lens = torch.randint(3, 20, (B,), generator=g)
        reqs = [SimpleNamespace(kv_len=int(n), params=SimpleNamespace(greedy=True))
                for n in seq_lens]
        pools.append(DraftLoop(StepDrafter(B, S, V, H, 7), S, 1).run(
            reqs, root_logits, root_hidden, seq_lens, torch.zeros(B, 1, S, dtype=torch.long),
            lambda step, kv_lens, kv_len: None, None, None))
    assert torch.equal(pools[0].tokens, pools[1].tokens)
    assert torch.equal(pools[0].parents, pools[1].parents)
    assert torch.equal(pools[0].scores, pools[1].scores)
