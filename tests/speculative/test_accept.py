"""Acceptance: greedy equals a naive tree walk; sampling equals a naive sequential reference
with the same coins, reduces to greedy on one-hot distributions, and keeps the target
distribution (chi-square on 20000 copies of one tree), while known-wrong rules fail the same
statistical test."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from eaglekv.core import VerifyResult
from eaglekv.kernels.guard import kv_guard
from eaglekv.speculative.accept import _greedy_accept_walk, greedy_accept, sample_accept
from eaglekv.speculative.tree import build_tree, chain_tree, organize
from helpers import random_pool      # the candidate-pool generator of the tree tests

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------- random trees
def random_tree(rng: random.Random, B: int, N: int, V: int, dup: float = 0.0, device="cpu"):
    """B random trees of N nodes: node i's parent uniform in [0, i) (so parents come first);
    siblings get distinct tokens, except that with probability `dup` (or when V tokens are
    used up) a node repeats the token of an earlier sibling."""
    tokens, parents = [], []
    for _ in range(B):
        par = [-1] + [rng.randrange(i) for i in range(1, N)]
        tok = [rng.randrange(V)]
        for i in range(1, N):
            used = [tok[j] for j in range(1, i) if par[j] == par[i]]
            free = [v for v in range(V) if v not in used]
            if not free or (used and rng.random() < dup):   # more siblings than V: repeat
                tok.append(rng.choice(used))
            else:
                tok.append(rng.choice(free))
        tokens.append(tok)
        parents.append(par)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    # pool = nodes 1..N-1 with pool parent = node - 1 (-1 = root), every candidate selected
    pool_par = [[p - 1 for p in par[1:]] for par in parents]
    sel = torch.arange(N - 1, device=device).expand(B, N - 1)
    tree = build_tree(t([tk[0] for tk in tokens]), t([tk[1:] for tk in tokens]), t(pool_par), sel)
    assert tree.parent.tolist() == parents
    return tree


def children(tree, b):
    par = tree.parent[b].tolist()
    return [[c for c in range(len(par)) if par[c] == u] for u in range(len(par))]


def naive_greedy(tree, argmax, S):
    out = []
    for b in range(tree.tokens.shape[0]):
        kids, tok, am = children(tree, b), tree.tokens[b].tolist(), argmax[b].tolist()
        cur, path = 0, [0]
        for _ in range(S):
            m = [c for c in kids[cur] if tok[c] == am[cur]]
            if not m:
                break
            cur = m[0]
            path.append(cur)
        out.append((len(path) - 1, path + [-1] * (S + 1 - len(path)), am[cur]))
    return out


def naive_sample(tree, p, coins, expo, S, wrong: str | None = None):
    """Sequential definition of sample_accept, one request at a time, in float64.

    `wrong` swaps in a known-wrong rule, for the negative statistical checks:
      "keep_rejected" (a): rejected siblings stay in the residual;
      "residual_p"    (b): after a rejection draw from p instead of norm(max(p - q, 0));
      "accept_p"      (b): accept with probability p(x), as if q(x) were 1."""
    out = []
    q_all = None if tree.draft_probs is None else tree.draft_probs.double().tolist()
    for b in range(tree.tokens.shape[0]):
        kids, tok = children(tree, b), tree.tokens[b].tolist()
        pb, cb, eb = p[b].double().tolist(), coins[b].double().tolist(), expo[b].double().tolist()
        cur, path = 0, [0]
        for _ in range(S):
            r, moved = list(pb[cur]), False
            if q_all is None:                         # (a) deterministic candidates
                for c in kids[cur]:
                    x = tok[c]
                    base = pb[cur] if wrong == "keep_rejected" else r
                    if base[x] > 0 and cb[c] < base[x] / sum(base):
                        cur, moved = c, True
                        break
                    r[x] = 0.0                       # the rejected sibling leaves the residual
                if wrong == "keep_rejected":
                    r = list(pb[cur])
            elif kids[cur]:                           # (b) sampled chain: first child only
                c = kids[cur][0]
                x, q = tok[c], q_all[b][c]
                ratio = pb[cur][x] / (1.0 if wrong == "accept_p" else q[x])
                if cb[c] < min(1.0, ratio):           # u < min(1, p(x) / q(x))
                    cur, moved = c, True
                elif wrong != "residual_p":
                    r = [max(a - b_, 0.0) for a, b_ in zip(pb[cur], q)]
                    r = r if sum(r) > 0 else list(pb[cur])
            if not moved:
                break
            path.append(cur)
        else:
            r = list(pb[cur])
        bonus = max(range(len(r)), key=lambda v: r[v] / max(eb[v], 1e-38))
        out.append((len(path) - 1, path + [-1] * (S + 1 - len(path)), bonus))
    return out


def as_rows(res):
    return list(zip(res.accept_len.tolist(), res.path.tolist(), res.bonus.tolist()))


def max_depth(tree):
    return int(tree.depth.max())


# ---------------------------------------------------------------- greedy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_naive_walk(device, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for N, V in [(2, 3), (6, 4), (12, 5), (24, 30)]:
        B = 16
        tree = random_tree(rng, B, N, V, dup=0.3 if seed % 2 else 0.0, device=device)
        argmax = torch.randint(0, V, (B, N), generator=g)
        # force a match along a random path down to a chosen depth (0 = none, all = full)
        for b in range(B):
            kids, tok = children(tree, b), tree.tokens[b].tolist()
            want, cur, d = rng.choice([0, 1, 2, N]), 0, 0
            while d < want and kids[cur]:
                c = rng.choice(kids[cur])
                argmax[b, cur] = tok[c]
                cur, d = c, d + 1
            if d == want and kids[cur]:       # make the walk stop exactly here
                free = [v for v in range(V) if v not in {tok[c] for c in kids[cur]}]
                if free:
                    argmax[b, cur] = rng.choice(free)
        argmax = argmax.to(device)
        for S in {max_depth(tree), max(1, max_depth(tree) - 1)}:
            res = greedy_accept(tree, argmax, S)          # one pass (_greedy_accept_tree)
            assert res.path.shape == (B, S + 1) and res.path.dtype == torch.int64
            assert as_rows(res) == naive_greedy(tree, argmax, S)
            assert as_rows(_greedy_accept_walk(tree, argmax, S)) == as_rows(res)


def test_greedy_committed_tokens_on_a_chain():
    tree = chain_tree(torch.tensor([7]), torch.tensor([[1, 2, 3]]))
    argmax = torch.tensor([[1, 2, 9, 4]])        # accepts 1, 2; rejects 3; bonus 9
    res = greedy_accept(tree, argmax, 3)
    assert res.accept_len.tolist() == [2] and res.path.tolist() == [[0, 1, 2, -1]]
    assert res.committed_tokens(tree).tolist() == [[1, 2, 9, -1]]
    full = greedy_accept(tree, torch.tensor([[1, 2, 3, 4]]), 3)
    assert full.committed_tokens(tree).tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_on_a_chain_in_one_pass_equals_the_walk(device, seed):
    """A chain tree (`chain_tree`, tree.chain) is accepted by `_greedy_accept_chain`: equal to
    the tree's one-pass form, the walk and the naive reference at every accepted depth, including
    num_steps beyond the chain (S > N - 1) and below it."""
    g = torch.Generator().manual_seed(seed)
    B, V = 24, 5
    for n1 in (1, 3, 5):
        tree = chain_tree(torch.randint(0, V, (B,), generator=g).to(device),
                          torch.randint(0, V, (B, n1), generator=g).to(device))
        assert tree.chain
        walk = dataclasses.replace(tree, chain=False)
        argmax = torch.randint(0, V, (B, n1 + 1), generator=g)
        for b in range(B):                    # row b matches its first b % (n1 + 2) nodes
            k = min(b % (n1 + 2), n1)
            argmax[b, :k] = tree.tokens[b, 1:k + 1].cpu()
        argmax = argmax.to(device)
        for S in sorted({max(1, n1 - 1), n1, n1 + 2}):
            fast, ref = greedy_accept(tree, argmax, S), greedy_accept(walk, argmax, S)
            assert as_rows(fast) == as_rows(ref) == naive_greedy(tree, argmax, S), (n1, S)
            assert as_rows(_greedy_accept_walk(walk, argmax, S)) == as_rows(fast)
            assert fast.path.dtype == ref.path.dtype == torch.int64
            assert torch.equal(fast.committed_tokens(tree), ref.committed_tokens(walk))
        assert sorted(set(greedy_accept(tree, argmax, n1).accept_len.tolist())) == list(
            range(n1 + 1))                    # every depth was reached


# ---------------------------------------------------------------- sampling, exact
def random_p(g, B, N, V, zeros=0.3):
    p = torch.rand(B, N, V, generator=g) * (torch.rand(B, N, V, generator=g) > zeros)
    p[..., 0] += 1e-3                                          # never an all-zero row
    return p / p.sum(-1, keepdim=True)


def draws(g, B, N, V):
    coins = torch.rand(B, N, generator=g)
    expo = -torch.log1p(-torch.rand(B, V, generator=g))         # Exp(1)
    return coins, expo


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_sample_tree_equals_sequential_reference(device, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for N, V in [(2, 3), (8, 4), (16, 6), (24, 40)]:
        B = 64
        tree = random_tree(rng, B, N, V, dup=0.2, device=device)
        p = random_p(g, B, N, V)
        coins, expo = draws(g, B, N, V)
        S = max_depth(tree)
        res = sample_accept(tree, p.to(device), coins.to(device), expo.to(device), S)
        assert as_rows(res) == naive_sample(tree, p, coins, expo, S)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("S", [1, 3, 6])
def test_sample_chain_equals_sequential_reference(device, S):
    g = torch.Generator().manual_seed(S)
    B, V, N = 256, 5, S + 1
    p, q = random_p(g, B, N, V), random_p(g, B, S, V)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, S)     # x_s ~ q_s
    # make the target agree often so that long prefixes get accepted
    p[:, :S] = torch.where(torch.rand(B, S, 1, generator=g) < 0.5, q, p[:, :S])
    tree = chain_tree(torch.zeros(B, dtype=torch.int64).to(device), x.to(device), q.to(device))
    coins, expo = draws(g, B, N, V)
    res = sample_accept(tree, p.to(device), coins.to(device), expo.to(device), S)
    assert as_rows(res) == naive_sample(tree, p, coins, expo, S)
    assert int(res.accept_len.max()) == S and int(res.accept_len.min()) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_one_hot_sampling_equals_greedy(device, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    B, V = 64, 5
    for N in (2, 7, 15):
        tree = random_tree(rng, B, N, V, dup=0.3, device=device)
        argmax = torch.randint(0, V, (B, N), generator=g).to(device)
        # bias toward matches: argmax(u) = token of u's first child half of the time
        fc = tree.first_child.clamp(min=0)
        take = (torch.rand(B, N, generator=g).to(device) < 0.6) & (tree.first_child >= 0)
        argmax = torch.where(take, tree.tokens.gather(1, fc), argmax)
        onehot = torch.nn.functional.one_hot(argmax, V).float()             # (B, N, V)
        coins, expo = draws(g, B, N, V)
        S = max_depth(tree)
        want = as_rows(greedy_accept(tree, argmax, S))
        got = sample_accept(tree, onehot, coins.to(device), expo.to(device), S)
        assert as_rows(got) == want
        # chain with one-hot q at the proposed tokens: rule (b) is greedy too
        chain = chain_tree(tree.tokens[:, 0], tree.tokens[:, 1:],
                           torch.nn.functional.one_hot(tree.tokens[:, 1:], V).float())
        got = sample_accept(chain, onehot, coins.to(device), expo.to(device), N - 1)
        assert as_rows(got) == as_rows(greedy_accept(chain, argmax, N - 1))


# ---------------------------------------------------------------- sampling, statistics
def chi2_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson chi-square p-value of integer samples against probabilities p (V,)."""
    counts = torch.bincount(samples.cpu(), minlength=p.numel()).double()
    p = p.cpu().double()
    if bool((counts[p == 0] > 0).any()):
        return 0.0
    e = samples.numel() * p[p > 0]
    stat = ((counts[p > 0] - e) ** 2 / e).sum()
    df = torch.tensor((p > 0).sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))   # P(chi2_df >= stat)


def emitted(res, tree):
    return res.committed_tokens(tree)                           # (B, S+1), -1 past the bonus


TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2]     # root: 3 children; node 1: 2 children; node 2: 1
TREE_TOKENS = [5, 2, 0, 4, 1, 3, 3]


def tree_pvalues(rule, B=20000, V=6, seed=0):
    """p-values: first token ~ p(root); given the walk reached child c, the next emitted token
    ~ p(c) (c = 1, 2, 3); given it reached grandchild 4, the next ~ p(4)."""
    g = torch.Generator().manual_seed(seed)
    N = len(TREE_PARENTS)
    P = 0.15 + torch.rand(N, V, generator=g)
    P = P / P.sum(-1, keepdim=True)                              # (N, V), same for every copy
    t = lambda x: torch.tensor(x, dtype=torch.int64).expand(B, len(x))  # noqa: E731
    tree = build_tree(t(TREE_TOKENS[:1])[:, 0], t(TREE_TOKENS[1:]),
                      t([p - 1 for p in TREE_PARENTS[1:]]), t(list(range(N - 1))))
    coins, expo = draws(g, B, N, V)
    res = rule(tree, P.expand(B, N, V), coins, expo, 2)
    out = emitted(res, tree)
    pv = {"first": chi2_pvalue(out[:, 0], P[0])}
    for c in (1, 2, 3):
        at = res.path[:, 1] == c
        pv[f"after {c}"] = chi2_pvalue(out[at, 1], P[c])
    at = res.path[:, 2] == 4
    pv["after 4"] = chi2_pvalue(out[at, 2], P[4])
    return pv


def chain_pvalues(rule, B=20000, V=6, seed=1, use_q=True):
    """A sampled chain of 2: x1 ~ q0, x2 ~ q1(x1); the target at node 1 depends on x1:
    p(node 1) = P1[x1]. p-values: first token ~ P0; for each v, given x1 = v was accepted, the
    next emitted token ~ P1[v]."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):                       # skewed random distributions over the last dim
        a = 0.05 + torch.rand(*shape, generator=g) ** 2
        return a / a.sum(-1, keepdim=True)

    P0, P1, P2 = rnd(V), rnd(V, V), rnd(V, V)
    Q0, Q1 = rnd(V), rnd(V, V)
    x1 = torch.multinomial(Q0, B, replacement=True, generator=g)                      # (B,)
    x2 = torch.multinomial(Q1[x1], 1, generator=g)[:, 0]                              # (B,)
    p = torch.stack([P0.expand(B, V), P1[x1], P2[x2]], 1)                             # (B, 3, V)
    q = torch.stack([Q0.expand(B, V), Q1[x1]], 1)                                     # (B, 2, V)
    tree = chain_tree(torch.zeros(B, dtype=torch.int64), torch.stack([x1, x2], 1),
                      q if use_q else None)
    coins, expo = draws(g, B, 3, V)
    res = rule(tree, p, coins, expo, 2)
    out = emitted(res, tree)
    pv = {"first": chi2_pvalue(out[:, 0], P0)}
    for v in range(V):
        at = (res.accept_len >= 1) & (x1 == v)
        pv[f"after x1={v}"] = chi2_pvalue(out[at, 1], P1[v])
    return pv


def wrong_rule(name):
    """sample_accept's signature around naive_sample with a deliberately wrong rule."""
    def rule(tree, p, coins, expo, S):
        rows = naive_sample(tree, p, coins, expo, S, wrong=name)
        acc, path, bonus = (torch.tensor(x) for x in zip(*rows))
        return VerifyResult(accept_len=acc, path=path, bonus=bonus)
    return rule


ALPHA = 1e-4          # per-check false-alarm rate; seeds are fixed, so the outcome is too


def test_tree_sampling_keeps_target_distribution():
    pv = tree_pvalues(sample_accept)
    assert min(pv.values()) > ALPHA, pv


def test_chain_sampling_keeps_target_distribution():
    pv = chain_pvalues(sample_accept)
    assert min(pv.values()) > ALPHA, pv


def test_rule_a_on_a_sampled_chain_is_also_exact():
    """Rule (a) is exact for any candidates drawn independently of the verify coins, so a
    sampled chain verified with q(x) := 1 (EAGLE's qx = 1.0) keeps p too -- it only accepts
    less: sum_x q(x) p(x) <= sum_x min(p(x), q(x))."""
    pv = chain_pvalues(sample_accept, use_q=False)
    assert min(pv.values()) > ALPHA, pv


@pytest.mark.parametrize("name", ["keep_rejected"])
def test_statistical_test_catches_wrong_tree_rule(name):
    pv = tree_pvalues(wrong_rule(name))
    assert min(pv.values()) < 1e-9, pv


@pytest.mark.parametrize("name", ["residual_p", "accept_p"])
def test_statistical_test_catches_wrong_chain_rule(name):
    # DESIGN.md bug class (SafeAILab/EAGLE #329): sampling that ignores the draft's q
    pv = chain_pvalues(wrong_rule(name))
    assert min(pv.values()) < 1e-9, pv


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipeline_has_no_host_sync_and_replays_in_a_cuda_graph():
    """organize -> build_tree -> greedy_accept / sample_accept: no sync (sync debug mode
    "error"), and a captured CUDA graph replays to the eager result."""
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    B, K, S, N, V = 4, 3, 3, 10, 40
    toks, scores, parents, roots = random_pool(rng, B, K, S)
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device="cuda")  # noqa: E731
    ins = dict(scores=t(scores, torch.float32), toks=t(toks), parents=t(parents), roots=t(roots))
    p = random_p(g, B, N, V).cuda()
    coins, expo = (x.cuda() for x in draws(g, B, N, V))
    argmax = p.argmax(-1)

    guard = kv_guard(torch.device("cuda"))

    def step():
        # inside an engine step, as in the runners: build_tree's pool-index guard defers
        # its check to the step's one sync (the device error buffer)
        with guard.step():
            sel = organize(ins["scores"], N)
            tree = build_tree(ins["roots"], ins["toks"], ins["parents"], sel)
            a, b = greedy_accept(tree, argmax, S), sample_accept(tree, p, coins, expo, S)
        return [tree.mask, tree.first_child, a.path, a.bonus, b.path, b.bonus]

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                    # warm-up off the default stream
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    guard.raise_if_error()                        # the pool indices were all in range
    for e, o in zip(eager, out):
        assert torch.equal(e, o)


def test_a_non_finite_draft_distribution_is_a_plain_step():
    """p = [.2, .3, .5], q = [.5, NaN, .1], draft token 0 (issue 16): the NaN residual used to
    fall back to p after rejecting token 0, so token 0 came out with probability 0.4 + 0.6 *
    0.2 = 0.52. A non-finite q is a failed draft: the token is drawn from p, P(0) = 0.2."""
    g = torch.Generator().manual_seed(0)
    B = 20000
    p = torch.tensor([0.2, 0.3, 0.5])
    q = torch.tensor([0.5, float("nan"), 0.1])
    tree = chain_tree(torch.zeros(B, dtype=torch.int64), torch.zeros(B, 1, dtype=torch.int64),
                      q.expand(B, 1, 3).clone())
    target = p.expand(B, 2, 3).clone()
    coins = torch.rand(B, 2, generator=g)
    expo = torch.empty(B, 3).exponential_(generator=g)
    res = sample_accept(tree, target, coins, expo, 1)
    first = res.committed_tokens(tree)[:, 0]
    assert not bool(res.accept_len.any())                  # the failed draft is never accepted
    freq = torch.bincount(first, minlength=3).float() / B
    assert torch.allclose(freq, p, atol=0.015), freq       # 3.5 sigma at B = 20000
