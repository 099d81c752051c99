"""Acceptance: walk the verified tree and decide what each request commits (DESIGN.md
"The EAGLE loop", 6).

Both rules are pure tensor code over the batch; the only Python loop is over depth (<= S), so
they hold no host sync and can sit inside a CUDA graph. A step emits accept_len draft tokens
plus one bonus token, so accept_len + 1 >= 1 tokens per verify.
"""

from __future__ import annotations

import torch

from eaglekv.core import DraftTree, VerifyResult


def _new_path(B: int, num_steps: int, device) -> torch.Tensor:
    path = torch.full((B, num_steps + 1), -1, dtype=torch.int64, device=device)       # (B, S+1)
    path[:, 0] = 0
    return path


def _row(x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """x (B, N, V), node (B,) -> x[b, node[b]] (B, V)."""
    B, _, V = x.shape
    return x.gather(1, node[:, None, None].expand(B, 1, V)).squeeze(1)                # (B, V)


def _first(cond: torch.Tensor) -> torch.Tensor:
    """(B, N) bool -> (B,) lowest index where cond holds, N where it never does."""
    N = cond.shape[1]
    idx = torch.arange(N, device=cond.device)
    return torch.where(cond, idx, N).amin(-1)                                          # (B,)


def greedy_accept(tree: DraftTree, target_argmax: torch.Tensor, num_steps: int) -> VerifyResult:
    """Greedy verify. target_argmax (B, N) int64: the target's argmax at every node.

    From the root: accept the child c of the current node u with token(c) == argmax(u) (lowest
    node index if siblings repeat a token), move to c, repeat; at most `num_steps` times.
    bonus = argmax(last accepted node). path[:, d] = node at depth d, -1 past accept_len.
    A chain (`tree.chain`) takes `_greedy_accept_chain`, the same result in one pass.
    """
    if tree.chain:
        return _greedy_accept_chain(tree, target_argmax, num_steps)
    return _greedy_accept_tree(tree, target_argmax, num_steps)


def _greedy_accept_walk(tree: DraftTree, target_argmax: torch.Tensor,
                        num_steps: int) -> VerifyResult:
    """`greedy_accept` as the walk of its definition, ~12 tensor ops a depth: the reference
    of the one-pass forms below (tests)."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    path = _new_path(B, num_steps, dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)                                # (B,)
    alive = torch.ones(B, dtype=torch.bool, device=dev)                                # (B,)
    for d in range(num_steps):
        want = target_argmax.gather(1, cur[:, None])                                   # (B, 1)
        # match[b, c] = c is a child of cur[b] and token(c) == argmax(cur[b])
        match = (tree.parent == cur[:, None]) & (tree.tokens == want)                 # (B, N)
        nxt = _first(match)                                                            # (B,)
        alive = alive & (nxt < N)
        cur = torch.where(alive, nxt, cur)
        path[:, d + 1] = torch.where(alive, cur, -1)
    accept_len = (path[:, 1:] >= 0).sum(-1)                                            # (B,)
    bonus = target_argmax.gather(1, cur[:, None]).squeeze(1)                           # (B,)
    return VerifyResult(accept_len=accept_len, path=path, bonus=bonus)


def _greedy_accept_tree(tree: DraftTree, target_argmax: torch.Tensor,
                        num_steps: int) -> VerifyResult:
    """`greedy_accept` of any tree in one pass, no loop over depth. Node i (not the root) is
    a candidate iff token(i) == argmax(parent(i)); the walk moves to the lowest-index
    candidate child, so node i is taken iff it is a candidate with no lower-index candidate
    sibling ("first"), and it is on the path iff it and each of its ancestors but the root is
    first and its depth is at most num_steps: one pass over the (B, N, N) ancestor mask. The
    path holds one node a depth (a node's siblings share its depth), so path[:, d] is the sum
    over on-path nodes of depth d of their index. ~20 tensor ops whatever the depth, where the
    walk took ~12 a depth (each a kernel of the step's CUDA graph)."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    idx = torch.arange(N, device=dev)
    up = tree.parent.clamp(min=0)                                                      # (B, N)
    cand = (tree.tokens == target_argmax.gather(1, up)) & (tree.parent >= 0)         # (B, N)
    # earlier[b, i, j]: j < i is a candidate sibling of i
    earlier = (tree.parent[:, :, None] == tree.parent[:, None, :]) & cand[:, None, :] \
        & (idx[None, :] < idx[:, None])[None]                                          # (B, N, N)
    first = (cand & ~earlier.any(-1) & (tree.depth <= num_steps)) | (idx == 0)[None]  # (B, N)
    on = ~(tree.mask & ~first[:, None, :]).any(-1)                                     # (B, N)
    accept_len = on.sum(-1) - 1                                                        # (B,)
    d = torch.arange(num_steps + 1, device=dev)                                        # (S+1,)
    at = on[:, :, None] & (tree.depth[:, :, None] == d[None, None, :])                 # (B, N, S+1)
    node = (at * idx[None, :, None]).sum(1)                                            # (B, S+1)
    path = torch.where(d[None, :] <= accept_len[:, None], node, -1)                    # (B, S+1)
    last = path.gather(1, accept_len[:, None])                                         # (B, 1)
    bonus = target_argmax.gather(1, last).squeeze(1)                                   # (B,)
    return VerifyResult(accept_len=accept_len, path=path, bonus=bonus)


def _greedy_accept_chain(tree: DraftTree, target_argmax: torch.Tensor,
                         num_steps: int) -> VerifyResult:
    """`greedy_accept` of a chain (node i's only child is i + 1): node d + 1 is accepted iff
    every node up to it matches its parent's argmax, so accept_len = the length of the run of
    matches from the root, path[:, d] = d up to it, and the bonus is the argmax at node
    accept_len. 8 tensor ops where the walk took ~11 per depth (a CUDA graph's kernels)."""
    N = tree.tokens.shape[1]
    D = min(num_steps, N - 1)
    match = tree.tokens[:, 1:D + 1] == target_argmax[:, :D]                            # (B, D)
    accept_len = match.long().cumprod(1).sum(1)                                        # (B,)
    d = torch.arange(num_steps + 1, device=tree.tokens.device)[None, :]                # (1, S+1)
    path = torch.where(d <= accept_len[:, None], d, -1)                                # (B, S+1)
    bonus = target_argmax.gather(1, accept_len[:, None]).squeeze(1)                    # (B,)
    return VerifyResult(accept_len=accept_len, path=path, bonus=bonus)


def _race(r: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """Exact draw from norm(r) (B, V), r >= 0 unnormalised: argmax_v r(v) / E_v, E_v ~ Exp(1)
    i.i.d. (min_v E_v / r(v) is attained at v with probability r(v) / sum r)."""
    return (r / expo.clamp(min=torch.finfo(expo.dtype).tiny)).argmax(-1)               # (B,)


def sample_accept(tree: DraftTree, target_p: torch.Tensor, coins: torch.Tensor,
                  expo: torch.Tensor, num_steps: int) -> VerifyResult:
    """Lossless speculative sampling over the tree.

    target_p (B, N, V): processed target distribution at each node (`target_probs`);
    coins (B, N) uniform [0, 1): coin of the attempt on node c; expo (B, V) Exp(1) noise for the
    one final draw. Rule by `tree.draft_probs`:

    (a) None -- deterministic candidates (top-k picks), any tree. At node u, r = p(u); try the
        children c_1 < c_2 < ... in node order: accept c_k (token x_k) iff
            coin(c_k) < r(x_k) / sum(r),   r = p(u) with x_1..x_{k-1} removed,
        i.e. coin * (sum(r_free) + sum_{j >= k} p(x_j)) < p(x_k) with r_free = p(u) off the
        children's tokens (distinct tokens; a repeated sibling token has r(x) = 0, never
        accepted). On acceptance move to c_k with r = p(c_k); when every child is rejected
        (or u is a leaf) the bonus is drawn from r = r_free, exactly.
    (b) given -- a chain sampled from q (topk == 1): child c = first_child(u), x = token(c),
        q = draft_probs[c]: accept iff coin(c) < min(1, p(x) / q(x)), i.e. coin * q(x) < p(x);
        on rejection the bonus is drawn from norm(max(p - q, 0)) (p if that is all zero);
        after the whole chain, from p at the last node. Only first children are tried.

    One-hot p (and one-hot q at the proposed tokens) reproduces `greedy_accept`.
    """
    B, N, V = target_p.shape
    dev = target_p.device
    idx = torch.arange(N, device=dev)
    sampled = tree.draft_probs is not None
    if not sampled:
        # dup[b, j] = an earlier sibling of j carries the same token (then r(token(j)) = 0)
        same = (tree.parent[:, None, :] == tree.parent[:, :, None]) \
            & (tree.tokens[:, None, :] == tree.tokens[:, :, None]) \
            & (idx[None, :] < idx[:, None])[None]                                      # (B, N, N)
        fresh = ~same.any(-1)                                                          # (B, N)
    path = _new_path(B, num_steps, dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)                                # (B,)
    alive = torch.ones(B, dtype=torch.bool, device=dev)                                # (B,)
    r_end = target_p[:, 0].clone()                                    # residual at the stop, (B, V)
    for d in range(num_steps):
        p = _row(target_p, cur)                                                        # (B, V)
        if sampled:
            c = tree.first_child.gather(1, cur[:, None]).squeeze(1)                    # (B,)
            has = c >= 0
            cc = c.clamp(min=0)
            x = tree.tokens.gather(1, cc[:, None])                                     # (B, 1)
            q = _row(tree.draft_probs, cc)                                             # (B, V)
            # a draft distribution that is not finite (NaN, inf) failed: its proposal is not
            # tried and the token is drawn from p here, a plain step (the residual p - q of a
            # NaN q would fall back to p and could emit the very token it rejected)
            usable = has & torch.isfinite(q).all(-1)                                   # (B,)
            px, qx = p.gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)              # (B,)
            u = coins.gather(1, cc[:, None]).squeeze(1)                                # (B,)
            ok = usable & (u * qx < px)              # u < min(1, p(x)/q(x)), u in [0, 1)
            nxt = torch.where(ok, c, N)
            # rejected: r = max(p - q, 0); a leaf or a failed draft: r = p; zero residual
            # (rounding): r = p
            r = torch.where(usable[:, None], (p - q).clamp(min=0), p)                  # (B, V)
            r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)
        else:
            kid = (tree.parent == cur[:, None]) & fresh                                # (B, N)
            ptok = p.gather(1, tree.tokens) * kid                  # p(x_j) on children, (B, N)
            hit = torch.zeros(B, V, device=dev).scatter_add_(1, tree.tokens, kid.float()) > 0
            r = p.masked_fill(hit, 0.0)                      # r_free: p off children's tokens
            # remaining mass when child j is tried: sum(r_free) + sum_{k >= j} p(x_k)
            suffix = ptok.flip(1).cumsum(1).flip(1)                                    # (B, N)
            rest = r.sum(-1, keepdim=True) + suffix                                    # (B, N)
            # accept j iff u_j < p(x_j) / rest_j; rest_j <= p(x_j) means no other mass: accept
            ok = kid & (ptok > 0) & ((coins * rest < ptok) | (rest <= ptok))            # (B, N)
            nxt = _first(ok)                                                           # (B,)
            r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)      # zero residual guard
        stop = alive & (nxt >= N)
        r_end = torch.where(stop[:, None], r, r_end)
        alive = alive & ~stop
        cur = torch.where(alive, nxt, cur)
        path[:, d + 1] = torch.where(alive, cur, -1)
    # still walking after num_steps: draw from p at the last node
    r_end = torch.where(alive[:, None], _row(target_p, cur), r_end)                    # (B, V)
    accept_len = (path[:, 1:] >= 0).sum(-1)                                            # (B,)
    return VerifyResult(accept_len=accept_len, path=path, bonus=_race(r_end, expo))
