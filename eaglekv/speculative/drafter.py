"""Drafters: where the EAGLE worker takes its proposals from.

The worker runs the draft loop (top-k selection, branching, the tree); a drafter only turns
inputs into next-token distributions, for an extend over committed tokens and for one decode
step of every branch. `EagleDrafter` is the EAGLE-1/2 head on its own KV pool; the
`ScriptedDrafter` proposes tokens a test chooses, so accept lengths can be forced exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglekv.attention import TorchAttentionBackend
from eaglekv.core import ForwardBatch
from eaglekv.memory import KVPool, ReqToTokenPool


@dataclass
class DraftOut:
    logits: torch.Tensor                 # (n, V) next-token logits of each sequence / branch
    hidden: torch.Tensor | None = None   # (n, H) the draft's output hidden (feeds the next step)


class RootRow:
    """Request `b`'s draft root in a batch's DraftOut, kept between steps as
    `req.draft_state`: `[0]` its next-token logits, `[1]` its hidden (None when the drafter has
    none). Rows are taken only when read, and `stack_roots` copies a whole batch's roots in one
    op when its requests come back in the same order (a decode batch's steady state): at batch
    64 the 2 x 64 row views and the stacks over them were a measurable share of a step's host
    time."""

    __slots__ = ("out", "b")

    def __init__(self, out: DraftOut, b: int):
        self.out, self.b = out, b

    def __getitem__(self, i: int) -> torch.Tensor | None:
        t = self.out.logits if i == 0 else self.out.hidden
        return None if t is None else t[self.b]


def stack_roots(reqs, i: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """`torch.stack([r.draft_state[i] for r in reqs])` (into `out` when given; None when the
    roots hold no hidden): one copy of the batch's DraftOut when every request is row `b` of
    the same one at position `b`."""
    first = reqs[0].draft_state
    if type(first) is RootRow and all(type(st) is RootRow and st.out is first.out and st.b == b
                                      for b, st in enumerate(r.draft_state for r in reqs)):
        src = first.out.logits if i == 0 else first.out.hidden
        if src is None:
            return None
        src = src[:len(reqs)]
        return src.clone() if out is None else out.copy_(src)
    rows = [r.draft_state[i] for r in reqs]
    if rows[0] is None:
        return None
    return torch.stack(rows) if out is None else torch.stack(rows, out=out)


class Drafter:
    """Interface. `kv_pool` is the draft's own KV pool (None if it keeps no KV).

    `extend`: the draft runs over committed positions `batch` (ids shifted left by one, the
    next token appended), `hidden` (T, H) being the target's hidden states at those positions;
    returns the distribution at each request's last position.
    `decode`: one token per branch at `positions`, `hidden` (n, H) the parent's draft hidden,
    attention over `meta` (the branch's kv list); returns each branch's next distribution.
    `contexts` (only built when `needs_contexts`) lists the token ids each sequence has seen.
    """

    kv_pool: KVPool | None = None
    needs_contexts: bool = False
    capture_layers: tuple[int, ...] = ()   # target layers whose outputs the draft consumes

    def features(self, out) -> torch.Tensor:
        """(T, Hf) what the draft pairs with each token: the target's final-norm hidden state
        (EAGLE-1/2); EAGLE-3 concatenates the captured layers' outputs instead."""
        return out.hidden

    def extend(self, batch: ForwardBatch, hidden: torch.Tensor,
               contexts: list[list[int]] | None) -> DraftOut:
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
               meta, contexts: list[list[int]] | None) -> DraftOut:
        raise NotImplementedError

    def decode_metadata(self, step, kv_indptr, kv_indices, kv_lens, out_cache_loc,
                        kv_len=None):
        """Attention metadata of draft forward `step`: sequence i over
        `kv_indices[kv_indptr[i] : + kv_lens[i]]`. `kv_lens` is a host tuple (None inside a
        CUDA graph capture), `kv_len` the same lengths on the device, (n,) int64."""
        return None


class EagleDrafter(Drafter):
    """The EAGLE-1/2 head: its one-layer KV pool shares slot ids with the target's."""

    def __init__(self, model, size: int, page_size: int, req_to_token: ReqToTokenPool,
                 dtype: torch.dtype, device: torch.device, backend_cls=TorchAttentionBackend):
        """`backend_cls`: the target's attention backend class (Triton on CUDA)."""
        self.model = model
        layers, kv_heads, head_dim = model.kv_shape()
        self.kv_pool = KVPool(size, page_size, layers, kv_heads, head_dim, dtype, device)
        self.backend = backend_cls(self.kv_pool, req_to_token)
        self.max_kv_len = req_to_token.width          # a host bound on any draft sequence

    def extend(self, batch, hidden, contexts=None) -> DraftOut:
        return self.extend_window(batch, hidden, batch.last_token_indices)

    def extend_window(self, batch, hidden, idx: torch.Tensor) -> DraftOut:
        """The draft over `batch` (hidden (T, H)); the distribution and hidden state at the
        flat token indices `idx` (B,): each request's last committed position."""
        meta = self.backend.init_forward_metadata(batch)
        out = self.model.forward(batch.input_ids, batch.positions, hidden, self.backend, meta,
                                 logits_indices=idx)
        return DraftOut(out.logits, out.hidden[idx])

    def decode_metadata(self, step, kv_indptr, kv_indices, kv_lens, out_cache_loc,
                        kv_len=None):
        if kv_len is not None and hasattr(self.backend, "indexed_decode_metadata"):
            # the lengths stay on the device; the split count needs only a host bound
            bound = max(kv_lens) if kv_lens is not None else self.max_kv_len
            return self.backend.indexed_decode_metadata(kv_indptr[:kv_len.shape[0]], kv_indices,
                                                        kv_len, out_cache_loc, bound)
        return self.backend.init_decode_metadata(kv_indptr, kv_indices, kv_lens, out_cache_loc)

    def decode(self, tokens, positions, hidden, meta, contexts=None) -> DraftOut:
        out = self.model.forward(tokens, positions, hidden, self.backend, meta)
        return DraftOut(out.logits, out.hidden)


class Eagle3Drafter(EagleDrafter):
    """The EAGLE-3 head: fed the concatenated outputs of three target layers (3H, mapped by
    its fc to H), it predicts over a reduced draft vocabulary; its logits are scattered back
    into the target vocabulary (-inf elsewhere), so a token outside the draft vocabulary has
    draft probability 0 and can never be proposed, and acceptance stays exact."""

    def __init__(self, model, size, page_size, req_to_token, dtype, device, num_target_layers,
                 backend_cls=TorchAttentionBackend):
        super().__init__(model, size, page_size, req_to_token, dtype, device, backend_cls)
        self.capture_layers = tuple(model.capture_layers)   # the config's layers, else the default

    def features(self, out) -> torch.Tensor:
        return torch.cat(out.aux_hidden, -1)                              # (T, 3H)

    def extend_window(self, batch, hidden, idx) -> DraftOut:
        out = super().extend_window(batch, hidden, idx)
        return DraftOut(self.model.to_target_logits(out.logits), out.hidden)

    def decode(self, tokens, positions, hidden, meta, contexts=None) -> DraftOut:
        out = super().decode(tokens, positions, hidden, meta, contexts)
        return DraftOut(self.model.to_target_logits(out.logits), out.hidden)


class ScriptedDrafter(Drafter):
    """Proposes `propose(context)`: the tokens to put first, best first, for a sequence that
    has seen `context` (prompt, output so far, then the branch's draft tokens).

    For tests: with the plain greedy continuation as the script, every draft is accepted; a
    wrong token at depth d caps the accept length at d - 1. It reads contexts on the host, so
    it syncs every draft step; it exists to check the worker, not to be fast.
    """

    needs_contexts = True

    def __init__(self, propose: Callable[[list[int]], list[int]], vocab_size: int,
                 device: torch.device | str = "cpu"):
        self.propose, self.vocab_size, self.device = propose, vocab_size, torch.device(device)

    def _logits(self, contexts: list[list[int]]) -> torch.Tensor:
        logits = torch.full((len(contexts), self.vocab_size), -30.0)      # (n, V)
        for i, ctx in enumerate(contexts):
            for rank, tok in enumerate(self.propose(ctx)):
                logits[i, tok] = 10.0 - rank  # best first; softmax keeps the order
        return logits.to(self.device)

    def extend(self, batch, hidden, contexts=None) -> DraftOut:
        return DraftOut(self._logits(contexts))

    def decode(self, tokens, positions, hidden, meta, contexts=None) -> DraftOut:
        return DraftOut(self._logits(contexts))
