"""EAGLE head training (eaglekv.training) on a tiny random target, on the CPU: the
loss falls, the saved head loads with load_eagle_draft in the published layout (no
embed_tokens) and its forward equals the plain-torch reference of the published module."""

from __future__ import annotations

import random

import pytest
import torch

from draft_helpers import reference_forward
from eaglekv.model.draft_checkpoint import expected_tensors, load_eagle_draft, save_eagle_draft
from eaglekv.training.data import extract_features, generate, load_target
from eaglekv.training.eval import chain_accept
from eaglekv.training.head import head_for_target
from eaglekv.training.loop import train
from eaglekv.training.loss import step_loss, target_embed_head
from eaglekv.training.prompts import build_prompts
from helpers import make_tiny


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    make_tiny(path, tie_word_embeddings=True, rope_theta=100000.0)
    model, cfg = load_target(str(path), "cpu")
    rng = random.Random(0)
    prompts = [{"ids": [rng.randrange(3, 256) for _ in range(rng.randrange(3, 9))],
                "chat": True} for _ in range(40)]
    seqs = generate(model, prompts[:20], batch=10, max_new=24, greedy=True, temperature=1.0,
                    top_p=1.0, eos=[2], pad=2)
    seqs += generate(model, prompts[20:], batch=10, max_new=24, greedy=False, temperature=0.7,
                     top_p=0.95, eos=[2], pad=2)
    data = extract_features(model, seqs, max_batch_tokens=256)
    return model, cfg, data


def test_features_are_final_norm_hidden_states(setup):
    model, _, data = setup
    s = data.seqs[3]
    ids = torch.tensor(s["ids"])[None]
    h = model(ids, output_hidden_states=True).hidden_states[-1][0]
    n = len(s["ids"])
    torch.testing.assert_close(data.feats[data.offsets[3]:data.offsets[3] + n], h,
                               atol=1e-5, rtol=1e-5)
    assert data.tokens[data.offsets[3]:data.offsets[3] + n].tolist() == s["ids"]


def test_training_lowers_loss_and_saves_published_layout(setup, tmp_path):
    model, cfg, data = setup
    embed, lm_head = target_embed_head(model)
    head, cfg_dict = head_for_target(cfg, seed=0)
    ids_all = list(range(len(data.seqs)))
    ev = [i for i in ids_all if i % 10 == 0]
    tr = [i for i in ids_all if i % 10 != 0]
    chain_before = chain_accept(head, embed, lm_head, data, [i for i in ev if data.seqs[i]["greedy"]])
    res = train(head, embed, lm_head, data, tr, ev, lr=3e-3, time_budget=60.0, max_steps=120,
                max_tokens=256, warmup=10, noise=0.1, amp=False, seed=0, log_every=10,
                out=lambda *_: None)
    h = res["history"]
    assert res["steps"] == 120
    assert h[-1]["loss"] < 0.8 * h[0]["loss"], (h[0], h[-1])
    assert h[-1]["top1"] > h[0]["top1"]
    assert res["held_out"][-1]["loss"] < h[0]["loss"]
    chain = chain_accept(head, embed, lm_head, data, [i for i in ev if data.seqs[i]["greedy"]])
    assert 1.0 <= chain_before["accept_length"] <= chain["accept_length"] <= 4.0

    sd = head.published_state_dict(torch.bfloat16)
    save_eagle_draft(tmp_path, cfg_dict, sd, fmt="safetensors")
    dcfg, dsd = load_eagle_draft(tmp_path, cfg)
    assert not dcfg.has_embed and dcfg.fc_bias and not dcfg.has_input_norm
    assert set(dsd) == set(expected_tensors(dcfg))
    assert all(t.dtype == torch.bfloat16 for t in dsd.values())

    # the trained module == the published reference forward on the saved weights
    fsd = {k: v.float() for k, v in dsd.items()}
    head.load_state_dict(fsd)
    s = data.seqs[1]
    n = len(s["ids"])
    ids = torch.tensor(s["ids"][1:])
    f = data.feats[data.offsets[1]:data.offsets[1] + n - 1]
    ref_logits, ref_g = reference_forward(dcfg.hf_dict, fsd, embed, lm_head, ids, f)
    with torch.no_grad():
        g = head(embed[ids][None], f[None])[0]
    torch.testing.assert_close(g, ref_g, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g @ lm_head.t(), ref_logits, atol=1e-4, rtol=1e-4)


def test_step_loss_masks_padding(setup):
    """Padding rows change nothing: a batch of one sequence and the same sequence padded next
    to a longer one give the same per-token loss."""
    model, cfg, data = setup
    embed, lm_head = target_embed_head(model)
    head, _ = head_for_target(cfg, seed=1)
    lens = [len(s["ids"]) for s in data.seqs]
    short, long_ = min(range(len(lens)), key=lens.__getitem__), max(range(len(lens)),
                                                                     key=lens.__getitem__)
    assert lens[short] < lens[long_]
    with torch.no_grad():
        _, a = step_loss(head, embed, lm_head, *data.batch([short]))
        _, b1 = step_loss(head, embed, lm_head, *data.batch([short, long_]))
        _, b2 = step_loss(head, embed, lm_head, *data.batch([long_]))
    mix = (a["loss"] * a["n"] + b2["loss"] * b2["n"]) / (a["n"] + b2["n"])
    assert b1["n"] == a["n"] + b2["n"]
    assert abs(b1["loss"] - mix) < 1e-4


def test_prompts_are_distinct_and_mixed():
    p = build_prompts(500, seed=0)
    assert len({(x["text"], x["chat"]) for x in p}) == 500
    assert 0.05 < sum(not x["chat"] for x in p) / 500 < 0.3
