"""A Llama-family causal LM (Llama, SmolLM2, Mistral, Qwen2, Qwen3) on the paged KV pool.

RMSNorm, RoPE with the config's theta and scaling, GQA, SwiGLU, tied or untied embeddings,
optional q/k biases (Qwen2) and q/k norms (Qwen3). q/k/v and gate/up are fused into one matmul
each at load time. Attention reads and writes K/V only through the attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglekv.core import ForwardBatch
from eaglekv.errors import ModelLoadError
from eaglekv.kernels import fused
from eaglekv.kernels.fused import (add_rms_norm, column_major, fused_mlp, gemv, gemv_merge,
                                   merge_o, norm_matmul, use_fused_mlp, use_gemv,
                                   use_gemv_merge, use_merge_o)
from eaglekv.model import cpu_blas
from eaglekv.model.config import ModelConfig
from eaglekv.model.rope import RotaryEmbedding, to_interleaved


@dataclass
class ModelOutput:
    logits: torch.Tensor | None              # (len(logits_indices) or T, vocab)
    hidden: torch.Tensor | None = None       # (T, H) final-norm hidden of every token
    aux_hidden: list[torch.Tensor] | None = None  # outputs of the chosen layers, (T, H) each


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def t(w: torch.Tensor) -> torch.Tensor:
    """(out, in) -> contiguous (in, out): `x @ w_t` streams the weight row by row, measured
    ~10% faster than `F.linear` for batch-1 decode on CPU."""
    return w.t().contiguous()


def cpu_blas_threads() -> int | None:
    """torch intra-op threads the CPU engine should use (cpu_blas.threads)."""
    return cpu_blas.threads()


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (T, in) @ w_t: (in, out) (+ bias) -> (T, out). On CPU in fp32 by the library
    `cpu_blas` chooses (oneDNN on prepacked weights by default)."""
    y = cpu_blas.cpu_linear(x, w_t, bias)
    if y is not None:
        return y
    if bias is None and use_gemv(x, w_t):   # a decode-sized batch on CUDA (fused.py)
        return gemv(x, w_t)
    return torch.addmm(bias, x, w_t) if bias is not None else x @ w_t


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down", "fc", "lm_head_t")


def linear_weights(obj) -> list[torch.Tensor]:
    """The weights `linear` multiplies by, of a model, a draft model or a layer (its
    `layers` and `layer` too): what a CPU engine prepacks (cpu_blas.prepack)."""
    if obj is None:
        return []
    out = [w for name in LINEAR_WEIGHTS
           if isinstance(w := getattr(obj, name, None), torch.Tensor)]
    for lay in [*(getattr(obj, "layers", None) or []), getattr(obj, "layer", None)]:
        if lay is not None and lay is not obj:
            out += linear_weights(lay)
    return out


def fuse_layer(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's Hugging Face tensors -> the engine's layout, stored (in, out): qkv
    (H, q+2kv), o (q, H), gate_up (H, 2I), down (I, H). Entries of `w` are popped as they are
    fused, so the caller's dict does not keep a second copy."""
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    f = {"post_norm": w.pop("post_attention_layernorm.weight")}
    if "input_layernorm.weight" in w:   # absent: no input norm (EAGLE layer 0)
        f["input_norm"] = w.pop("input_layernorm.weight")
    # q/k rows go to the interleaved RoPE layout (see rope.py); v stays as it is
    f["qkv"] = t(torch.cat([to_interleaved(w.pop("self_attn.q_proj.weight"), H),
                            to_interleaved(w.pop("self_attn.k_proj.weight"), Hkv),
                            w.pop("self_attn.v_proj.weight")], 0))
    if cfg.attention_bias:
        f["qkv_bias"] = torch.cat([to_interleaved(w.pop("self_attn.q_proj.bias"), H),
                                   to_interleaved(w.pop("self_attn.k_proj.bias"), Hkv),
                                   w.pop("self_attn.v_proj.bias")])
    f["o"] = t(w.pop("self_attn.o_proj.weight"))
    if cfg.qk_norm:
        f["q_norm"] = to_interleaved(w.pop("self_attn.q_norm.weight"), 1)
        f["k_norm"] = to_interleaved(w.pop("self_attn.k_norm.weight"), 1)
    f["gate_up"] = t(torch.cat([w.pop("mlp.gate_proj.weight"), w.pop("mlp.up_proj.weight")], 0))
    f["down"] = t(w.pop("mlp.down_proj.weight"))
    return f


class DecoderLayer:
    """Weights of one layer in the fused layout of `fuse_layer` (`fused=False`: Hugging Face
    names, fused here)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], fused: bool = False):
        self.cfg = cfg
        f = w if fused else fuse_layer(cfg, dict(w))
        self.input_norm = f.get("input_norm")  # None: no input norm (EAGLE layer 0)
        self.post_norm = f["post_norm"]
        self.qkv, self.qkv_bias, self.o = f["qkv"], f.get("qkv_bias"), f["o"]
        self.q_norm, self.k_norm = f.get("q_norm"), f.get("k_norm")
        self.gate_up, self.down = f["gate_up"], f["down"]
        # the fused MLP's and merge + o's (`LlamaForCausalLM.prepare_accumulators`): down by
        # rows (I, H), this layer's fp32 accumulators and the next layer's, which it clears.
        # down_rows is a copy where down is column-major: weights are read-only after the
        # build (a test helper that zeroes down in place must zero down_rows too)
        self.down_rows = self.mlp_acc = self.mlp_zero = self.o_acc = self.o_zero = None

    @property
    def one_kernel_qkv(self) -> bool:
        """The layer's add + RMSNorm + qkv goes through `backend.forward_norm_qkv` (an input
        norm, no q/k/v bias, no q/k norm): the path that also takes an fp32 x."""
        return self.input_norm is not None and self.qkv_bias is None and self.q_norm is None

    def forward(self, x, residual, rope, backend, meta, layer_id):
        """x: (T, H) the previous layer's output (the residual stream not yet added), `rope`
        what `backend.rope_inputs` gave for this forward -> (output, residual)."""
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.one_kernel_qkv:
            # add + RMSNorm + QKV matmul: one kernel on a decode-sized batch (fused.py), RoPE
            # and the K/V store after it (on the Triton backend optionally in its epilogue)
            # the attention's merge with the o projection in one launch (merge_o), or inside
            # its gemv (gemv_merge)
            mo = use_merge_o(x, self.o, H, self.o_acc)
            merge = not mo and use_gemv_merge(x, self.o, H)
            attn, residual = backend.forward_norm_qkv(
                x, residual, self.input_norm, cfg.rms_norm_eps, self.qkv, rope, layer_id, meta,
                D ** -0.5, H, Hkv, matmul=linear,
                **({"defer_merge": True} if merge or mo else {}))
            return self._mlp(attn, residual, T, merge, mo)
        if self.input_norm is not None and self.qkv_bias is None:
            qkv, residual = norm_matmul(x, residual, self.input_norm, cfg.rms_norm_eps,
                                        self.qkv, matmul=linear)
        else:
            if self.input_norm is None:   # EAGLE's layer 0 has no input norm
                residual = x if residual is None else residual + x
                h = residual
            else:
                h, residual = add_rms_norm(x, residual, self.input_norm, cfg.rms_norm_eps,
                                           checked=False)
            qkv = linear(h, self.qkv, self.qkv_bias)
        qkv = qkv.view(T, H + 2 * Hkv, D)                                 # (T, H+2Hkv, D)
        if self.q_norm is not None:
            qkv = torch.cat([rms_norm(qkv[:, :H], self.q_norm, cfg.rms_norm_eps),
                             rms_norm(qkv[:, H:H + Hkv], self.k_norm, cfg.rms_norm_eps),
                             qkv[:, H + Hkv:]], 1)
        # RoPE on q and k, K/V into the cache, attention: (T, H, D)
        attn = backend.forward_qkv(qkv, rope, layer_id, meta, D ** -0.5, H, Hkv)
        return self._mlp(attn, residual, T)

    def _mlp(self, attn, residual, T: int, merge: bool = False, mo: bool = False):
        """The o projection (`merge`: by `gemv_merge`, `mo`: by `merge_o` into the fp32
        accumulator; attn maybe still split-K partials), then add + RMSNorm + gate/up matmul
        + SiLU*mul (one kernel on a decode-sized batch) and the down projection, or all of
        that in one launch (`fused_mlp`) -> (output, residual)."""
        cfg = self.cfg
        if mo:
            x = merge_o(attn, self.o, self.o_acc, self.o_zero)
        elif merge:
            x = gemv_merge(attn, self.o)
        else:
            x = linear(attn.reshape(T, cfg.q_size), self.o)
        if use_fused_mlp(x, self.gate_up, self.down_rows):     # one launch; x out in fp32
            return fused_mlp(x, residual, self.post_norm, cfg.rms_norm_eps, self.gate_up,
                             self.down_rows, self.mlp_acc, self.mlp_zero)
        act, residual = norm_matmul(x, residual, self.post_norm, cfg.rms_norm_eps, self.gate_up,
                                    silu_mul=True, matmul=linear)
        return linear(act, self.down), residual


def gemv_layout(layers: list[DecoderLayer], device: torch.device) -> None:
    """The layers' (in, out) matrices stored as nn.Linear's (out, in) rows (`column_major`),
    so that their decode-sized matmuls go to the gemv kernel (kernels/fused.py) and the others
    to cuBLAS: those that carry the norm (qkv, gate_up), and the bare ones (o, down) too where
    every matmul takes the kernel (`fused.gemv_on(device, False)`: PDL on, or EAGLEKV_GEMV=1).
    The target's layers on CUDA; a draft's one layer where `fused.DRAFT_GEMV` says so."""
    names = ("qkv", "gate_up") + (("o", "down") if fused.gemv_on(device, False) else ())
    for layer in layers:
        for name in names:
            setattr(layer, name, column_major(getattr(layer, name)))


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes this config needs."""
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return shapes


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape; nothing unexplained left over."""
    want = expected_tensors(cfg)
    for name, shape in want.items():
        if name not in sd:
            raise ModelLoadError(f"missing tensor {name} (expected shape {shape})")
        if tuple(sd[name].shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(sd[name].shape)}, "
                                 f"config expects {shape}")
    extra = [n for n in sd if n not in want and not n.endswith(IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if extra:
        raise ModelLoadError(f"{len(extra)} unexpected tensors for model_type={cfg.model_type!r}, "
                             f"e.g. {extra[:3]}")


LAYOUT_VERSION = 1   # of `fuse_weights`' output; bump when it changes (the weight cache's key)


def fuse_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A checked Hugging Face state dict -> the engine's layout, in `dtype` on `device`:
    `lm_head_t` (H, V), `embed` (V, H, untied only), `norm`, `layers.{i}.{fuse_layer's names}`.
    `sd` is emptied as it goes: a layer's inputs are freed once it is fused."""
    check_state_dict(cfg, sd)
    get = lambda n: sd.pop(n).to(device=device, dtype=dtype)  # noqa: E731
    # the LM head, stored (in, out); tied models look embeddings up in it too
    embed = get("model.embed_tokens.weight")
    out = {"lm_head_t": t(embed if cfg.tie_word_embeddings else get("lm_head.weight")),
           "norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["embed"] = embed
    del embed
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {n[len(p):]: get(n) for n in [n for n in sd if n.startswith(p)]}
        out.update({f"layers.{i}.{k}": v for k, v in fuse_layer(cfg, layer).items()})
    sd.clear()   # what check_state_dict tolerates (inv_freq, a tied lm_head)
    return out


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_positions: int | None = None):
        """From a Hugging Face state dict (copied, then fused); `from_fused` takes the layout."""
        self._build(cfg, fuse_weights(cfg, dict(sd), dtype, device), dtype, device, max_positions)

    @classmethod
    def from_fused(cls, cfg: ModelConfig, w: dict[str, torch.Tensor],
                   device: torch.device | str = "cpu", max_positions: int | None = None
                   ) -> "LlamaForCausalLM":
        """From `fuse_weights`' output (e.g. memory-mapped from the weight cache): on CPU the
        model holds those very tensors, no copy."""
        model = cls.__new__(cls)
        model._build(cfg, {n: v.to(device) for n, v in w.items()}, w["norm"].dtype, device,
                     max_positions)
        return model

    def _build(self, cfg, w, dtype, device, max_positions):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self._acc = None                 # prepare_accumulators
        self.lm_head_t, self.embed, self.norm = w["lm_head_t"], w.get("embed"), w["norm"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            self.layers.append(DecoderLayer(cfg, {n[len(p):]: v for n, v in w.items()
                                                  if n.startswith(p)}, fused=True))
        if self.device.type == "cuda" and fused.gemv_on(self.device):
            gemv_layout(self.layers, self.device)
            if fused.FUSE_MLP or fused.MERGE_O:
                self.prepare_accumulators()
        self.rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim,
                                    max_positions or cfg.max_position_embeddings, device)

    def prepare_accumulators(self) -> None:
        """Make every layer ready for the fused MLP (`fused.fused_mlp`) and the merge + o
        projection in one launch (`fused.merge_o`), each used where its `use_*` says so: down
        kept by rows (I, H) where the MLP is small enough (`fused.MLP_MAX_WEIGHT_BYTES`), and
        fp32 accumulators of MLP_MAX_ROWS rows, two of each kind taken in turn: layer i adds
        into its kind's buffer i % 2 and clears buffer (i + 1) % 2 for layer i + 1 (its last
        reader, layer i - 1's, is done by then), and each forward a fusion takes
        (`fused.accumulated_rows`) clears both buffers 0 before layer 0. The buffers live as
        long as the model, so every CUDA graph of it replays over the same ones, one forward
        at a time."""
        if not all(layer.one_kernel_qkv for layer in self.layers):
            self._acc = None     # q/k/v biases or norms: the next layer's add + RMSNorm would
            return               # not take the fp32 x (Qwen2, Qwen3 keep the unfused kernels)
        self._acc = torch.zeros((2, 2, fused.MLP_MAX_ROWS, self.cfg.hidden_size),
                                dtype=torch.float32, device=self.device)
        for i, layer in enumerate(self.layers):
            small = ((layer.gate_up.numel() + layer.down.numel()) * layer.down.element_size()
                     <= fused.MLP_MAX_WEIGHT_BYTES)
            # a copy where down is column-major for the gemv (SmolLM2: 53 MB in all)
            layer.down_rows = layer.down.contiguous() if fused.FUSE_MLP and small else None
            now, nxt = self._acc[i % 2], self._acc[(i + 1) % 2]
            layer.mlp_acc, layer.mlp_zero = now[0], nxt[0]
            layer.o_acc, layer.o_zero = now[1], nxt[1]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, H)."""
        if self.embed is not None:
            return self.embed.index_select(0, ids)
        return self.lm_head_t.index_select(1, ids).t().contiguous()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend, logits_indices: torch.Tensor | None = None,
                return_hidden: bool = False, capture_layers: tuple[int, ...] = ()) -> ModelOutput:
        """Extend every request of `batch`; logits at `logits_indices` (flat token ids) or all.

        `capture_layers` lists layer ids whose outputs (the residual stream after that layer)
        are returned in `aux_hidden`, for EAGLE-3.
        """
        meta = backend.init_forward_metadata(batch)
        return self.forward_tokens(batch.input_ids, batch.positions, backend, meta,
                                   logits_indices, return_hidden, capture_layers)

    @torch.inference_mode()
    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta,
                       logits_indices: torch.Tensor | None = None, return_hidden: bool = False,
                       capture_layers: tuple[int, ...] = ()) -> ModelOutput:
        """The forward over prepared attention metadata: (T,) ids and positions. Device work
        only (no host sync, no shape read from the device), so a CUDA graph can capture it."""
        meta = backend.begin_forward(meta)          # the reads of every layer, checked once
        rope = backend.rope_inputs(self.rope, positions)
        x = self.embed_tokens(input_ids)                                 # (T, H)
        if self._acc is not None and 0 < x.shape[0] <= fused.accumulated_rows():
            self._acc[0].zero_()      # layer 0's accumulators (prepare_accumulators)
        residual, aux = None, []
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward(x, residual, rope, backend, meta, i)
            if i in capture_layers:    # (the fused MLP's x is fp32: rounded once, as a layer)
                aux.append((residual + x).to(residual.dtype))
        if x.dtype != residual.dtype:
            x = x.to(residual.dtype)
        h, _ = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)  # (T, H)
        hs = h if logits_indices is None else h[logits_indices]
        logits = linear(hs, self.lm_head_t)                              # (n, V)
        return ModelOutput(logits=logits, hidden=h if return_hidden else None,
                           aux_hidden=aux if capture_layers else None)
