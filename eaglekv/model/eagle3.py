"""The EAGLE-3 draft head on its own one-layer paged KV pool.

Forward (SafeAILab/EAGLE `cnets.py: Model.forward` + `LlamaDecoderLayeremb`, SGLang
`llama_eagle3.py`):

    h   = fc(a_t) if a_t is 3H wide else a_t   # a_t: target aux hiddens (3H) or the draft's g (H)
    r   = h                                    # (norm_before_residual: r = hidden_norm(h))
    x   = cat([input_layernorm(embed(token_t)), hidden_norm(h)])   # (T, 2H); embedding first
    r  += o_proj(attn(qkv(x)))                 # q/k/v read the 2H concat
    g_t = r + mlp(post_attention_layernorm(r)) # the draft's feature, (T, H), pre-norm
    logits = lm_head(norm(g_t))                # over the draft vocabulary (Vd)

`a_t` from the target is `cat(aux_hidden)` of `LlamaForCausalLM.forward(capture_layers=
Eagle3DraftModel.aux_layers(L))`: the outputs of layers (1, L//2 - 1, L - 4), i.e. the hidden
states entering layers [2, L//2, L-3] (DESIGN.md), concatenated in layer order. Later draft steps
feed the draft's own g of the parent token (H wide, no fc). Draft id i is target id
`i + d2t[i]`; `to_target_logits` spreads draft logits over the target vocabulary.

The embedding is the target's: the 8B head ships none, and SpecForge stores a frozen copy of the
target's (it loads the target embedding and never trains it), so the checkpoint's
`embed_tokens.weight` is checked for shape and dropped unless `use_own_embed=True`.
"""

from __future__ import annotations

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig
from eaglekv.kernels.fused import add_rms_norm
from eaglekv.kernels import fused
from eaglekv.model.llama import (DecoderLayer, LlamaForCausalLM, ModelOutput, gemv_layout,
                                   linear, t)
from eaglekv.model.rope import RotaryEmbedding
from eaglekv.model.draft_io import check_against_target, decoder_layer_config, spread_logits
from eaglekv.model.eagle3_checkpoint import MID, Eagle3DraftConfig, check_eagle3_state_dict


class Eagle3DraftModel:
    def __init__(self, cfg: Eagle3DraftConfig, sd: dict[str, torch.Tensor],
                 target: LlamaForCausalLM, dtype: torch.dtype,
                 device: torch.device | str = "cpu", *, use_own_embed: bool = False):
        # 1. config: checked against the target whose hidden states and embedding it uses
        check_against_target(cfg, target.cfg)
        check_eagle3_state_dict(cfg, sd)
        if use_own_embed and not cfg.has_embed:
            raise ModelLoadError("use_own_embed=True but the EAGLE-3 draft checkpoint has no "
                                 "embed_tokens.weight")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.target = target
        self.capture_layers = self.aux_layers(target.cfg.num_layers, cfg.aux_layer_ids)
        # 2. weights, stored (in, out); the layer's q/k rows go to the interleaved RoPE layout
        # and get fused by DecoderLayer (its qkv is (2H, q+2kv) here: q/k/v read the 2H concat)
        skip = ("d2t", "t2d") + (() if use_own_embed else ("embed_tokens.weight",))
        w = {n: x.to(device=device, dtype=dtype) for n, x in sd.items() if n not in skip}
        self.fc = t(w["fc.weight"])                                      # (3H, H)
        self.fc_bias = w.get("fc.bias") if cfg.fc_bias else None        # (H,)
        self.embed_norm = w[MID + "input_layernorm.weight"]             # (H,)
        self.hidden_norm = w[MID + "hidden_norm.weight"]                # (H,)
        own_norms = ("input_layernorm.weight", "hidden_norm.weight")  # applied here, not there
        self.layer = DecoderLayer(self.layer_config(), {
            n[len(MID):]: x for n, x in w.items()
            if n.startswith(MID) and not n.endswith(own_norms)})
        if self.device.type == "cuda" and fused.DRAFT_GEMV and fused.gemv_on(self.device):
            gemv_layout([self.layer], self.device)      # its decode-sized forwards: gemv
        self.norm = w["norm.weight"]                                     # (H,)
        self.lm_head_t = t(w["lm_head.weight"])                          # (H, Vd)
        self.embed = w["embed_tokens.weight"] if use_own_embed else None  # (V, H)
        # 3. vocabulary map: target id of draft id i = i + d2t[i]
        d2t = sd["d2t"].to(device=device, dtype=torch.int64)
        self.d2t_target_ids = torch.arange(cfg.draft_vocab_size, device=device) + d2t  # (Vd,)
        # 4. RoPE with the draft's own theta/scaling, as many positions as the target serves
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, target.rope.max_positions, device)

    def layer_config(self) -> ModelConfig:
        """What `DecoderLayer` reads to fuse the midlayer's weights."""
        return decoder_layer_config(self.cfg)

    @staticmethod
    def aux_layers(num_target_layers: int, override: tuple[int, ...] | None = None
                   ) -> tuple[int, ...]:
        """Target layer ids whose outputs to capture (`capture_layers`), in layer order.

        Default (1, L//2 - 1, L - 4): the hidden states entering layers [2, L//2, L-3], as SGLang
        (`layers_to_capture = [2, L//2, L-3]`, captured before those layers) and vLLM
        (`get_eagle3_aux_hidden_state_layers`) choose. `override` (from the config) is in the
        same output-id convention. The target concatenates captures in layer order, so the
        ids come back sorted.
        """
        L = num_target_layers
        ids = (1, L // 2 - 1, L - 4) if override is None else tuple(override)
        where = "default (1, L//2 - 1, L - 4)" if override is None else "config"
        if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < L for i in ids):
            raise ModelLoadError(f"EAGLE-3 aux layers {list(ids)} ({where}) must be 3 distinct "
                                 f"layer ids in [0, {L}) of the {L}-layer target"
                                 + (" (the default needs L >= 7)" if override is None else ""))
        return tuple(sorted(ids))

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

        input_ids, positions: (T,) int64; hidden: (T, 3H) the target's concatenated aux hiddens
        (fc applied) or (T, H) the draft's own previous output (no fc); `meta` is
        `backend.init_forward_metadata(batch)` of the batch these tokens form.
        Returns logits (n, Vd) over the draft vocabulary at `logits_indices` (all T when None)
        and hidden (T, H), the pre-norm feature g that feeds the next draft step.
        """
        c, lay = self.cfg, self.layer
        H, eps = c.hidden_size, c.rms_norm_eps
        if hidden.shape[-1] not in (H, 3 * H):
            raise ValueError(f"EAGLE-3 draft hidden has width {hidden.shape[-1]}; expected "
                             f"{3 * H} (target aux hiddens) or {H} (the draft's own output)")
        # the target layer's kernels (the same ops as the torch reference on the CPU): each
        # RMSNorm one launch (`add_rms_norm`), RoPE + the K/V store one (`forward_qkv`, where
        # the rotation by complex multiply was ~6 ops), add + RMSNorm + gate/up + SiLU*mul one
        # on a decode-sized batch (`DecoderLayer._mlp`); a draft step of the captured EAGLE
        # step graph is ~8 launches fewer (`bench/spec_graph_ops.py --algorithm eagle3`)
        h = hidden.to(self.dtype)
        if h.shape[-1] == 3 * H:
            h = linear(h, self.fc, self.fc_bias)                                 # (T, H)
        hn, _ = add_rms_norm(h, None, self.hidden_norm, eps, checked=False)      # (T, H)
        residual = hn if c.norm_before_residual else h
        e, _ = add_rms_norm(self.embed_tokens(input_ids), None, self.embed_norm, eps,
                            checked=False)                                       # (T, H)
        x = torch.cat([e, hn], -1)                                               # (T, 2H)
        T, nh, nkv, D = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = linear(x, lay.qkv, lay.qkv_bias).view(T, nh + 2 * nkv, D)         # (T, nh+2nkv, D)
        attn = backend.forward_qkv(qkv, backend.rope_inputs(self.rope, positions), 0, meta,
                                   D ** -0.5, nh, nkv)                           # (T, nh, D)
        # r = residual + o(attn); out = down(silu(gate) * up) of gate_up(post_norm(r))
        out, r = lay._mlp(attn, residual, T)
        g = r + out                                                              # (T, H)
        gs = g if logits_indices is None else g[logits_indices]                  # (n, H)
        logits = linear(add_rms_norm(gs, None, self.norm, eps, checked=False)[0],
                        self.lm_head_t)                                          # (n, Vd)
        return ModelOutput(logits=logits, hidden=g)

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(n, Vd) -> (n, V): column d2t_target_ids[i] = draft column i, -inf elsewhere (a
        target token outside the draft vocabulary can never be proposed)."""
        return spread_logits(draft_logits, self.d2t_target_ids, self.cfg.vocab_size)
