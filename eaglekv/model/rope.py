"""Rotary position embedding with the config's theta and scaling (inv_freq from transformers).

eaglekv keeps q/k head dims in the interleaved pair layout (dims 2i, 2i+1 form one rotation
pair) so RoPE is one complex multiply. Checkpoints in Hugging Face's rotate-half layout
(pair i = dims i, i + D/2) are permuted once at load by `to_interleaved`; attention scores are
unchanged because q and k are permuted alike.
"""

from __future__ import annotations

import torch

from eaglekv.errors import ModelLoadError


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers < 5 keeps them apart
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_freq_and_scale(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ModelLoadError("rope_type='dynamic' rescales with the sequence length; unsupported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope_type={rope_type!r}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.to(torch.float64), float(scale)


def to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows (or a vector) of q/k in rotate-half layout -> interleaved pair layout, per head.

    (H*D, ...) viewed (H, 2, D/2, ...) -> (H, D/2, 2, ...): new dim 2i = old i, 2i+1 = old i+D/2.
    """
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)


class RotaryEmbedding:
    """Precomputed complex rotations `[max_positions, head_dim / 2]`."""

    def __init__(self, hf_config, head_dim: int, max_positions: int,
                 device: torch.device | str = "cpu"):
        inv_freq, scale = inv_freq_and_scale(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)                               # (P, D/2)
        self.cis = torch.polar(torch.full_like(freqs, scale), freqs).to(torch.complex64).to(device)
        self.max_positions = max_positions
        self._cos_sin = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, D/2) float32 tables of the rotations' real and imaginary parts, for the fused
        RoPE kernel (built on first use)."""
        if self._cos_sin is None:
            self._cos_sin = (self.cis.real.contiguous(), self.cis.imag.contiguous())
        return self._cos_sin

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) positions -> (T, 1, D/2) complex, computed once per forward."""
        return self.cis[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D) in interleaved layout (may be a strided view) -> rotated (T, heads, D)."""
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (T, heads, D/2)
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
