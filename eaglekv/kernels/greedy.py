"""The greedy pick of a batch of logit rows in one pass: each row's argmax and whether that
argmax is well defined, `(R, 2)` int64 `[token, valid]`.

    token[r] = the first index of max(logits[r])           (torch.argmax's rule)
    valid[r] = no logit is NaN or +inf, and at least one is > -inf  (sampling.valid_argmax)

A token whose row is not valid is meaningless (its request fails alone). What a CUDA graph of
a decode or speculative step ends with: on the H200 the torch ops for it were 8 kernels and
~30 us a token at batch 1 (argmax 13 us, two boolean reductions 15 us, compares, a stack and
a cast; 2026-12-05 profile), one Triton launch here (`greedy_triton`; for a few rows two: a
row split over programs, then their partials reduced). CPU tensors take the
torch reference below, which is also the kernel's test oracle.
"""

from __future__ import annotations

import torch

from eaglekv.kernels.store_cache import use_triton


def greedy_pick_torch(logits: torch.Tensor) -> torch.Tensor:
    """(R, V) float logits -> (R, 2) int64 [argmax, valid]."""
    valid = (logits < float("inf")).all(-1) & (logits > float("-inf")).any(-1)   # (R,)
    return torch.stack([logits.argmax(-1), valid.long()], 1)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """(R, V) float logits (rows contiguous) -> (R, 2) int64 [argmax, valid]; no host sync."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_pick: logits of shape {tuple(logits.shape)}, expected (R, V) "
                         "with V >= 1")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"greedy_pick: logits dtype {logits.dtype}, expected float32, float16 "
                        "or bfloat16")
    if not use_triton(logits):
        return greedy_pick_torch(logits)
    from eaglekv.kernels.greedy_triton import greedy_pick_triton
    return greedy_pick_triton(logits)
