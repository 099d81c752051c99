"""The EAGLE-1/2 draft head on its own one-layer paged KV pool.

Forward (SafeAILab/EAGLE `cnets1.py: Model.forward`, SGLang `llama_eagle.py`):

    x   = fc(cat([embed(token_t), f_t]))        # (T, 2H) -> (T, H); embedding first
    x  += attn(x)                               # layer 0: no input_layernorm (published heads)
    g_t = x + mlp(post_attention_layernorm(x))  # the draft's feature, (T, H)
    logits = g_t @ lm_head                      # the target's head, no final norm

`f_t` is the target's final-norm hidden state (what its LM head reads: the reference feeds
`base_model.model(...)[0]`, SGLang its captured hidden states; here
`LlamaForCausalLM.forward(..., return_hidden=True).hidden`). For later draft steps `f` is the
draft's own `g` of the parent token. Token t of the draft pairs `f_t` with token t+1, which the
caller arranges (prefill: input ids shifted left by one, the target's next token appended).

Embedding and LM head are the target's (the published checkpoints store a frozen copy of the
target embedding, SafeAILab/EAGLE #60; SGLang replaces it by the target's too), so the
checkpoint's `embed_tokens.weight` is checked for shape and dropped unless
`use_own_embed=True`.
"""

from __future__ import annotations

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.kernels import fused
from eaglekv.model.llama import (DecoderLayer, LlamaForCausalLM, ModelOutput, gemv_layout,
                                   linear, t)
from eaglekv.model.rope import RotaryEmbedding
from eaglekv.model.draft_checkpoint import LAYER, EagleDraftConfig, check_eagle_state_dict
from eaglekv.model.draft_io import check_against_target, spread_logits


class EagleDraftModel:
    def __init__(self, cfg: EagleDraftConfig, sd: dict[str, torch.Tensor],
                 target: LlamaForCausalLM, dtype: torch.dtype,
                 device: torch.device | str = "cpu", *, use_own_embed: bool = False,
                 vocab_ids: torch.Tensor | None = None):
        """`vocab_ids`: the target ids this head may propose (draft_io.read_draft_vocab);
        its LM head is then the target's columns of them and its logits are spread back over
        the target vocabulary, -inf elsewhere. None: the whole vocabulary."""
        # 1. config: checked against the target whose hidden states and head it uses
        check_against_target(cfg, target.cfg)
        check_eagle_state_dict(cfg, sd)
        if use_own_embed and not cfg.has_embed:
            raise ModelLoadError("use_own_embed=True but the draft checkpoint has no "
                                 "embed_tokens.weight")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.target = target
        # 2. weights, stored (in, out) like the target's
        sd = {n: w.to(device=device, dtype=dtype) for n, w in sd.items()}
        self.fc = t(sd["fc.weight"])                                   # (2H, H)
        self.fc_bias = sd.get("fc.bias") if cfg.fc_bias else None     # (H,)
        self.layer = DecoderLayer(cfg.layer_config(), {
            n[len(LAYER):]: w for n, w in sd.items() if n.startswith(LAYER)})
        if self.device.type == "cuda" and fused.DRAFT_GEMV and fused.gemv_on(self.device):
            gemv_layout([self.layer], self.device)      # its decode-sized forwards: gemv
        self.embed = sd["embed_tokens.weight"] if use_own_embed else None  # (V, H)
        # (H, V), shared with the target (a copy only when dtype or device differ); (H, Vd),
        # the target's columns of `vocab_ids`, with a reduced vocabulary
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(device)
        self.lm_head_t = (target.lm_head_t.to(device=device, dtype=dtype) if vocab_ids is None
                          else target.lm_head_t.index_select(1, vocab_ids.to(
                              target.lm_head_t.device)).to(device=device, dtype=dtype))
        # 3. RoPE with the draft's own theta/scaling, as many positions as the target serves
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, target.rope.max_positions, device)

    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers=1, kv_heads, head_dim): build the draft pool as
        `KVPool(size, page_size, *draft.kv_shape(), dtype, device)`."""
        return self.cfg.kv_shape

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, H)."""
        if self.embed is not None:
            return self.embed.index_select(0, ids)
        return self.target.embed_tokens(ids).to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                backend, meta, logits_indices: torch.Tensor | None = None) -> ModelOutput:
        """One draft extend over the draft pool's layer 0.

        input_ids, positions: (T,) int64; hidden: (T, H) the feature paired with each token;
        `meta` is `backend.init_forward_metadata(batch)` of the batch these tokens form.
        Returns logits (n, V) at `logits_indices` (all T when None) and hidden (T, H), the
        draft's output feature g (no norm), which feeds the next draft step.
        """
        e = self.embed_tokens(input_ids)                                          # (T, H)
        x = linear(torch.cat([e, hidden.to(self.dtype)], -1), self.fc, self.fc_bias)  # (T, H)
        x, residual = self.layer.forward(x, None, backend.rope_inputs(self.rope, positions),
                                         backend, meta, 0)
        g = residual + x                                                          # (T, H)
        gs = g if logits_indices is None else g[logits_indices]                   # (n, H)
        logits = linear(gs, self.lm_head_t)                                      # (n, V or Vd)
        if self.vocab_ids is not None:
            logits = spread_logits(logits, self.vocab_ids, self.cfg.vocab_size)  # (n, V)
        return ModelOutput(logits=logits, hidden=g)
