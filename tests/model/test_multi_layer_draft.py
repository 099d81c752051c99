"""Multi-layer EAGLE draft: each head's paged forward, on its own one-layer pool, equals a
plain-torch EAGLE-1 head with that layer's weights over prefill and cached extends; heads do
not touch each other's pools; checkpoints round-trip; every mismatch gets its own error."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from draft_helpers import DraftRunner, gather, target_embed_head
from eaglekv.errors import ModelLoadError
from eaglekv.model.llama import LlamaForCausalLM
from eaglekv.model.loader import load_hf_dir
from eaglekv.model.draft_checkpoint import random_eagle_draft, save_eagle_draft
from eaglekv.model.multi_layer_eagle import (MultiLayerDraftConfig, MultiLayerDraftModel,
                                            load_multi_layer_draft, random_multi_layer_draft,
                                            save_multi_layer_draft)
from helpers import make_tiny

TARGETS = {
    "untied": {},
    "tied_llama3_rope": dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    """(LlamaForCausalLM, its HF state dict) of a tiny random Llama."""
    path = tmp_path_factory.mktemp(request.param)
    make_tiny(path, **TARGETS[request.param])
    cfg, sd = load_hf_dir(path)
    return LlamaForCausalLM(cfg, sd, torch.float32), sd


# ---- the reference: one EAGLE-1 head in plain torch (HF rotate-half RoPE), full causal -------
def reference_head(cfg_dict, sd, k, embed_w, head_w, ids, hidden):
    """Layer k of the checkpoint over the whole sequence; returns (logits (T, V), g (T, H))."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    H, nh = cfg_dict["hidden_size"], cfg_dict["num_attention_heads"]
    nkv, eps = cfg_dict["num_key_value_heads"], cfg_dict["rms_norm_eps"]
    D = cfg_dict.get("head_dim") or H // nh
    T, p = len(ids), f"layers.{k}."

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x = F.linear(torch.cat([embed_w[ids], hidden], -1), sd[p + "fc.weight"], sd.get(p + "fc.bias"))
    q = F.linear(x, sd[p + "self_attn.q_proj.weight"]).view(1, T, nh, D).transpose(1, 2)
    kk = F.linear(x, sd[p + "self_attn.k_proj.weight"]).view(1, T, nkv, D).transpose(1, 2)
    v = F.linear(x, sd[p + "self_attn.v_proj.weight"]).view(1, T, nkv, D).transpose(1, 2)
    # q: (1, nh, T, D); kk, v: (1, nkv, T, D)
    rope = LlamaRotaryEmbedding(LlamaConfig(**{a: b for a, b in cfg_dict.items()
                                               if a not in ("model_type", "architectures")}))
    cos, sin = rope(v, torch.arange(T)[None])
    q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
    kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(D)                      # (1, nh, T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(T, nh * D)
    r = x + F.linear(attn, sd[p + "self_attn.o_proj.weight"])
    m = norm(r, sd[p + "post_attention_layernorm.weight"])
    g = r + F.linear(F.silu(F.linear(m, sd[p + "mlp.gate_proj.weight"]))
                     * F.linear(m, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
    return g @ head_w.T, g


# ---- paged runs: S pools, one ReqToTokenPool and one allocator ---------------------------------
def run_heads(runner, seqs, chunks):
    """seqs[b] = (ids (S, T_b), hidden (S, T_b, H)): head k reads ids[k], hidden[k] at the
    same positions and slots; chunks[r][b]: tokens request b adds in round r.
    Returns out[k][b] = (logits (T_b, V), g (T_b, H)) gathered over the rounds."""
    S = runner.draft.num_layers
    per_round = [[runner.forward(rnd, [s[0][k] for s in seqs],
                                 torch.cat(rnd.take([s[1][k] for s in seqs])), layer=k)
                  for k in range(S)] for rnd in runner.rounds(chunks)]
    return [gather([heads[k] for heads in per_round]) for k in range(S)]


def runner_for(draft, page_size):
    return DraftRunner(draft, page_size, num_pools=draft.num_layers)


def make_seq(S, n, H, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (S, n), generator=g), torch.randn(S, n, H, generator=g)


def build(model, S, seed=3, **kw):
    cfg_dict, sd = random_multi_layer_draft(model.cfg, S, seed=seed, std=0.1, **kw)
    draft = MultiLayerDraftModel(MultiLayerDraftConfig.from_dict(cfg_dict, sd), sd, model,
                                 torch.float32)
    return cfg_dict, sd, draft


VARIANTS = {"bias": {}, "no_bias_mha_embed": dict(fc_bias=False, num_heads=2,
                                                  intermediate_size=96, with_embed=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("S", [1, 3])
def test_each_head_matches_reference(target, S, page_size, variant):
    """Two requests, a prefill then extends of 1-3 tokens on the cached prefix, every head on
    its own pool: logits and output feature of every position equal the reference EAGLE-1
    head with that layer's weights on the full sequence (fp32, 1e-4)."""
    model, tsd = target
    H = model.cfg.hidden_size
    cfg_dict, sd, draft = build(model, S, **VARIANTS[variant])
    D = cfg_dict.get("head_dim") or H // cfg_dict["num_attention_heads"]
    assert draft.num_layers == S
    assert draft.kv_shape() == draft.cfg.kv_shape == (1, cfg_dict["num_key_value_heads"], D)
    seqs = [make_seq(S, 14, H, 1), make_seq(S, 9, H, 2)]
    got = run_heads(runner_for(draft, page_size), seqs, [[8, 5], [1, 2], [3, 1], [2, 1]])
    emb, head = target_embed_head(tsd, model.cfg.tie_word_embeddings)
    for k in range(S):
        for (ids, hid), (lg, g) in zip(seqs, got[k]):
            ref_lg, ref_g = reference_head(cfg_dict, sd, k, emb, head, ids[k], hid[k])
            torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lg, ref_lg, rtol=1e-4, atol=1e-4)
    if S > 1:  # the heads really differ (a shared-weights bug would pass the loop above)
        ids, hid = seqs[0]
        a = reference_head(cfg_dict, sd, 0, emb, head, ids[0], hid[0])[1]
        b = reference_head(cfg_dict, sd, 1, emb, head, ids[0], hid[0])[1]
        assert not torch.allclose(a, b, atol=1e-2)


def one_batch(runner, n, seed):
    ids, hid = make_seq(1, n, runner.draft.cfg.hidden_size, seed)
    batch, slots = runner.prefill_batch(ids[0])
    return batch, hid[0], slots


def test_heads_are_independent(target):
    """Head 1 writes only its own pool (the slots of the batch); head 0's pool is untouched,
    and head 0's output does not depend on whether head 1 ran."""
    model, _ = target
    _, _, draft = build(model, 3)
    runner = runner_for(draft, 1)
    batch, hid, slots = one_batch(runner, 6, 7)
    be = runner.backends
    run = lambda k: draft.forward(k, batch.input_ids, batch.positions, hid,  # noqa: E731
                                  be[k], be[k].init_forward_metadata(batch))
    first = run(0)
    k0, v0 = (b.clone() for b in runner.pools[0].get_kv_buffer(0))
    run(1)
    assert torch.equal(runner.pools[0].k_buffer[0], k0)
    assert torch.equal(runner.pools[0].v_buffer[0], v0)
    k1 = runner.pools[1].k_buffer[0]
    assert k1[slots].abs().sum() > 0
    others = torch.ones(k1.shape[0], dtype=torch.bool)
    others[slots] = False
    assert k1[others].abs().sum() == 0 and runner.pools[2].k_buffer[0].abs().sum() == 0
    assert not torch.allclose(k1[slots], k0[slots])
    torch.testing.assert_close(run(0).logits, first.logits, rtol=0, atol=0)


def test_logits_indices_and_compute_logits(target):
    model, _ = target
    _, _, draft = build(model, 2)
    runner = runner_for(draft, 1)
    batch, hid, _ = one_batch(runner, 6, 9)
    be = runner.backends[1]
    fwd = lambda **kw: draft.forward(1, batch.input_ids, batch.positions, hid, be,  # noqa: E731
                                     be.init_forward_metadata(batch), **kw)
    full = fwd()
    part = fwd(logits_indices=torch.tensor([5, 2]))
    torch.testing.assert_close(part.logits, full.logits[[5, 2]])
    torch.testing.assert_close(part.hidden, full.hidden)
    none = fwd(compute_logits=False)
    assert none.logits is None
    torch.testing.assert_close(none.hidden, full.hidden)
    with pytest.raises(IndexError, match=r"draft layer=2 out of range \[0, 2\)"):
        draft.forward(2, batch.input_ids, batch.positions, hid, be, None)


def test_shared_tensors(target):
    """Every head reads the target's LM head and one RoPE table (not S copies)."""
    model, _ = target
    _, _, draft = build(model, 3)
    assert all(h.lm_head_t is model.lm_head_t for h in draft.heads)
    assert all(h.rope is draft.heads[0].rope for h in draft.heads)
    assert all(h.embed is None for h in draft.heads)


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,shards,prefix", [("bin", 1, ""), ("safetensors", 1, ""),
                                               ("safetensors", 2, "model.")])
@pytest.mark.parametrize("S", [1, 3])
def test_save_load_round_trip(target, tmp_path, fmt, shards, prefix, S):
    model, _ = target
    cfg_dict, sd = random_multi_layer_draft(model.cfg, S, seed=1, fc_bias=False, with_embed=True)
    save_multi_layer_draft(tmp_path, cfg_dict, {prefix + n: w for n, w in sd.items()}, fmt, shards)
    cfg, sd2 = load_multi_layer_draft(tmp_path, model.cfg)
    assert sd2.keys() == sd.keys()
    assert all(torch.equal(sd[n], sd2[n]) for n in sd)
    assert cfg == MultiLayerDraftConfig.from_dict(cfg_dict, sd)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.fc_bias, cfg.has_embed) == \
        (S, 64, 256, False, True)
    assert cfg.kv_shape == (1, model.cfg.num_kv_heads, model.cfg.head_dim)
    assert f"layers.{S - 1}.fc.weight" in sd2 and "fc.weight" not in sd2
    MultiLayerDraftModel(cfg, sd2, model, torch.float32)


def _set(d, k, v):
    d[k] = v


def _eagle1(tmp_path, tcfg):
    cfg_dict, sd = random_eagle_draft(tcfg)
    save_eagle_draft(tmp_path, cfg_dict, sd, "safetensors")


def _mtp(sd):
    sd.update({"layers.3.eh_proj.weight": torch.zeros(64, 128),
               "layers.3.enorm.weight": torch.zeros(64)})


CASES = {
    "hidden": (dict(tcfg=lambda c: dataclasses.replace(c, hidden_size=32, head_dim=8)),
               "draft hidden_size=32 differs from the target's hidden_size=64"),
    "vocab": (dict(tcfg=lambda c: dataclasses.replace(c, vocab_size=300)),
              "draft vocab_size=300 differs from the target's vocab_size=256"),
    "missing": (dict(edit_sd=lambda sd: sd.pop("layers.1.mlp.up_proj.weight")),
                "missing tensor layers.1.mlp.up_proj.weight (expected shape (128, 64))"),
    "missing_bias": (dict(edit_sd=lambda sd: sd.pop("layers.2.fc.bias")),
                     "missing tensor layers.2.fc.bias (expected shape (64,))"),
    "shape": (dict(edit_sd=lambda sd: _set(sd, "layers.2.self_attn.o_proj.weight",
                                           torch.zeros(64, 32))),
              "layers.2.self_attn.o_proj.weight has shape (64, 32), config expects (64, 64)"),
    "fc_shape": (dict(edit_sd=lambda sd: _set(sd, "layers.0.fc.weight", torch.zeros(64, 192))),
                 "layers.0.fc.weight has shape (64, 192), config expects (64, 128)"),
    "embed_shape": (dict(edit_sd=lambda sd: _set(sd, "embed_tokens.weight", torch.zeros(255, 64))),
                    "embed_tokens.weight has shape (255, 64), config expects (256, 64)"),
    "unexpected_input_norm": (dict(edit_sd=lambda sd: _set(
        sd, "layers.1.input_layernorm.weight", torch.ones(64))),
        "1 unexpected tensors, e.g. ['layers.1.input_layernorm.weight']"),
    "unexpected_lm_head": (dict(edit_sd=lambda sd: _set(sd, "lm_head.weight",
                                                        torch.zeros(256, 64))),
                           "unexpected tensors, e.g. ['lm_head.weight']"),
    "eagle1": (dict(whole=_eagle1), "this is an EAGLE-1/2 draft; use algorithm='eagle'"),
    "eagle3_tensors": (dict(edit_sd=lambda sd: sd.update(
        {"midlayer.self_attn.q_proj.weight": torch.zeros(64, 128), "d2t": torch.zeros(8)})),
        "this is an EAGLE-3 draft; use algorithm='eagle3'"),
    "eagle3_config": (dict(edit_cfg=lambda d: _set(d, "draft_vocab_size", 32)),
                      "this is an EAGLE-3 draft; use algorithm='eagle3'"),
    "mtp_config": (dict(edit_cfg=lambda d: _set(d, "num_nextn_predict_layers", 1)),
                   "DeepSeek-style MTP checkpoint (config has num_nextn_predict_layers=1); "
                   "eaglekv does not support it"),
    "mtp_tensors": (dict(edit_sd=_mtp), "DeepSeek-style MTP checkpoint (tensor layers.3.eh_proj"),
    "mtp_shared_head": (dict(edit_sd=lambda sd: _set(sd, "model.layers.3.shared_head.head.weight",
                                                     torch.zeros(256, 64))),
                        "DeepSeek-style MTP checkpoint (tensor layers.3.shared_head.head.weight"),
    "too_few_layers": (dict(edit_cfg=lambda d: _set(d, "num_hidden_layers", 2)),
                       "num_hidden_layers=2 but the checkpoint holds layers [0, 1, 2] (3 layers)"),
    "too_many_layers": (dict(edit_cfg=lambda d: _set(d, "num_hidden_layers", 4)),
                        "num_hidden_layers=4 but the checkpoint holds layers [0, 1, 2] (3 layers)"),
    "layer_gap": (dict(edit_sd=lambda sd: [sd.pop(n) for n in list(sd)
                                           if n.startswith("layers.1.")]),
                  "num_hidden_layers=3 but the checkpoint holds layers [0, 2] (2 layers)"),
    "zero_layers": (dict(edit_cfg=lambda d: _set(d, "num_hidden_layers", 0)),
                    "num_hidden_layers=0; a multi-layer draft needs an int >= 1"),
    "architecture": (dict(edit_cfg=lambda d: _set(d, "architectures", ["LlamaForCausalLM"])),
                     "architectures=['LlamaForCausalLM']; a multi-layer EAGLE draft says "
                     "['EagleKVMultiLayerDraft']"),
    "qkv_bias": (dict(edit_cfg=lambda d: _set(d, "qkv_bias", True)),
                 "qkv_bias/attention_bias=true is unsupported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_has_its_own_error(target, tmp_path, case):
    model, _ = target
    kw, msg = CASES[case]
    tcfg = kw.get("tcfg", lambda c: c)(model.cfg)
    if "whole" in kw:
        kw["whole"](tmp_path, tcfg)
    else:
        cfg_dict, sd = random_multi_layer_draft(tcfg, 3, with_embed=True)
        kw.get("edit_cfg", lambda d: None)(cfg_dict)
        kw.get("edit_sd", lambda s: None)(sd)
        save_multi_layer_draft(tmp_path, cfg_dict, sd, "safetensors")
    with pytest.raises(ModelLoadError) as e:
        load_multi_layer_draft(tmp_path, model.cfg)
    assert msg in str(e.value)


def test_missing_files(target, tmp_path):
    model, _ = target
    with pytest.raises(ModelLoadError, match="multi-layer draft path .* does not exist"):
        load_multi_layer_draft(tmp_path / "nope", model.cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_multi_layer_draft(tmp_path / "empty", model.cfg)
    cfg_dict, sd = random_multi_layer_draft(model.cfg, 2)
    save_multi_layer_draft(tmp_path / "ok", cfg_dict, sd)
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_multi_layer_draft(tmp_path / "ok" / "config.json", model.cfg)
    (tmp_path / "ok" / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="no weights in .*pytorch_model.bin or"):
        load_multi_layer_draft(tmp_path / "ok", model.cfg)
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        load_multi_layer_draft(tmp_path / "ok", model.cfg)


def test_model_checks_target_and_tensors(target):
    """Built straight from a state dict (no loader), the model still checks everything."""
    model, _ = target
    other = dataclasses.replace(model.cfg, vocab_size=512)
    cfg_dict, sd = random_multi_layer_draft(other, 2)
    with pytest.raises(ModelLoadError, match="vocab_size=512 differs"):
        MultiLayerDraftModel(MultiLayerDraftConfig.from_dict(cfg_dict, sd), sd, model,
                             torch.float32)
    cfg_dict, sd = random_multi_layer_draft(model.cfg, 2)
    cfg = MultiLayerDraftConfig.from_dict(cfg_dict, sd)
    sd.pop("layers.1.fc.weight")
    with pytest.raises(ModelLoadError, match="missing tensor layers.1.fc.weight"):
        MultiLayerDraftModel(cfg, sd, model, torch.float32)
