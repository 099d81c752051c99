"""The dataclass layer every stage passes around: forward batches and their derived sizes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One forward: every request extends its cached prefix by `extend_lens[b]` tokens.

    Tokens are flat, request-major: request b's tokens are `input_ids[cu[b]:cu[b+1]]`.
    Prefill is an extend on an empty prefix, decode an extend by 1, verify an extend by N.
    `req_to_token[req_pool_indices[b], :seq_lens[b]]` must already hold every slot, the new
    ones (`out_cache_loc`) included.
    """

    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    req_pool_indices: torch.Tensor  # (B,) int64 rows of the ReqToTokenPool
    prefix_lens: torch.Tensor      # (B,) int64 committed tokens before this forward
    extend_lens: torch.Tensor      # (B,) int64 new tokens per request
    out_cache_loc: torch.Tensor    # (T,) int64 slots the new K/V are written to
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    # optional (B, Tmax, Tmax) bool: which new tokens see which (tree verify); None = causal
    extend_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu))

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each request's last new token, (B,)."""
        return torch.cumsum(self.extend_lens, 0) - 1

    @classmethod
    def build(cls, input_ids: list[list[int]], prefix_lens: list[int], req_rows: list[int],
              out_cache_loc: torch.Tensor, device: torch.device | str = "cpu",
              extend_mask: torch.Tensor | None = None) -> "ForwardBatch":
        ext = [len(x) for x in input_ids]
        flat = [t for x in input_ids for t in x]
        pos = [p + i for p, n in zip(prefix_lens, ext) for i in range(n)]
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return cls(input_ids=as_t(flat), positions=as_t(pos), req_pool_indices=as_t(req_rows),
                   prefix_lens=as_t(prefix_lens), extend_lens=as_t(ext),
                   out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
                   prefix_lens_cpu=tuple(prefix_lens), extend_lens_cpu=tuple(ext),
                   extend_mask=extend_mask)


@dataclass
class DraftTree:
    """The verify tree of every request in a batch (N nodes each, same N for all).

    Node 0 is the root: the last verified token, not yet in the KV cache. Nodes 1..N-1 are
    draft candidates sorted by their index in the candidate pool, so a parent always comes
    before its children and depth never decreases with the node index.
    """

    tokens: torch.Tensor        # (B, N) int64 token of each node (node 0 = root)
    parent: torch.Tensor        # (B, N) int64 parent node index, -1 at the root
    depth: torch.Tensor         # (B, N) int64, 0 at the root; position of node i = L_b + depth
    mask: torch.Tensor          # (B, N, N) bool: mask[b, i, j] = node j is node i or its ancestor
    # (B, N, V) float32: row i is the draft distribution node i's token was *sampled* from
    # (topk == 1 sampling); None when the candidates are deterministic (top-k picks)
    draft_probs: torch.Tensor | None = None
    # a chain (topk == 1, `tree.chain_tree`): parent(i) = i - 1, so acceptance compares each
    # node with its parent's argmax in one pass (`accept.greedy_accept`) instead of a walk
    chain: bool = False
    # (first_child, next_sibling), or None: made from `parent` on first use. Greedy
    # acceptance never reads them, so a captured greedy step records none of their ~12 ops.
    links: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def first_child(self) -> torch.Tensor:
        """(B, N) int64 lowest-index child, -1 for a leaf."""
        return self._links()[0]

    @property
    def next_sibling(self) -> torch.Tensor:
        """(B, N) int64 next child of the same parent, -1 for the last."""
        return self._links()[1]

    def _links(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.links is None:
            self.links = tree_links(self.parent)
        return self.links


def tree_links(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) parent node indices -> first_child, next_sibling (B, N), -1 where none.

    first_child[p]  = min{ i : parent[i] = p }
    next_sibling[i] = min{ j > i : parent[j] = parent[i] }   (only for parent[i] >= 0)
    """
    B, N = parent.shape
    idx = torch.arange(N, device=parent.device)
    none = torch.full((), N, dtype=torch.int64, device=parent.device)
    is_child = parent[:, None, :] == idx[None, :, None]                                # (B, N, N)
    first = torch.where(is_child, idx[None, None, :], none).amin(-1)                  # (B, N)
    sib = (parent[:, None, :] == parent[:, :, None]) & (idx[None, :] > idx[:, None])[None]
    sib &= (parent >= 0)[:, :, None]                                                   # (B, N, N)
    nxt = torch.where(sib, idx[None, None, :], none).amin(-1)                         # (B, N)
    return first.masked_fill(first == N, -1), nxt.masked_fill(nxt == N, -1)


@dataclass
class VerifyResult:
    """What acceptance decided for every request of a verify batch."""

    accept_len: torch.Tensor    # (B,) int64 accepted draft nodes, the root and bonus excluded
    path: torch.Tensor          # (B, S + 1) int64 node at depth d of the accepted path; -1 past it
    bonus: torch.Tensor         # (B,) int64 token drawn at the last accepted node

    def committed_tokens(self, tree: DraftTree) -> torch.Tensor:
        """(B, S + 1) the tokens this verify adds after the root: the accepted nodes' tokens,
        then the bonus at index accept_len; -1 after it."""
        B, P = self.path.shape
        d = torch.arange(P, device=self.path.device)[None, :]                # (1, S+1)
        nxt = torch.cat([self.path[:, 1:], self.path.new_full((B, 1), -1)], 1)  # node at d + 1
        tok = tree.tokens.gather(1, nxt.clamp(min=0))                        # (B, S+1)
        tok = torch.where(d < self.accept_len[:, None], tok, torch.full_like(tok, -1))
        return torch.where(d == self.accept_len[:, None], self.bonus[:, None], tok)


@dataclass
class SpecStats:
    """Speculation counters of one request (filled once speculation ships)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_histogram: dict[int, int] | None = None
    choices: dict[str, int] | None = None   # adaptive: steps per choice ("plain", "S3K1N4", ...)

    @property
    def accept_length_mean(self) -> float:
        """Tokens per verify step, the bonus token included."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def position_rates(self, depth: int) -> list[float]:
        """Acceptance rate of draft positions 1..depth (vLLM's and llama.cpp's definition):
        rate[i] = verify steps that accepted at least i + 1 drafts / verify steps, so
        rate[0] >= rate[1] >= ... A histogram key k counts steps that gave k tokens, the bonus
        included, i.e. accepted k - 1 drafts: rate[i] = sum_{k >= i + 2} hist[k] / steps. In a
        tree the position is the depth along the accepted path."""
        hist, steps = self.accept_histogram or {}, self.verify_steps
        return [sum(n for k, n in hist.items() if k >= i + 2) / steps if steps else 0.0
                for i in range(depth)]

    @classmethod
    def total(cls, stats: Iterable[SpecStats | None]) -> SpecStats:
        """The counters of several requests summed, histograms and choices merged (None: a
        request that did not speculate)."""
        out = cls(accept_histogram={})
        for st in stats:
            if st is None:
                continue
            out.verify_steps += st.verify_steps
            out.draft_tokens += st.draft_tokens
            out.accepted_tokens += st.accepted_tokens
            for k, n in (st.accept_histogram or {}).items():
                out.accept_histogram[k] = out.accept_histogram.get(k, 0) + n
            for c, n in (st.choices or {}).items():
                out.choices = out.choices or {}
                out.choices[c] = out.choices.get(c, 0) + n
        return out


@dataclass
class TokenLogprob:
    """One output token's log-probability under the target model, and the `top` most likely
    tokens at its position, most likely first, as (token id, logprob). Log-softmax of the raw
    logits in fp32: before temperature, top-k and top-p (what vLLM reports by default), so
    the figure does not depend on how the token was chosen, speculatively or not."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str               # "stop" | "length"
    prompt_token_ids: list[int]
    spec: SpecStats | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token, when SamplingParams.logprobs


@dataclass
class StreamDelta:
    text: str                        # new text since the last delta
    token_ids: list[int]             # new tokens since the last delta
    finish_reason: str | None = None  # set on the last delta
    logprobs: list[TokenLogprob] | None = None   # of token_ids, when asked for


@dataclass
class StepPlan:
    """One engine step as the scheduler decided it; the runner runs it, the scheduler commits.

    kind "extend": every request of `reqs` extends its cached prefix by `ids[i]` (a prompt
    chunk, or the one last sampled token), at positions `prefix_lens[i]...`, into `slots[i]`
    (allocated and written into req_to_token already; `req.kv_len` counts them). A request
    whose prompt is complete (`kv_len == num_ids`) samples. Plain decoding is always an
    extend; so is a speculative prefill (chunk).
    kind "decode": a speculative step (draft, verify, accept) for each of `reqs`; the runner
    takes its own draft and verify slots, for which the scheduler reserved room."""

    kind: str
    reqs: list
    ids: list[list[int]] | None = None
    prefix_lens: list[int] | None = None
    slots: list[torch.Tensor] | None = None

    @property
    def sampling(self) -> list[int]:
        """Indices (into reqs) of the requests that sample this step (extend)."""
        return [i for i, r in enumerate(self.reqs) if r.kv_len == r.num_ids]


@dataclass
class StepResult:
    """What a runner produced for a StepPlan, index by index with `plan.reqs`; the scheduler
    commits it (the runner itself never changes a request's books).

    tokens[i]: tokens to append (None: none this step, e.g. mid-prefill); logprobs[i] their
    TokenLogprobs when asked for; failed[i]: the request's distribution was unusable, it fails
    alone; kv_advance[i] / last_slots[i]: tokens whose K/V the step committed past kv_len and
    the slot of the last (speculative decode; 0 for an extend, which the plan already counted);
    accepted[i]: draft tokens accepted (speculative decode, for the request's SpecStats) out of
    `draft_tokens`; free_slots: slots to hand back (rejected verify tails, failed windows)."""

    tokens: list[list[int] | None]
    logprobs: list[list | None]
    failed: list[bool]
    kv_advance: list[int] | None = None
    last_slots: list[int] | None = None
    # None at i: it did not speculate this step; a list: a chain's steps, one count each
    accepted: list[int | list[int] | None] | None = None
    draft_tokens: int | list[int] = 0          # per step, or per request (adaptive)
    free_slots: torch.Tensor | None = None

    @classmethod
    def empty(cls, n: int) -> "StepResult":
        return cls(tokens=[None] * n, logprobs=[None] * n, failed=[False] * n)
