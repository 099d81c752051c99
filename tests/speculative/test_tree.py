"""organize + build_tree equal a naive pure-Python reference written from the definitions, on
random EAGLE candidate pools (ties in scores included); chain_tree equals build_tree for K=1."""

from __future__ import annotations

import random

import pytest
import torch

from eaglekv.errors import ConfigError
from eaglekv.speculative.draft_loop import CandidatePool
from eaglekv.speculative.tree import (TreeError, build_tree, chain_shape, chain_tree, check_tree,
                                    organize, verify_tree)
from helpers import random_pool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def naive_select(scores: list[float], n1: int) -> list[int]:
    """Top n1 pool indices by score, ties to the lower index, sorted ascending."""
    return sorted(sorted(range(len(scores)), key=lambda m: (-scores[m], m))[:n1])


def naive_tree(root: int, tokens: list[int], parents: list[int], sel: list[int]):
    """The tree from the definitions; an orphan (parent not selected) gets parent -1 and is a
    root of its own (build_tree's documented behaviour)."""
    N = len(sel) + 1
    node_of = {m: i + 1 for i, m in enumerate(sel)}
    tok = [root] + [tokens[m] for m in sel]
    par = [-1] + [0 if parents[m] < 0 else node_of.get(parents[m], -1) for m in sel]
    mask = [[False] * N for _ in range(N)]
    depth = [0] * N
    for i in range(N):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = par[j]
        depth[i] = sum(mask[i]) - 1
    kids = [[i for i in range(N) if par[i] == p] for p in range(N)]
    first = [k[0] if k else -1 for k in kids]
    nxt = [-1] * N
    for k in kids:
        for a, b in zip(k, k[1:]):
            nxt[a] = b
    return dict(tokens=tok, parent=par, depth=depth, mask=mask, first_child=first,
                next_sibling=nxt)


def assert_tree_equals(tree, refs):
    for name in ("tokens", "parent", "depth", "mask", "first_child", "next_sibling"):
        got = getattr(tree, name).cpu().tolist()
        assert got == [r[name] for r in refs], name


def ancestor_closed(parents: list[int], sel: list[int]) -> bool:
    s = set(sel)
    return all(parents[m] < 0 or parents[m] in s for m in sel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_organize_build_tree_equal_naive(device, seed):
    rng = random.Random(seed)
    for _ in range(10):
        K, S, B = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 5]), rng.choice([1, 3])
        M = K + (S - 1) * K * K
        toks, scores, parents, roots = random_pool(rng, B, K, S, coarse=rng.random() < 0.7)
        for N in sorted({1, 2, M + 1, rng.randint(1, M + 1)}):
            t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
            sel = organize(t(scores, torch.float32), N)
            assert sel.shape == (B, N - 1) and sel.dtype == torch.int64
            ref_sel = [naive_select(s, N - 1) for s in scores]
            assert sel.cpu().tolist() == ref_sel
            assert all(ancestor_closed(p, s) for p, s in zip(parents, ref_sel))
            tree = build_tree(t(roots), t(toks), t(parents), sel)
            assert_tree_equals(tree, [naive_tree(r, tk, p, s)
                                      for r, tk, p, s in zip(roots, toks, parents, ref_sel)])
            assert tree.draft_probs is None and tree.num_nodes == N
            check_tree(tree)
            # depth never decreases with the node index; depth <= S
            d = tree.depth
            assert bool((d[:, 1:] >= d[:, :-1]).all()) and int(d.max()) <= S


@pytest.mark.parametrize("device", DEVICES)
def test_selection_not_ancestor_closed_is_detectable(device):
    """A hand-made selection missing parents: build_tree follows its documented contract (the
    orphan is a root of its own, nobody's child) and check_tree raises."""
    rng = random.Random(7)
    K, S, B = 2, 3, 3
    toks, scores, parents, roots = random_pool(rng, B, K, S)
    M = K + (S - 1) * K * K
    # row 0: pool K + K*K is a step-2 candidate whose step-1 parent is left out; others random
    sels = [[0, 1, K + K * K]] + [sorted(rng.sample(range(M), 3)) for _ in range(B - 1)]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    tree = build_tree(t(roots), t(toks), t(parents), t(sels))
    refs = [naive_tree(r, tk, p, s) for r, tk, p, s in zip(roots, toks, parents, sels)]
    assert_tree_equals(tree, refs)
    assert tree.parent[0, 3] == -1 and tree.depth[0, 3] == 0
    assert not bool(tree.mask[0, :3, 3].any())   # no other node sees the orphan
    with pytest.raises(TreeError, match="node 3 of request 0"):
        check_tree(tree)


def test_organize_rejects_too_many_draft_tokens():
    scores = torch.zeros(2, 2 + 2 * 4)                 # K=2, S=3: M = K + (S-1)K^2 = 10
    assert organize(scores, 11).shape == (2, 10)
    with pytest.raises(ConfigError, match="num_draft_tokens=12"):
        organize(scores, 12)


def test_organize_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0, -2.0]])
    assert organize(scores, 4).tolist() == [[0, 1, 2]]
    scores = torch.tensor([[-1.0, -1.0, 0.0, -1.0]])
    assert organize(scores, 3).tolist() == [[0, 2]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("S", [1, 2, 5])
def test_chain_tree_equals_build_tree_for_k1(device, S):
    g = torch.Generator().manual_seed(S)
    B, Vq = 3, 11
    roots = torch.randint(0, Vq, (B,), generator=g).to(device)
    draft = torch.randint(0, Vq, (B, S), generator=g).to(device)
    q = torch.rand(B, S, Vq, generator=g).to(device)
    # K = 1 pool: M = S, candidate s is the child of s - 1, scores strictly decreasing
    scores = -torch.arange(S, dtype=torch.float32).expand(B, S) - torch.rand(B, 1, generator=g)
    scores = scores.to(device)                                                     # (B, S)
    parents = (torch.arange(S, device=device) - 1).expand(B, S)
    sel = organize(scores, S + 1)
    assert sel.tolist() == [list(range(S))] * B
    a = build_tree(roots, draft, parents, sel, cand_probs=q)
    b = chain_tree(roots, draft, draft_probs=q)
    for name in ("tokens", "parent", "depth", "mask", "first_child", "next_sibling", "draft_probs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(b.draft_probs[:, 0], torch.zeros(B, Vq, device=device))
    assert torch.equal(b.draft_probs[:, 1:], q)
    check_tree(b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [False, True])
def test_verify_tree_builds_a_chain_directly_and_equals_organize(device, sampled):
    """`verify_tree(chain=True)` of a topk == 1 pool (greedy: scores all 0, as DraftLoop
    gives; sampled: falling cumulative log-probs) is the tree organize + build_tree select,
    for every N up to S + 1, marked as a chain; other pools, or N - 1 beyond the pool, take
    organize + build_tree (a ConfigError for the latter)."""
    g = torch.Generator().manual_seed(7)
    B, S, Vq = 3, 5, 11
    roots = torch.randint(0, Vq, (B,), generator=g).to(device)
    toks = torch.randint(0, Vq, (B, S), generator=g).to(device)
    parents = (torch.arange(S, device=device) - 1).expand(B, S)
    if sampled:
        scores = (-torch.rand(B, S, generator=g)).cumsum(1).to(device)
        probs = torch.rand(B, S, Vq, generator=g).to(device)
    else:
        scores, probs = torch.zeros(B, S, device=device), None
    pool = CandidatePool(tokens=toks, scores=scores, parents=parents, probs=probs)
    for N in range(2, S + 2):
        fast = verify_tree(roots, pool, N, chain=True)
        ref = build_tree(roots, toks, parents, organize(scores, N), cand_probs=probs)
        assert fast.chain and not ref.chain
        for name in ("tokens", "parent", "depth", "mask", "first_child", "next_sibling",
                     "draft_probs"):
            a, b = getattr(fast, name), getattr(ref, name)
            assert (a is None and b is None) or torch.equal(a, b), (N, name)
        shape = chain_shape(B + 2, N, device)          # a step graph's, more rows than B
        kept = {k: v.clone() for k, v in shape.items()}
        held = verify_tree(roots, pool, N, chain=True, shape=shape)
        for name in ("tokens", "parent", "depth", "mask", "first_child", "next_sibling"):
            assert torch.equal(getattr(held, name), getattr(fast, name)), (N, name)
        assert all(torch.equal(shape[k], kept[k]) for k in kept)
    assert not verify_tree(roots, pool, 4, chain=False).chain
    with pytest.raises(ConfigError, match="N - 1 = 6"):
        verify_tree(roots, pool, S + 2, chain=True)


@pytest.mark.parametrize("device", DEVICES)
def test_build_tree_gathers_draft_probs(device):
    rng = random.Random(3)
    K, S, B = 3, 3, 2
    toks, scores, parents, roots = random_pool(rng, B, K, S)
    M = K + (S - 1) * K * K
    probs = torch.rand(B, M, 5, device=device)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    sel = organize(torch.tensor(scores, device=device), 8)
    tree = build_tree(t(roots), t(toks), t(parents), sel, cand_probs=probs)
    assert tree.draft_probs.shape == (B, 8, 5)
    assert torch.equal(tree.draft_probs[:, 0], torch.zeros(B, 5, device=device))
    for b in range(B):
        assert torch.equal(tree.draft_probs[b, 1:], probs[b, sel[b]])


@pytest.mark.parametrize("bad,what", [("parent", "draft tree parent"),
                                      ("selected", "draft tree selection")])
def test_an_index_outside_the_pool_is_a_kv_index_error(bad, what):
    """A parent pool index past the pool (or a selection past it) is eaglekv's KVIndexError
    naming the index and the limit, not a raw gather error (on CUDA: a device assert)."""
    from eaglekv.errors import KVIndexError
    roots = torch.tensor([5])
    toks = torch.tensor([[10, 11, 12, 13]])                  # M = 4
    parents = torch.tensor([[-1, -1, 0, 1]])
    sel = torch.tensor([[0, 1, 2]])
    if bad == "parent":
        parents = torch.tensor([[-1, -1, 9, 1]])             # 9 is not a pool index
    else:
        sel = torch.tensor([[0, 1, 4]])
    v, low = (9, -1) if bad == "parent" else (4, 0)
    with pytest.raises(KVIndexError, match=rf"\b{v} out of range \[{low}, 4\) in {what}"):
        build_tree(roots, toks, parents, sel)


def test_check_tree_tells_an_unsorted_selection_from_a_missing_parent():
    """Ancestor-closed but not ascending: the message says "not sorted", not "not
    ancestor-closed"."""
    roots = torch.tensor([5])
    toks = torch.tensor([[10, 11, 12]])
    parents = torch.tensor([[-1, 0, 1]])                     # a chain 0 -> 1 -> 2
    tree = build_tree(roots, toks, parents, torch.tensor([[2, 0, 1]]))   # closed, unsorted
    with pytest.raises(TreeError, match="not sorted ascending") as e:
        check_tree(tree)
    assert "not ancestor-closed" not in str(e.value)
    orphan = build_tree(roots, toks, parents, torch.tensor([[0, 2]]))     # 1 left out
    with pytest.raises(TreeError, match="not ancestor-closed"):
        check_tree(orphan)
