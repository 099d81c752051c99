"""EAGLE-1/2 draft head: its paged forward equals a plain-torch reference of the published
module (SafeAILab/EAGLE cnets1.py), over prefill and cached extends; checkpoints round-trip in
both formats; every mismatch gets its own error."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch

from draft_helpers import DraftRunner, gather, reference_forward, target_embed_head
from eaglekv.errors import ModelLoadError
from eaglekv.model.llama import LlamaForCausalLM
from eaglekv.model.loader import load_hf_dir
from eaglekv.model.draft_checkpoint import (EagleDraftConfig, load_eagle_draft, random_eagle_draft,
                                       save_eagle_draft)
from eaglekv.model.eagle import EagleDraftModel
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


# ---- paged runs --------------------------------------------------------------------------------
def run_draft(runner, seqs, chunks):
    """seqs: [(ids (T_b,), hidden (T_b, H))]; chunks[r][b]: tokens request b adds in round r.
    Returns per request (logits (T_b, V), g (T_b, H)) gathered over the rounds."""
    ids, hidden = [s[0] for s in seqs], [s[1] for s in seqs]
    return gather([runner.forward(rnd, ids, torch.cat(rnd.take(hidden)))
                   for rnd in runner.rounds(chunks)])


def make_seq(n, H, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g), torch.randn(n, H, generator=g)


VARIANTS = {
    "published": {},                                   # fc bias, no input norm, own embed copy
    "no_bias_input_norm_mha": dict(fc_bias=False, input_norm=True, with_embed=False,
                                   num_heads=2, intermediate_size=96),
    "qkv_bias_gqa1": dict(qkv_bias=True, num_kv_heads=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_draft_forward_matches_reference(target, variant, page_size):
    """Two requests, prefill then extends of 1-3 tokens on the cached prefix: every position's
    logits and output feature equal the reference on the full sequence (fp32, 1e-4)."""
    model, tsd = target
    tcfg = model.cfg
    cfg_dict, sd = random_eagle_draft(tcfg, seed=3, std=0.1, **VARIANTS[variant])
    draft = EagleDraftModel(EagleDraftConfig.from_dict(cfg_dict, sd), sd, model, torch.float32)
    assert draft.kv_shape() == (1, cfg_dict["num_key_value_heads"],
                                cfg_dict.get("head_dim") or tcfg.hidden_size // cfg_dict[
                                    "num_attention_heads"])
    seqs = [make_seq(14, tcfg.hidden_size, 1), make_seq(9, tcfg.hidden_size, 2)]
    got = run_draft(DraftRunner(draft, page_size), seqs, [[8, 5], [1, 2], [3, 1], [2, 1]])
    emb, head = target_embed_head(tsd, tcfg.tie_word_embeddings)
    for (ids, hid), (lg, g) in zip(seqs, got):
        ref_lg, ref_g = reference_forward(cfg_dict, sd, emb, head, ids, hid)
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lg, ref_lg, rtol=1e-4, atol=1e-4)


def test_logits_indices_and_own_embed(target, tmp_path):
    """logits_indices picks rows; use_own_embed reads the checkpoint's copy (equal to the
    target's here, so the output is the same)."""
    model, tsd = target
    cfg_dict, sd = random_eagle_draft(model.cfg, seed=5, std=0.1,
                                      embed=tsd["model.embed_tokens.weight"])
    save_eagle_draft(tmp_path, cfg_dict, sd)
    cfg, sd2 = load_eagle_draft(tmp_path, model.cfg)
    assert cfg.has_embed and cfg.fc_bias and not cfg.has_input_norm
    outs = []
    for own in (False, True):
        draft = EagleDraftModel(cfg, sd2, model, torch.float32, use_own_embed=own)
        runner = DraftRunner(draft, 1)
        ids, hid = make_seq(6, model.cfg.hidden_size, 7)
        batch, _ = runner.prefill_batch(ids)
        meta = runner.backend.init_forward_metadata(batch)
        full = draft.forward(batch.input_ids, batch.positions, hid, runner.backend, meta)
        meta = runner.backend.init_forward_metadata(batch)
        part = draft.forward(batch.input_ids, batch.positions, hid, runner.backend, meta,
                             logits_indices=torch.tensor([5, 2]))
        torch.testing.assert_close(part.logits, full.logits[[5, 2]])
        torch.testing.assert_close(part.hidden, full.hidden)
        outs.append(full.logits)
    torch.testing.assert_close(outs[0], outs[1])


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,shards,prefix", [("bin", 1, ""), ("safetensors", 1, ""),
                                               ("safetensors", 3, "model."), ("bin", 2, "model.")])
def test_save_load_round_trip(target, tmp_path, fmt, shards, prefix):
    model, _ = target
    cfg_dict, sd = random_eagle_draft(model.cfg, seed=1, fc_bias=False)
    save_eagle_draft(tmp_path, cfg_dict, {prefix + n: w for n, w in sd.items()}, fmt, shards)
    cfg, sd2 = load_eagle_draft(tmp_path, model.cfg)
    assert sd2.keys() == sd.keys()
    assert all(torch.equal(sd[n], sd2[n]) for n in sd)
    assert cfg == EagleDraftConfig.from_dict(cfg_dict, sd)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.fc_bias, cfg.has_embed) == (64, 256, False, True)
    assert "layers.0.input_layernorm.weight" not in sd2 and "fc.bias" not in sd2


def bad_checkpoint(tmp_path, tcfg, edit_cfg=None, edit_sd=None, **kw):
    cfg_dict, sd = random_eagle_draft(tcfg, **kw)
    if edit_cfg:
        edit_cfg(cfg_dict)
    if edit_sd:
        edit_sd(sd)
    save_eagle_draft(tmp_path, cfg_dict, sd, "safetensors")
    return tmp_path


def _set(d, k, v):
    d[k] = v


CASES = {
    "hidden": (dict(tcfg=lambda c: dataclasses.replace(c, hidden_size=32, head_dim=8)),
               "draft hidden_size=32 differs from the target's hidden_size=64"),
    "vocab": (dict(tcfg=lambda c: dataclasses.replace(c, vocab_size=300)),
              "draft vocab_size=300 differs from the target's vocab_size=256"),
    "missing": (dict(edit_sd=lambda sd: sd.pop("layers.0.mlp.up_proj.weight")),
                "missing tensor layers.0.mlp.up_proj.weight (expected shape (128, 64))"),
    "missing_bias": (dict(edit_sd=lambda sd: sd.pop("fc.bias")),
                     "missing tensor fc.bias (expected shape (64,))"),
    "shape": (dict(edit_sd=lambda sd: _set(sd, "layers.0.self_attn.o_proj.weight",
                                           torch.zeros(64, 32))),
              "layers.0.self_attn.o_proj.weight has shape (64, 32), config expects (64, 64)"),
    "embed_shape": (dict(edit_sd=lambda sd: _set(sd, "embed_tokens.weight", torch.zeros(255, 64))),
                    "embed_tokens.weight has shape (255, 64), config expects (256, 64)"),
    "unexpected": (dict(edit_sd=lambda sd: _set(sd, "layers.1.mlp.up_proj.weight",
                                                torch.zeros(128, 64))),
                   "1 unexpected tensors, e.g. ['layers.1.mlp.up_proj.weight']"),
    "lm_head": (dict(edit_sd=lambda sd: _set(sd, "lm_head.weight", torch.zeros(256, 64))),
                "unexpected tensors, e.g. ['lm_head.weight']"),
    "eagle3_tensors": (dict(edit_sd=lambda sd: sd.update(
        {"midlayer.self_attn.q_proj.weight": torch.zeros(64, 128), "d2t": torch.zeros(8)})),
        "this is an EAGLE-3 draft; use algorithm='eagle3'"),
    "eagle3_config": (dict(edit_cfg=lambda d: _set(d, "draft_vocab_size", 32)),
                      "this is an EAGLE-3 draft; use algorithm='eagle3'"),
    "two_layers": (dict(edit_cfg=lambda d: _set(d, "num_hidden_layers", 2)),
                   "num_hidden_layers=2; an EAGLE-1/2 draft head has exactly 1 decoder layer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_has_its_own_error(target, tmp_path, case):
    model, _ = target
    kw, msg = CASES[case]
    kw = dict(kw)
    draft_tcfg = kw.pop("tcfg", lambda c: c)(model.cfg)
    path = bad_checkpoint(tmp_path, draft_tcfg, **kw)
    with pytest.raises(ModelLoadError) as e:
        load_eagle_draft(path, model.cfg)
    assert msg in str(e.value)


def test_missing_files_and_unsafe_pickle(target, tmp_path):
    model, _ = target
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_eagle_draft(tmp_path / "nope", model.cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_eagle_draft(tmp_path / "empty", model.cfg)
    cfg_dict, sd = random_eagle_draft(model.cfg)
    save_eagle_draft(tmp_path / "ok", cfg_dict, sd)
    (tmp_path / "ok" / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="no weights in .*pytorch_model.bin or"):
        load_eagle_draft(tmp_path / "ok", model.cfg)
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_eagle_draft(tmp_path / "ok" / "config.json", model.cfg)
    # weights_only=True: a pickle carrying anything but tensors is refused, not executed
    torch.save({**sd, "when": datetime.datetime(2024, 1, 1)}, tmp_path / "ok" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="tensor-only checkpoint"):
        load_eagle_draft(tmp_path / "ok", model.cfg)
    save_eagle_draft(tmp_path / "cut", cfg_dict, sd, "safetensors")
    f = tmp_path / "cut" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read safetensors weights"):
        load_eagle_draft(tmp_path / "cut", model.cfg)


def test_draft_model_checks_target(target):
    """Built straight from a state dict (no loader), the model still checks the target."""
    model, _ = target
    other = dataclasses.replace(model.cfg, vocab_size=512)
    cfg_dict, sd = random_eagle_draft(other)
    with pytest.raises(ModelLoadError, match="vocab_size=512 differs"):
        EagleDraftModel(EagleDraftConfig.from_dict(cfg_dict, sd), sd, model, torch.float32)
    cfg_dict, sd = random_eagle_draft(model.cfg, with_embed=False)
    with pytest.raises(ModelLoadError, match="no embed_tokens.weight"):
        EagleDraftModel(EagleDraftConfig.from_dict(cfg_dict, sd), sd, model, torch.float32,
                        use_own_embed=True)


@pytest.mark.parametrize("d", [
    {"rope_theta": 100000.0, "rope_scaling": None},
    {},                                                       # transformers' default theta
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}},
    {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
], ids=["plain", "no-keys", "rope_parameters", "llama3", "linear"])
def test_draft_rope_equals_the_transformers_configs(d):
    """A draft's RoPE from its config.json: a plain theta without transformers (1.5 s to
    import), scaled RoPE through LlamaConfig; the same frequencies as LlamaConfig's."""
    from transformers import LlamaConfig
    from eaglekv.model.draft_io import draft_rope_config
    from eaglekv.model.rope import inv_freq_and_scale
    full = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
            "vocab_size": 100, "max_position_embeddings": 4096, **d}
    got = inv_freq_and_scale(draft_rope_config(full), 16)
    want = inv_freq_and_scale(LlamaConfig(**full), 16)
    torch.testing.assert_close(got[0], want[0])
    assert got[1] == pytest.approx(want[1])


def test_the_shipped_drafts_load_without_importing_transformers():
    """With the target's converted weights cached (a first load converts the GGUF, which
    may use transformers), an engine with the shipped EAGLE head never imports it."""
    import subprocess
    import sys
    build = ("import sys; from eaglekv.engine import Engine; "
             "Engine(model='default', device='cpu', max_total_tokens=512{spec}); "
             "print('transformers' in sys.modules)")
    spec = (", speculative=dict(algorithm='eagle', draft_model='default', num_steps=3, "
            "topk=1, num_draft_tokens=4)")
    runs = [subprocess.run([sys.executable, "-c", build.format(spec=s)], capture_output=True,
                           text=True, timeout=300) for s in ("", spec)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.strip().splitlines()[-1] == "False"


# ---- a reduced draft vocabulary (draft_vocab.json) ---------------------------------------------
def test_a_reduced_vocabulary_keeps_its_columns_and_closes_the_rest(target):
    """With `vocab_ids` the head's logits are the full head's at those ids (its LM head is the
    target's columns of them) and -inf at every other id: nothing else can be proposed."""
    model, _ = target
    cfg_dict, sd = random_eagle_draft(model.cfg, seed=3, std=0.1)
    cfg = EagleDraftConfig.from_dict(cfg_dict, sd)
    ids = torch.tensor(sorted(torch.randperm(model.cfg.vocab_size,
                                             generator=torch.Generator().manual_seed(0))[:40]
                              .tolist()))
    full = EagleDraftModel(cfg, sd, model, torch.float32)
    small = EagleDraftModel(cfg, sd, model, torch.float32, vocab_ids=ids)
    assert small.lm_head_t.shape == (model.cfg.hidden_size, 40)
    seqs = [make_seq(9, model.cfg.hidden_size, 1), make_seq(5, model.cfg.hidden_size, 2)]
    want = run_draft(DraftRunner(full, 1), seqs, [[6, 3], [3, 2]])
    got = run_draft(DraftRunner(small, 1), seqs, [[6, 3], [3, 2]])
    others = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    others[ids] = False
    for (lg_full, g_full), (lg, g) in zip(want, got):
        torch.testing.assert_close(g, g_full)
        torch.testing.assert_close(lg[:, ids], lg_full[:, ids])
        assert torch.isneginf(lg[:, others]).all()


@pytest.mark.parametrize("content,match", [
    ('{"target_ids": [3, 1, 2]}', "sorted list of distinct"),
    ('{"target_ids": [1, 1]}', "sorted list of distinct"),
    ('{"target_ids": [0, 256]}', r"in \[0, 256\)"),
    ('{"target_ids": []}', "non-empty"),
    ('{"target_ids": [1, 2.5]}', "not an integer"),
    ('{"ids": [1, 2]}', "cannot read"),
    ("not json", "cannot read"),
])
def test_a_bad_draft_vocabulary_file_is_refused_by_name(tmp_path, content, match):
    from eaglekv.model.draft_io import DRAFT_VOCAB_FILE, read_draft_vocab
    assert read_draft_vocab(tmp_path, 256) is None                  # absent: the whole vocab
    (tmp_path / DRAFT_VOCAB_FILE).write_text(content)
    with pytest.raises(ModelLoadError, match=match) as e:
        read_draft_vocab(tmp_path, 256)
    assert DRAFT_VOCAB_FILE in str(e.value)


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_a_head_with_a_reduced_vocabulary_stays_lossless(tmp_path, tiny_dir, shape):
    """An EAGLE-1 head directory with draft_vocab.json: the engine loads it (the LM head is
    the 40 listed columns), and greedy speculation equals plain greedy token for token."""
    import json
    from eaglekv import SamplingParams
    from eaglekv.model.draft_io import DRAFT_VOCAB_FILE
    from helpers import spec, tiny_engine
    plain = tiny_engine(tiny_dir)
    cfg_dict, sd = random_eagle_draft(plain.model_config, seed=5, std=0.1)
    save_eagle_draft(tmp_path, cfg_dict, sd)
    ids = list(range(0, 200, 5))
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": ids}))
    e = tiny_engine(tiny_dir, speculative=spec("eagle", *shape, draft=str(tmp_path)))
    assert e.runner.drafter.model.lm_head_t.shape[1] == len(ids)
    prompts = [[5, 17, 42], list(range(1, 12)), [9] * 7]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert ([o.token_ids for o in e.generate(prompts, params)]
            == [o.token_ids for o in plain.generate(prompts, params)])
    e.check_memory()
