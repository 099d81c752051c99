"""The reduced draft vocabulary of an EAGLE-3 head, chosen by token frequency in the data.

An EAGLE-3 head scores only Vd << V target tokens (its `lm_head` has Vd rows), the ones the
target most often writes. The published map (SpecForge, SGLang, vLLM; eaglekv/model/eagle3.py):

    target_id = draft_id + d2t[draft_id]      d2t (Vd,) int64, draft ids sorted by target id
    t2d[target_id] = True  iff the target id has a draft id        t2d (V,) bool

A target token outside the draft vocabulary can never be proposed (its draft probability is 0),
so coverage = the share of the data's predicted tokens inside the vocabulary bounds what the
head can accept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor   # (Vd,) int64, ascending: target id of each draft id
    vocab_size: int            # V, the target's vocabulary

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """(Vd,) int64 offsets: target_id = draft_id + d2t[draft_id]."""
        return self.target_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        """(V,) bool: the target ids the draft vocabulary covers."""
        return torch.zeros(self.vocab_size, dtype=torch.bool).index_fill_(0, self.target_ids, True)

    def draft_index(self) -> torch.Tensor:
        """(V,) int64 lookup: draft id of each target id, -1 outside the draft vocabulary."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        return out.index_copy_(0, self.target_ids, torch.arange(self.size, dtype=torch.int64))

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        """The inverse of (d2t, t2d), checked: what a saved head's vocabulary is."""
        ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)   # (Vd,)
        marked = t2d.nonzero().flatten().to(torch.int64)                           # (Vd,)
        if ids.numel() != marked.numel() or not torch.equal(ids, marked):
            raise ValueError(f"d2t ({d2t.numel()} draft ids) and t2d ({marked.numel()} marked "
                             f"target ids) describe different vocabularies")
        return cls(ids, t2d.numel())

    def coverage(self, token_ids: torch.Tensor) -> float:
        """Share of `token_ids` (any shape, target ids) inside the draft vocabulary."""
        if token_ids.numel() == 0:
            return 0.0
        return float(self.t2d[token_ids.flatten().to(torch.int64)].float().mean())


def choose_draft_vocab(token_ids: torch.Tensor, vocab_size: int, size: int,
                       always: tuple[int, ...] = ()) -> DraftVocab:
    """The `size` most frequent target ids of `token_ids` (ties: lower id first), plus the ids
    in `always` (e.g. EOS), as a DraftVocab sorted by target id. Ids that never occur fill the
    rest in id order when the data has fewer than `size` distinct tokens."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}] "
                         f"(the target's vocabulary)")
    ids = token_ids.flatten().to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())}"
                         f" outside the target vocabulary [0, {vocab_size})")
    counts = torch.bincount(ids, minlength=vocab_size).to(torch.float64)          # (V,)
    counts[list(always)] = float("inf")
    # stable sort by descending count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices[:size]                         # (Vd,)
    return DraftVocab(order.sort().values, vocab_size)
