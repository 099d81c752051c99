"""The dataclass layer every stage passes around: forward batches and their derived sizes."""

from __future__ import annotations

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
class SpecStats:
    """Speculation counters of one request (filled once speculation ships)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_histogram: dict[int, int] | None = None

    @property
    def accept_length_mean(self) -> float:
        """Tokens per verify step, the bonus token included."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str               # "stop" | "length"
    prompt_token_ids: list[int]
    spec: SpecStats | None = None


@dataclass
class StreamDelta:
    text: str                        # new text since the last delta
    token_ids: list[int]             # new tokens since the last delta
    finish_reason: str | None = None  # set on the last delta
