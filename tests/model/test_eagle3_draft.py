"""EAGLE-3 draft head: its paged forward equals a plain-torch reference of the published module
(SafeAILab/EAGLE cnets.py `Model` + `LlamaDecoderLayeremb`) over a 3H extend, H-wide decode
steps on the cached prefix and a further 3H extend; the draft->target vocabulary map; aux layer
choice; checkpoints round-trip in both formats; every mismatch gets its own error."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from draft_helpers import DraftRunner, gather
from eaglekv.attention import TorchAttentionBackend
from eaglekv.errors import ModelLoadError
from eaglekv.memory import KVPool
from eaglekv.model.llama import LlamaForCausalLM
from eaglekv.model.loader import load_hf_dir
from eaglekv.model.draft_checkpoint import load_eagle_draft, random_eagle_draft, save_eagle_draft
from eaglekv.model.eagle3 import Eagle3DraftModel
from eaglekv.model.eagle3_checkpoint import (Eagle3DraftConfig, load_eagle3_draft, random_eagle3_draft,
                                        save_eagle3_draft)
from helpers import make_tiny

VD = 40  # draft vocabulary of the tiny heads (target vocabulary 256)
TARGETS = {  # 8 layers: the default aux layers (1, L//2 - 1, L - 4) need L >= 7
    "untied": dict(num_hidden_layers=8),
    "tied_llama3_rope": dict(num_hidden_layers=8, tie_word_embeddings=True, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=64)),
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    """(LlamaForCausalLM, its HF state dict) of a tiny random Llama."""
    path = tmp_path_factory.mktemp(request.param)
    make_tiny(path, **TARGETS[request.param])
    cfg, sd = load_hf_dir(path)
    return LlamaForCausalLM(cfg, sd, torch.float32), sd


def build(cfg_dict, sd, model, **kw):
    return Eagle3DraftModel(Eagle3DraftConfig.from_dict(cfg_dict, sd), sd, model, torch.float32,
                            **kw)


# ---- the reference: the published module in plain torch (HF rotate-half RoPE) ------------------
def reference_forward(cfg_dict, sd, embed_w, ids, hidden):
    """Full causal attention over the whole sequence. `hidden[t]` is position t's input: 3H (the
    target's aux hiddens, fc applied) or H (a draft output, used as is).
    Returns (draft logits (T, Vd), g (T, H) pre-norm)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    H, nh = cfg_dict["hidden_size"], cfg_dict["num_attention_heads"]
    nkv, eps = cfg_dict["num_key_value_heads"], cfg_dict["rms_norm_eps"]
    D = cfg_dict.get("head_dim") or H // nh
    T = len(ids)
    p = "midlayer."

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    h = torch.stack([F.linear(a, sd["fc.weight"], sd.get("fc.bias")) if a.shape[-1] == 3 * H
                     else a for a in hidden])                                 # (T, H)
    hn = norm(h, sd[p + "hidden_norm.weight"])
    residual = hn if cfg_dict.get("norm_before_residual") else h
    x = torch.cat([norm(embed_w[ids], sd[p + "input_layernorm.weight"]), hn], -1)  # (T, 2H)
    q = F.linear(x, sd[p + "self_attn.q_proj.weight"], sd.get(p + "self_attn.q_proj.bias"))
    k = F.linear(x, sd[p + "self_attn.k_proj.weight"], sd.get(p + "self_attn.k_proj.bias"))
    v = F.linear(x, sd[p + "self_attn.v_proj.weight"], sd.get(p + "self_attn.v_proj.bias"))
    q = q.view(1, T, nh, D).transpose(1, 2)        # (1, nh, T, D)
    k = k.view(1, T, nkv, D).transpose(1, 2)       # (1, nkv, T, D)
    v = v.view(1, T, nkv, D).transpose(1, 2)
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k_: v_ for k_, v_ in cfg_dict.items()
                                               if k_ not in ("model_type", "architectures")}))
    cos, sin = rope(v, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)                       # (1, nh, T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(T, nh * D)
    r = residual + F.linear(attn, sd[p + "self_attn.o_proj.weight"])
    m = norm(r, sd[p + "post_attention_layernorm.weight"])
    mlp = F.linear(F.silu(F.linear(m, sd[p + "mlp.gate_proj.weight"]))
                   * F.linear(m, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
    g = r + mlp
    return norm(g, sd["norm.weight"]) @ sd["lm_head.weight"].T, g


# ---- paged runs --------------------------------------------------------------------------------
def run_draft(runner, ids, aux, rounds):
    """ids[b]: (T_b,) tokens; aux[b]: (T_b, 3H) target hiddens. rounds: ("extend", [n_b])
    feeds the next n_b tokens with their 3H aux hiddens; ("decode", None) feeds one token
    per request with the draft's own output g of the previous token (H wide).
    Returns per request (logits (T_b, Vd), g (T_b, H), the hidden fed at each position)."""
    B = len(ids)
    counts = [[1] * B if kind == "decode" else ns for kind, ns in rounds]
    per_round, fed = [], [[] for _ in ids]
    for r, rnd in enumerate(runner.rounds(counts)):
        if rounds[r][0] == "extend":
            x = rnd.take(aux)                                                 # (n_b, 3H)
        else:
            x = [g[-1:] for _, g in per_round[-1]]                            # (1, H)
        per_round.append(runner.forward(rnd, ids, torch.cat(x)))
        for f, xb in zip(fed, x):
            f.extend(xb)
    return [(lg, g, f) for (lg, g), f in zip(gather(per_round), fed)]


def make_seq(n, H, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g), torch.randn(n, 3 * H, generator=g)


def _default_rope(d):
    """Like the 8B head's config: no rope_theta/rope_scaling, so the draft's RoPE (theta 10000)
    differs from a llama3-scaled target's."""
    d.pop("rope_theta")
    d.pop("rope_scaling")


VARIANTS = {  # (random_eagle3_draft options, config edit)
    "published": ({}, _default_rope),                    # no fc bias, no embed, GQA
    "fc_bias_qkv_bias_mha": (dict(fc_bias=True, attention_bias=True, num_heads=2,
                                  intermediate_size=96), None),
    "norm_before_residual_gqa1": (dict(norm_before_residual=True, num_kv_heads=1,
                                       with_embed=True), None),
}
ROUNDS = [("extend", [7, 5]), ("decode", None), ("decode", None), ("decode", None),
          ("extend", [2, 3]), ("decode", None)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_draft_forward_matches_reference(target, variant, page_size):
    """Two requests: a 3H extend (fc), three H-wide decode steps fed the draft's own output, a
    3H extend and one more decode, all on the cached prefix: every position's logits and
    feature equal the reference over the full sequence (fp32, 1e-4)."""
    model, tsd = target
    H = model.cfg.hidden_size
    kw, edit = VARIANTS[variant]
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD, seed=3, std=0.1, **kw)
    if edit:
        edit(cfg_dict)
    draft = build(cfg_dict, sd, model)
    nh = cfg_dict["num_attention_heads"]
    assert draft.kv_shape() == (1, cfg_dict["num_key_value_heads"], H // nh)
    seqs = [make_seq(14, H, 1), make_seq(13, H, 2)]
    got = run_draft(DraftRunner(draft, page_size), [s[0] for s in seqs], [s[1] for s in seqs],
                    ROUNDS)
    for (ids, _), (lg, g, fed) in zip(seqs, got):
        T = len(lg)
        assert [a.shape[-1] for a in fed].count(H) == 4          # decode steps were H wide
        ref_lg, ref_g = reference_forward(cfg_dict, sd, tsd["model.embed_tokens.weight"],
                                          ids[:T], fed)
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lg, ref_lg, rtol=1e-4, atol=1e-4)


def test_logits_indices_own_embed_and_target_logits(target, tmp_path):
    """logits_indices picks rows; use_own_embed reads the checkpoint's copy (the target's here,
    so the output is the same); to_target_logits puts draft column i at i + d2t[i]."""
    model, tsd = target
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD, seed=5, std=0.1, with_embed=True,
                                       embed=tsd["model.embed_tokens.weight"])
    save_eagle3_draft(tmp_path, cfg_dict, sd)
    cfg, sd2 = load_eagle3_draft(tmp_path, model.cfg)
    assert cfg.has_embed and not cfg.fc_bias
    outs = []
    for own in (False, True):
        draft = Eagle3DraftModel(cfg, sd2, model, torch.float32, use_own_embed=own)
        runner = DraftRunner(draft, 1)
        ids, aux = make_seq(6, model.cfg.hidden_size, 7)
        batch, _ = runner.prefill_batch(ids)
        full = draft.forward(batch.input_ids, batch.positions, aux, runner.backend,
                             runner.backend.init_forward_metadata(batch))
        part = draft.forward(batch.input_ids, batch.positions, aux, runner.backend,
                             runner.backend.init_forward_metadata(batch),
                             logits_indices=torch.tensor([5, 2]))
        torch.testing.assert_close(part.logits, full.logits[[5, 2]])
        torch.testing.assert_close(part.hidden, full.hidden)
        outs.append(full.logits)
    torch.testing.assert_close(outs[0], outs[1])
    # the vocabulary map, against a loop over draft ids
    ids_t = torch.arange(VD) + sd["d2t"]
    assert torch.equal(draft.d2t_target_ids, ids_t) and draft.d2t_target_ids.dtype == torch.int64
    assert torch.equal(sd["t2d"].nonzero().flatten(), ids_t)
    tl = draft.to_target_logits(outs[0])                                      # (6, 256)
    assert tl.shape == (6, 256)
    for i in range(VD):
        assert torch.equal(tl[:, int(ids_t[i])], outs[0][:, i])
    assert torch.isneginf(tl[:, ~sd["t2d"]]).all()
    # greedy over the target vocabulary picks the target id of the draft argmax
    assert torch.equal(tl.argmax(-1), ids_t[outs[0].argmax(-1)])


def test_aux_layers_feed_the_draft(tmp_path):
    """Default aux layers are the outputs of (1, L//2-1, L-4) = the inputs of [2, L//2, L-3];
    a config override is honoured (SGLang nested output ids, vLLM top-level input ids); the
    target's captured hiddens, concatenated, are the 3H input the draft applies fc to."""
    aux = Eagle3DraftModel.aux_layers
    assert aux(32) == (1, 15, 28) and aux(80) == (1, 39, 76) and aux(8) == (1, 3, 4)
    assert tuple(i + 1 for i in aux(32)) == (2, 32 // 2, 32 - 3)
    assert aux(8, (5, 0, 2)) == (0, 2, 5)
    for bad, msg in [((4, None), r"\[1, 1, 0\] \(default .*\(the default needs L >= 7\)"),
                     ((8, (1, 1, 2)), "3 distinct"), ((8, (1, 2, 8)), r"in \[0, 8\)"),
                     ((8, (1, 2)), "3 distinct")]:
        with pytest.raises(ModelLoadError, match=msg):
            aux(*bad)
    make_tiny(tmp_path, num_hidden_layers=8)
    tcfg, tsd = load_hf_dir(tmp_path)
    model = LlamaForCausalLM(tcfg, tsd, torch.float32)
    cfg_dict, sd = random_eagle3_draft(tcfg, VD, seed=2)
    assert build(cfg_dict, sd, model).capture_layers == (1, 3, 4)
    assert build({**cfg_dict, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}},
                 sd, model).capture_layers == (0, 3, 6)
    draft = build({**cfg_dict, "eagle_aux_hidden_state_layer_ids": [1, 4, 7]}, sd, model)
    assert draft.capture_layers == (0, 3, 6)
    with pytest.raises(ModelLoadError, match="two different aux layer sets"):
        Eagle3DraftConfig.from_dict({
            **cfg_dict, "eagle_aux_hidden_state_layer_ids": [1, 4, 7],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}, sd)
    runner = DraftRunner(draft, 1)
    ids = torch.randint(0, 256, (5,))
    batch, _ = runner.prefill_batch(ids)
    # the target on a pool of its own shape, same rows and slot ids
    tpool = KVPool(256, 1, tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim)
    out = model.forward(batch, TorchAttentionBackend(tpool, runner.r2t),
                        capture_layers=draft.capture_layers)
    a = torch.cat(out.aux_hidden, -1)                                         # (5, 3H)
    assert a.shape == (5, 3 * tcfg.hidden_size)
    got = draft.forward(batch.input_ids, batch.positions, a, runner.backend,
                        runner.backend.init_forward_metadata(batch))
    ref_lg, ref_g = reference_forward(cfg_dict, sd, tsd["model.embed_tokens.weight"], ids, list(a))
    torch.testing.assert_close(got.logits, ref_lg, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="hidden has width 128; expected 192 .* or 64"):
        draft.forward(batch.input_ids, batch.positions, a[:, :128], runner.backend,
                      runner.backend.init_forward_metadata(batch))


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,shards,prefix", [("bin", 1, ""), ("safetensors", 1, ""),
                                               ("safetensors", 3, "model."), ("bin", 2, "model.")])
def test_save_load_round_trip(target, tmp_path, fmt, shards, prefix):
    model, _ = target
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD, seed=1, fc_bias=True)
    save_eagle3_draft(tmp_path, cfg_dict, {prefix + n: w for n, w in sd.items()}, fmt, shards)
    cfg, sd2 = load_eagle3_draft(tmp_path, model.cfg)
    assert sd2.keys() == sd.keys()
    assert all(torch.equal(sd[n], sd2[n]) and sd[n].dtype == sd2[n].dtype for n in sd)
    assert sd2["d2t"].dtype == torch.int64 and sd2["t2d"].dtype == torch.bool
    assert cfg == Eagle3DraftConfig.from_dict(cfg_dict, sd)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size, cfg.fc_bias, cfg.has_embed,
            cfg.aux_layer_ids, cfg.kv_shape) == (64, 256, VD, True, False, None, (1, 2, 16))


def bad_checkpoint(tmp_path, tcfg, edit_cfg=None, edit_sd=None, **kw):
    cfg_dict, sd = random_eagle3_draft(tcfg, VD, **kw)
    if edit_cfg:
        edit_cfg(cfg_dict)
    if edit_sd:
        edit_sd(sd)
    save_eagle3_draft(tmp_path, cfg_dict, sd, "safetensors")
    return tmp_path


def _set(d, k, v):
    d[k] = v


def _d2t(fn):
    """Edit d2t in place with fn(d2t, t2d)."""
    return lambda sd: fn(sd["d2t"], sd["t2d"])


def _move(d2t, t2d, i, new):
    """Point draft id i at target id `new`, keeping t2d consistent."""
    t2d[i + d2t[i]] = False
    t2d[new] = True
    d2t[i] = new - i


CASES = {
    "hidden": (dict(tcfg=lambda c: dataclasses.replace(c, hidden_size=32, head_dim=8)),
               "draft hidden_size=32 differs from the target's hidden_size=64"),
    "vocab": (dict(tcfg=lambda c: dataclasses.replace(c, vocab_size=300)),
              "draft vocab_size=300 differs from the target's vocab_size=256"),
    "missing": (dict(edit_sd=lambda sd: sd.pop("midlayer.hidden_norm.weight")),
                "missing tensor midlayer.hidden_norm.weight (expected shape (64,))"),
    "missing_d2t": (dict(edit_sd=lambda sd: sd.pop("d2t")),
                    f"missing tensor d2t (expected shape ({VD},))"),
    "missing_fc_bias": (dict(fc_bias=True, edit_sd=lambda sd: sd.pop("fc.bias")),
                        "missing tensor fc.bias (expected shape (64,))"),
    "shape_qkv": (dict(edit_sd=lambda sd: _set(sd, "midlayer.self_attn.q_proj.weight",
                                               torch.zeros(64, 64))),
                  "midlayer.self_attn.q_proj.weight has shape (64, 64), config expects (64, 128)"),
    "shape_fc": (dict(edit_sd=lambda sd: _set(sd, "fc.weight", torch.zeros(64, 128))),
                 "tensor fc.weight has shape (64, 128), config expects (64, 192)"),
    "shape_embed": (dict(edit_sd=lambda sd: _set(sd, "embed_tokens.weight", torch.zeros(255, 64))),
                    "embed_tokens.weight has shape (255, 64), config expects (256, 64)"),
    "unexpected": (dict(edit_sd=lambda sd: _set(sd, "layers.0.mlp.up_proj.weight",
                                                torch.zeros(128, 64))),
                   "1 unexpected tensors, e.g. ['layers.0.mlp.up_proj.weight']"),
    "draft_vocab_missing": (dict(edit_cfg=lambda d: d.pop("draft_vocab_size")),
                            f"lacks 'draft_vocab_size' (lm_head has {VD} rows)"),
    "draft_vocab_vs_lm_head": (dict(edit_cfg=lambda d: _set(d, "draft_vocab_size", 32)),
                               f"draft_vocab_size=32 but lm_head.weight has {VD} rows"),
    "d2t_out_of_range": (dict(edit_sd=_d2t(lambda d2t, t2d: d2t.__setitem__(3, 400))),
                         "d2t maps draft id 3 to target id 403, outside [0, 256)"),
    "d2t_negative": (dict(edit_sd=_d2t(lambda d2t, t2d: d2t.__setitem__(0, -1))),
                     "d2t maps draft id 0 to target id -1, outside [0, 256)"),
    "d2t_duplicate": (dict(edit_sd=_d2t(lambda d2t, t2d: d2t.__setitem__(5, d2t[4] - 1))),
                      "d2t maps 2 draft ids to target id"),
    "d2t_float": (dict(edit_sd=lambda sd: _set(sd, "d2t", sd["d2t"].float())),
                  "d2t has dtype torch.float32; expected int64"),
    "t2d_count": (dict(edit_sd=_d2t(lambda d2t, t2d: t2d.__setitem__(
        int((~t2d).nonzero()[0]), True))), f"t2d marks {VD + 1} target ids, draft_vocab_size is"),
    "t2d_disagrees": (dict(edit_sd=_d2t(lambda d2t, t2d: (   # mark another id, then unmark 7's
        t2d.__setitem__(int((~t2d).nonzero()[0]), True),
        t2d.__setitem__(int(d2t[7]) + 7, False)))),
        "t2d disagrees with d2t: draft id 7 maps to target id"),
    "eagle12": (dict(edit_cfg=lambda d: d.pop("draft_vocab_size"), edit_sd=lambda sd: [
        sd.pop(n) for n in list(sd) if n.startswith("midlayer.") or n in ("d2t", "t2d")]
        + [sd.update({"layers.0.mlp.up_proj.weight": torch.zeros(128, 64)})]),
        "this is an EAGLE-1/2 draft; use algorithm='eagle'"),
    "two_layers": (dict(edit_cfg=lambda d: _set(d, "num_hidden_layers", 2)),
                   "num_hidden_layers=2; eaglekv runs EAGLE-3 heads with exactly 1 decoder layer"),
    "speculators": (dict(edit_cfg=lambda d: _set(d, "speculators_config", {})),
                    "vLLM speculators format"),
    "narrow_head": (dict(edit_cfg=lambda d: _set(d, "target_hidden_size", 128)),
                    "target_hidden_size=128 differs from its hidden_size=64"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_has_its_own_error(target, tmp_path, case):
    model, _ = target
    kw, msg = CASES[case]
    kw = dict(kw)
    draft_tcfg = kw.pop("tcfg", lambda c: c)(model.cfg)
    path = bad_checkpoint(tmp_path, draft_tcfg, **kw)
    with pytest.raises(ModelLoadError) as e:
        load_eagle3_draft(path, model.cfg)
    assert msg in str(e.value)


def test_vocab_map_edit_still_loads(target, tmp_path):
    """A consistent d2t/t2d that is not sorted (the map allows any order) is accepted."""
    model, _ = target
    path = bad_checkpoint(tmp_path, model.cfg, edit_sd=_d2t(lambda d2t, t2d: _move(
        d2t, t2d, 0, int((~t2d).nonzero()[-1]))))
    cfg, sd = load_eagle3_draft(path, model.cfg)
    ids = build(cfg.hf_dict, sd, model).d2t_target_ids
    assert not torch.equal(ids.sort().values, ids)


def test_eagle12_and_eagle3_refuse_each_other(target, tmp_path):
    """A real EAGLE-1/2 head is refused by the EAGLE-3 loader and vice versa."""
    model, _ = target
    cfg_dict, sd = random_eagle_draft(model.cfg)
    save_eagle_draft(tmp_path / "e1", cfg_dict, sd)
    with pytest.raises(ModelLoadError, match=r"this is an EAGLE-1/2 draft; use algorithm='eagle' "
                                             r".*fc.weight \(64, 128\)"):
        load_eagle3_draft(tmp_path / "e1", model.cfg)
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD)
    save_eagle3_draft(tmp_path / "e3", cfg_dict, sd)
    with pytest.raises(ModelLoadError, match="this is an EAGLE-3 draft; use algorithm='eagle3'"):
        load_eagle_draft(tmp_path / "e3", model.cfg)


def test_missing_files(target, tmp_path):
    model, _ = target
    with pytest.raises(ModelLoadError, match="EAGLE-3 draft path .* does not exist"):
        load_eagle3_draft(tmp_path / "nope", model.cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_eagle3_draft(tmp_path / "empty", model.cfg)
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD)
    save_eagle3_draft(tmp_path / "ok", cfg_dict, sd)
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_eagle3_draft(tmp_path / "ok" / "config.json", model.cfg)
    (tmp_path / "ok" / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="no weights in .*pytorch_model.bin or"):
        load_eagle3_draft(tmp_path / "ok", model.cfg)
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        load_eagle3_draft(tmp_path / "ok", model.cfg)


def test_draft_model_checks_target(target):
    """Built straight from a state dict (no loader), the model still checks target and map."""
    model, _ = target
    cfg_dict, sd = random_eagle3_draft(dataclasses.replace(model.cfg, vocab_size=512), VD)
    with pytest.raises(ModelLoadError, match="vocab_size=512 differs"):
        build(cfg_dict, sd, model)
    cfg_dict, sd = random_eagle3_draft(model.cfg, VD)
    with pytest.raises(ModelLoadError, match="no embed_tokens.weight"):
        build(cfg_dict, sd, model, use_own_embed=True)
    sd["d2t"][1] = sd["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    with pytest.raises(ModelLoadError, match="d2t maps 2 draft ids to target id"):
        build(cfg_dict, sd, model)
