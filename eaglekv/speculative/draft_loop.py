"""The draft phase of one EAGLE step: S select steps over S - 1 draft forwards.

Step 0 takes the K best tokens of the draft's distribution at the root; step i >= 1 runs the
draft on the K current branches, scores their K*K children by cumulative log-probability
(parent score + child log-prob) and keeps the K best as the next branches. Every candidate
goes into the pool the tree is organised from (layout in `eaglekv.speculative.tree`).

With topk == 1 and temperature > 0 the single branch *samples* its token from the draft's
processed distribution q (recorded, so acceptance can use min(1, p/q)); otherwise the
candidates are deterministic top-k picks (a greedy chain's scores are 0: see `_choose`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglekv.kernels.greedy import greedy_pick
from eaglekv.kernels.store_cache import use_triton
from eaglekv.sampling import target_probs


@dataclass
class CandidatePool:
    tokens: torch.Tensor          # (B, M) int64, M = K + (S-1)*K*K, step-major
    scores: torch.Tensor          # (B, M) float32 cumulative draft log-probs
    parents: torch.Tensor         # (B, M) int64 pool index of the parent, -1 = the root
    probs: torch.Tensor | None    # (B, M, V) q each candidate was sampled from (K == 1 sampling)


def processed_probs(logits: torch.Tensor, params: list, greedy_tok: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """(B, V) logits -> (B, V) the distribution each request samples from: one-hot at the
    argmax (or at `greedy_tok`) for greedy requests, `target_probs` for the others. The loop
    is over distinct sampling settings, not over tokens."""
    idx = logits.argmax(-1) if greedy_tok is None else greedy_tok
    out = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, idx[:, None], 1.0)
    by_params: dict = {}
    for b, p in enumerate(params):
        if not p.greedy:
            by_params.setdefault(p, []).append(b)
    for p, rows in by_params.items():
        r = torch.tensor(rows, device=logits.device)
        out[r] = target_probs(logits[r], p)
    return out


def exponential_noise(generators: list[torch.Generator], n: int, device) -> torch.Tensor:
    """(B, n) iid Exp(1), each row from its request's generator (seeded, reproducible)."""
    return torch.stack([torch.empty(n, device=device).exponential_(generator=g)
                        for g in generators])


def uniform_noise(generators: list[torch.Generator], n: int, device) -> torch.Tensor:
    """(B, n) iid U[0, 1), each row from its request's generator."""
    return torch.stack([torch.rand(n, device=device, generator=g) for g in generators])


class DraftLoop:
    """Runs the select steps for a batch; the worker prepares slots and kv indices."""

    def __init__(self, drafter, num_steps: int, topk: int):
        self.drafter, self.S, self.K = drafter, num_steps, topk

    def _choose(self, logits: torch.Tensor, reqs, sample_chain: bool):
        """(n, V) draft logits -> (tokens (n, K), log-probs (n, K), q (n, V) or None).

        A greedy chain (K == 1, not sampled) returns log-probs 0: its tree is its first N - 1
        nodes whatever its scores are (cumulative log-probs only fall along a chain, and
        `organize` breaks ties to the lower pool index, so constant scores select the same
        nodes), and the log-softmax and max that computed them were 23 us of each draft step
        on an H100 at batch 1 (2026-12-05), 7% of an S5 step. Its token is the argmax of the
        logits (`greedy_pick`: one Triton launch on CUDA). Its log-probs are None: `run` makes
        the pool's zero scores once, not a zeros op a step (each a kernel of the step graph)."""
        if not sample_chain and self.K == 1:
            if use_triton(logits):      # CUDA (and the Triton interpreter in tests)
                tok = greedy_pick(logits.contiguous())[:, :1]                  # (n, 1)
            else:
                tok = logits.argmax(-1, keepdim=True)
            return tok, None, None
        logp = torch.log_softmax(logits.float(), -1)                       # (n, V)
        if not sample_chain:       # topk is a 4-5 kernel radix select on CUDA
            lp, tok = logp.topk(self.K, -1)
            return tok, lp, None                                            # (n, K) each
        # topk == 1 with sampling: x ~ q by the exponential race argmax(q / E), E ~ Exp(1)
        q = processed_probs(logits, [r.params for r in reqs])               # (n, V)
        expo = exponential_noise([r.generator for r in reqs], q.shape[-1], q.device)
        tok = (q / expo).argmax(-1, keepdim=True)                           # (n, 1)
        return tok, logp.gather(1, tok), q

    def run(self, reqs, root_logits: torch.Tensor, root_hidden: torch.Tensor | None,
            seq_lens: torch.Tensor, slots: torch.Tensor, decode_meta, contexts_of,
            reorder_kv, live: torch.Tensor | None = None) -> CandidatePool:
        """root_logits (B, V) / root_hidden (B, H): the draft's output at each request's last
        committed position. slots (B, K, S): draft write slots, step i writes [:, :, i].
        decode_meta(step, kv_lens, kv_len) -> attention metadata of draft forward `step`
        (kv_lens on the host, kv_len (B*K,) the same on the device).
        contexts_of(paths (B, K, d)) -> per-branch token contexts (scripted drafters only).
        reorder_kv(dst (B, K, i), src (B, K, i)): copy the draft KV of branch paths.
        `reqs` None: a CUDA graph capture of a greedy batch (nothing read on the host); then
        `live` (B,) int64 is 1 for a real row and 0 for a padded one, which reads no key."""
        S, K = self.S, self.K
        B = root_logits.shape[0]
        dev = root_logits.device
        sample_chain = reqs is not None and K == 1 and any(not r.params.greedy for r in reqs)
        # a greedy chain's scores are 0 and its parents i - 1 (see `_choose`): made once at
        # the end, none of the per-step score and parent ops
        greedy_chain = K == 1 and not sample_chain
        tok, score, q = self._choose(root_logits, reqs, sample_chain)     # (B, K) each
        pool_tok, pool_score = [tok], [score]
        pool_parent = [None if greedy_chain else
                       torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        pool_q = [q[:, None]] if sample_chain else None                    # (B, 1, V)
        branch_pool = (None if greedy_chain else                           # (B, K) pool index
                       torch.arange(K, device=dev).expand(B, K))
        hidden = None if root_hidden is None else root_hidden[:, None].expand(B, K, -1)
        paths = tok[:, :, None]                                            # (B, K, 1)
        lens_host = None if reqs is None else [r.kv_len for r in reqs]
        # the keys of draft forward i - 1: kv_len = (seq_lens + i) * live, one add a step
        kv_len = seq_lens if live is None else seq_lens * live              # (B,)
        for i in range(1, S):
            step = i - 1                  # draft forward `step` sees it = i draft tokens
            kv_lens = None if reqs is None else tuple(lb + i for lb in lens_host
                                                      for _ in range(K))
            kv_len = kv_len + (1 if live is None else live)                 # (B,)
            meta = decode_meta(step, kv_lens, kv_len if K == 1 else kv_len.repeat_interleave(K))
            positions = (seq_lens + (i - 1) if K == 1 else                 # (B*K,)
                         (seq_lens + i - 1)[:, None].expand(B, K).reshape(-1))
            ctx = contexts_of(paths) if self.drafter.needs_contexts else None
            out = self.drafter.decode(tok.reshape(-1), positions,
                                      None if hidden is None else hidden.reshape(B * K, -1),
                                      meta, ctx)
            branch_reqs = None if reqs is None else [r for r in reqs for _ in range(K)]
            c_tok, c_lp, c_q = self._choose(out.logits, branch_reqs, sample_chain)  # (B*K, K)
            c_tok = c_tok.view(B, K, K)
            pool_tok.append(c_tok.reshape(B, K * K))
            if greedy_chain:
                cum = None
            else:
                cum = score[:, :, None] + c_lp.view(B, K, K)               # (B, K, K)
                pool_score.append(cum.reshape(B, K * K))
                pool_parent.append(branch_pool[:, :, None].expand(B, K, K).reshape(B, K * K))
            base = K + (i - 1) * K * K
            if sample_chain:
                pool_q.append(c_q.view(B, 1, -1))
            if i == S - 1:
                break
            if K == 1:    # a chain: the one child is the next branch (no select, no gather)
                tok = c_tok.view(B, 1)
                if not greedy_chain:
                    score, branch_pool = cum.view(B, 1), branch_pool + 1
                if out.hidden is not None:
                    hidden = out.hidden.view(B, 1, -1)
                if ctx is not None:
                    paths = torch.cat([paths, tok[:, :, None]], 2)         # (B, 1, i + 1)
                continue
            # keep the K best children as the next branches
            score, pick = cum.reshape(B, K * K).topk(K, -1)                # (B, K)
            parent_branch = pick // K                                      # (B, K)
            tok = c_tok.reshape(B, K * K).gather(1, pick)                  # (B, K)
            branch_pool = base + pick
            if out.hidden is not None:
                h = out.hidden.view(B, K, -1)                               # (B, K, H)
                hidden = h.gather(1, parent_branch[:, :, None].expand_as(h))
            if K > 1:  # branch t now continues parent_branch[t]'s path: copy its draft KV
                src = slots[:, :, :i].gather(1, parent_branch[:, :, None].expand(B, K, i))
                reorder_kv(slots[:, :, :i], src)                           # (B, K, i) each
            paths = torch.cat([paths.gather(1, parent_branch[:, :, None].expand(B, K, i)),
                               tok[:, :, None]], 2)                        # (B, K, i + 1)
        tokens = torch.cat(pool_tok, 1)                                    # (B, M)
        if greedy_chain:
            M = tokens.shape[1]
            return CandidatePool(tokens=tokens,
                                 scores=torch.zeros(B, M, dtype=torch.float32, device=dev),
                                 parents=(torch.arange(M, device=dev) - 1).expand(B, M),
                                 probs=None)
        return CandidatePool(tokens=tokens, scores=torch.cat(pool_score, 1),
                             parents=torch.cat(pool_parent, 1),
                             probs=torch.cat(pool_q, 1) if sample_chain else None)
