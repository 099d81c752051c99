"""Organize the draft candidate pool into the verify tree (DESIGN.md "The EAGLE loop", 3-4).

Candidate pool of one request, M = K + (S-1)*K*K entries, step-major:
  step 0 occupies [0, K);
  step i >= 1 occupies [K + (i-1)*K*K, K + i*K*K), where pool index K + (i-1)*K*K + t*K + c is
  the c-th child of branch t of step i-1.
`cand_scores` are cumulative log-probabilities, so a child never scores higher than its parent,
and a parent always has a lower pool index than its children.

Hot functions (`organize`, `build_tree`, `chain_tree`) are pure tensor code: no host sync, no
Python loop over nodes or requests; the only loop is over ceil(log2 N) pointer-doubling rounds.
"""

from __future__ import annotations

import torch

from eaglekv.core import DraftTree
from eaglekv.errors import ConfigError, EaglekvError
from eaglekv.kernels.guard import guard_indices


class TreeError(EaglekvError, ValueError):
    """A draft tree breaks its invariants (found by `check_tree`, a debugging aid)."""


def organize(cand_scores: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """(B, M) cumulative log-probs -> (B, N-1) int64 pool indices of the best N-1 candidates,
    sorted ascending by pool index.

    Selected = top N-1 by score, ties to the lower pool index (stable descending sort). This
    set is ancestor-closed: a parent p of a child c has score(p) >= score(c) and p < c, so p
    ranks before c in the (score desc, index asc) order; whenever c is chosen, so is p.
    Requires N - 1 <= M = K + (S-1)*K*K (DESIGN.md "Organize"), else ConfigError.
    """
    B, M = cand_scores.shape
    N = num_draft_tokens
    if not isinstance(N, int) or N < 1:
        raise ConfigError(f"num_draft_tokens={N!r} must be an int >= 1")
    if N - 1 > M:
        raise ConfigError(f"num_draft_tokens={N} needs N - 1 = {N - 1} candidates but the pool "
                          f"holds only M = K + (S-1)*K*K = {M}; lower num_draft_tokens or raise "
                          f"topk / num_steps")
    # stable: equal scores keep pool order, so ties go to the lower index (the parent)
    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices  # (B, M)
    return torch.sort(order[:, :N - 1], dim=-1).values                              # (B, N-1)


def _ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """(B, N) parent node indices -> (B, N, N) bool, mask[b, i, j] = j is i or an ancestor of i.

    Pointer doubling: with up(i) = parent(i) (up(i) = i where parent is -1),
      M_0 = {i},  J_0 = up;   M_{k+1}(i) = M_k(i) | M_k(J_k(i)),  J_{k+1} = J_k(J_k),
    so M_k(i) = {up^t(i) : t < 2^k}; ceil(log2 N) rounds reach every ancestor (depth <= N-1).
    """
    B, N = parent.shape
    idx = torch.arange(N, device=parent.device).expand(B, N)                           # (B, N)
    jump = torch.where(parent >= 0, parent, idx)                                       # (B, N)
    mask = torch.eye(N, dtype=torch.bool, device=parent.device).expand(B, N, N).clone()
    for _ in range((N - 1).bit_length()):                                              # 2^k >= N
        mask = mask | mask.gather(1, jump[:, :, None].expand(B, N, N))  # row J(i): (B, N, N)
        jump = jump.gather(1, jump)                                                    # (B, N)
    return mask


def build_tree(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
               selected: torch.Tensor, cand_probs: torch.Tensor | None = None) -> DraftTree:
    """Verify tree from the pool: node 0 = root, node i = pool candidate selected[:, i-1].

    root_tokens (B,), cand_tokens / cand_parents (B, M) int64 (parent pool index, -1 = child of
    the root), selected (B, N-1) ascending pool indices (from `organize`), cand_probs (B, M, V)
    optional (topk == 1 sampling).

    Precondition: `selected` is ancestor-closed (every selected candidate's parent is selected
    or is the root) -- `organize` guarantees it. If it is not, the orphaned node gets
    parent -1 and depth 0 and is nobody's child, so the acceptance walk never reaches it and
    the mask never lets another node see it; `check_tree` reports such a tree.
    """
    B, N1 = selected.shape
    N, M = N1 + 1, cand_tokens.shape[1]
    dev = cand_tokens.device
    if cand_parents.shape != cand_tokens.shape or root_tokens.shape != (B,):
        raise ValueError(f"build_tree: cand_tokens {tuple(cand_tokens.shape)}, cand_parents "
                         f"{tuple(cand_parents.shape)} must be (B, M) and root_tokens "
                         f"{tuple(root_tokens.shape)} (B,) with B = {B}")
    # both index the pool: a bad one is KVIndexError (on CUDA through the device error buffer,
    # replaced by 0 so the gathers stay inside the pool), never a raw gather error
    selected = guard_indices(selected, M, "draft tree selection (pool index)")
    tokens = torch.cat([root_tokens[:, None], cand_tokens.gather(1, selected)], 1)    # (B, N)

    # node_of[b, m] = node index of pool candidate m (i for m = selected[b, i-1]), -1 if unused
    node_of = torch.full((B, M), -1, dtype=torch.int64, device=dev)
    node_of.scatter_(1, selected, torch.arange(1, N, device=dev).expand(B, N1))        # (B, M)
    ppool = guard_indices(cand_parents.gather(1, selected), M,
                          "draft tree parent (pool index, -1 = the root)", low=-1)     # (B, N-1)
    # parent node: pool -1 -> root (node 0); otherwise node_of[pool parent] (-1 if orphaned)
    pnode = torch.where(ppool < 0, torch.zeros_like(ppool),
                        node_of.gather(1, ppool.clamp(min=0)))                         # (B, N-1)
    parent = torch.cat([ppool.new_full((B, 1), -1), pnode], 1)                         # (B, N)

    mask = _ancestor_mask(parent)                                                      # (B, N, N)
    depth = mask.sum(-1) - 1                      # depth(i) = |ancestors(i)| ; (B, N) int64
    draft_probs = None
    if cand_probs is not None:
        V = cand_probs.shape[-1]
        rows = cand_probs.gather(1, selected[:, :, None].expand(B, N1, V))            # (B, N-1, V)
        draft_probs = torch.cat([rows.new_zeros(B, 1, V), rows], 1)                    # (B, N, V)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, mask=mask,
                     draft_probs=draft_probs)      # first_child, next_sibling: on first use


def chain_shape(rows: int, num_nodes: int, device) -> dict[str, torch.Tensor]:
    """The parts of a chain tree that do not depend on its tokens, for `rows` requests of
    `num_nodes` nodes: parent(i) = i - 1, depth(i) = i, the lower-triangular mask, first child
    i + 1 (-1 at the leaf), no siblings. A CUDA graph of the step makes them once, before its
    capture, and the captured tree takes views of them (`chain_tree(shape=...)`): the replay
    then records one op for the tree, the tokens' cat."""
    N, S = num_nodes, num_nodes - 1
    idx = torch.arange(N, device=device)
    return {"parent": (idx - 1).expand(rows, N).clone(),
            "depth": idx.expand(rows, N).clone(),
            "mask": (idx[None, :] <= idx[:, None]).expand(rows, N, N).clone(),
            "first_child": torch.where(idx < S, idx + 1, -1).expand(rows, N).clone(),
            "next_sibling": torch.full((rows, N), -1, dtype=torch.int64, device=device)}


def chain_tree(root_tokens: torch.Tensor, draft_tokens: torch.Tensor,
               draft_probs: torch.Tensor | None = None,
               shape: dict[str, torch.Tensor] | None = None) -> DraftTree:
    """topk == 1: a chain root -> d_0 -> ... -> d_{S-1}, N = S + 1 nodes.

    root_tokens (B,), draft_tokens (B, S), draft_probs (B, S, V) optional: row s is the q the
    s-th draft token was sampled from. parent(i) = i - 1, depth(i) = i, mask lower-triangular.
    shape: a `chain_shape` of at least B rows and N nodes (its first B rows are used, never
    written), else made here.
    """
    B, S = draft_tokens.shape
    N = S + 1
    tokens = torch.cat([root_tokens[:, None], draft_tokens], 1)                        # (B, N)
    if shape is None or shape["depth"].shape[1] != N or shape["depth"].shape[0] < B:
        shape = chain_shape(B, N, draft_tokens.device)
    parent, depth, mask, first_child, next_sibling = (
        shape[k][:B] for k in ("parent", "depth", "mask", "first_child", "next_sibling"))
    probs = None
    if draft_probs is not None:
        probs = torch.cat([draft_probs.new_zeros(B, 1, draft_probs.shape[-1]), draft_probs], 1)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, mask=mask, draft_probs=probs,
                     chain=True, links=(first_child, next_sibling))


def verify_tree(root_tokens: torch.Tensor, pool, num_draft_tokens: int,
                chain: bool, shape: dict[str, torch.Tensor] | None = None) -> DraftTree:
    """The verify tree of a draft loop's candidate pool (`draft_loop.CandidatePool`).

    chain (topk == 1): the pool is root -> c_0 -> ... -> c_{S-1} with non-increasing
    cumulative scores (a greedy chain's are all 0), so `organize` would select its first
    N - 1 candidates (ties to the lower pool index) and `build_tree` would give exactly
    `chain_tree` of them (tested): that is built directly, ~12 tensor ops where organize's two
    sorts, the pointer-doubling mask and the sibling links were ~45, each a kernel of the
    step's CUDA graph (`bench/spec_step_ops.py`). The chain's tree is then also accepted in one
    pass (`accept.greedy_accept`). A NaN score cannot reorder a chain here: its tree is always
    a prefix (the verify decides what is kept, so either tree is lossless). Otherwise, and
    where N - 1 exceeds the pool (a ConfigError from organize): organize + build_tree.
    shape: `chain_shape` (a step graph's, made before its capture) for a chain."""
    n1 = num_draft_tokens - 1
    if chain and 0 <= n1 <= pool.tokens.shape[1]:
        probs = None if pool.probs is None else pool.probs[:, :n1]
        return chain_tree(root_tokens, pool.tokens[:, :n1], probs, shape)
    return build_tree(root_tokens, pool.tokens, pool.parents,
                      organize(pool.scores, num_draft_tokens), pool.probs)


def check_tree(tree: DraftTree) -> None:
    """Debugging aid (syncs with the host): raise TreeError unless every node i >= 1 has a
    parent in [0, i). Catches a `build_tree` call on a selection that is not ancestor-closed."""
    N = tree.num_nodes
    idx = torch.arange(N, device=tree.parent.device)
    bad = (tree.parent[:, 1:] < 0) | (tree.parent[:, 1:] >= idx[None, 1:])             # (B, N-1)
    if tree.parent.shape[1] and bool((tree.parent[:, 0] != -1).any()):
        raise TreeError("draft tree root (node 0) must have parent -1")
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        par = int(tree.parent[b, i + 1])
        why = ("the selection passed to build_tree is not ancestor-closed (its parent was "
               "not selected)" if par < 0 else
               "the selection passed to build_tree is not sorted ascending (a parent must come "
               "before its children; `organize` sorts it)")
        raise TreeError(f"draft tree node {i + 1} of request {b} has parent {par}, not in "
                        f"[0, {i + 1}): {why} ({int(bad.sum())} bad nodes)")
