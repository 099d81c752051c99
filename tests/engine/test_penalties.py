"""Presence, frequency and repetition penalties (CPU, fp32, tiny random targets): plain greedy
equals a reference loop over HF transformers (its RepetitionPenaltyLogitsProcessor, then the
OpenAI presence / frequency formula); speculative greedy equals plain greedy for every family,
with drafts accepted and rejected; speculative sampling with penalties keeps the exact joint
law of the first tokens (chi-square), which the penalties visibly change."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.sampling import target_probs
from eaglekv.errors import ConfigError
from eaglekv.speculative.drafter import ScriptedDrafter
from helpers import PROMPTS, oracle, spec, tiny_engine
import sampling_helpers as sampling

PENALTIES = [dict(repetition_penalty=1.4), dict(presence_penalty=1.5),
             dict(frequency_penalty=0.9), dict(repetition_penalty=0.8, presence_penalty=-0.5,
                                               frequency_penalty=0.4)]


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], pen: dict):
    """(V,) logits after the penalties, written independently of eaglekv's sampler."""
    from transformers import RepetitionPenaltyLogitsProcessor
    x = logits.clone()[None]
    r = pen.get("repetition_penalty", 1.0)
    if r != 1.0:
        x = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([prompt + output]), x)
    x = x[0]
    for tok in set(output):
        c = output.count(tok)
        x[tok] -= c * pen.get("frequency_penalty", 0.0) + pen.get("presence_penalty", 0.0)
    return x


@pytest.fixture(scope="module")
def deep_hf(deep_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(deep_dir, dtype=torch.float32).eval()


def hf_penalized_greedy(hf, prompt, n, pen):
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference_logits(logits, prompt, out, pen).argmax()))
    return out


@pytest.mark.parametrize("pen", PENALTIES)
def test_plain_greedy_equals_hf_reference(deep_dir, deep_hf, pen):  # noqa: F811
    eng = tiny_engine(deep_dir, max_running_requests=4)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True, **pen))
    plain = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for o, prompt in zip(outs, PROMPTS):
        assert o.token_ids == hf_penalized_greedy(deep_hf, prompt, 20, pen)
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain))   # they bite
    eng.check_memory()


FAMILIES = [("eagle", 3, 1, 4), ("eagle", 3, 2, 6), ("eagle3", 3, 2, 6),
            ("multi_layer_eagle", 3, 1, 4)]


@pytest.mark.parametrize("alg,S,K,N", FAMILIES)
@pytest.mark.parametrize("pen", PENALTIES[::3])
def test_speculative_greedy_equals_plain(deep_dir, alg, S, K, N, pen):  # noqa: F811
    """Scripted drafts propose the penalized reference, wrong at every third position: the
    verify must judge each node with the penalties of its own path."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **pen)
    ref = [o.token_ids for o in tiny_engine(deep_dir, max_running_requests=4).generate(
        PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True, **pen))]
    drafter = ScriptedDrafter(oracle(PROMPTS, ref, lambda j: j % 3 == 0, topk=K), 256)
    eng = tiny_engine(deep_dir, page_size=4, max_running_requests=4, drafter=drafter,
                      speculative=spec(alg, S, K, N, draft="scripted"))
    outs = eng.generate(PROMPTS, params)
    for o, r in zip(outs, ref):
        assert o.token_ids == r[:24]
        assert o.spec.accepted_tokens > 0 and min(o.spec.accept_histogram) <= S
    eng.check_memory()


PEN_PARAMS = SamplingParams(max_new_tokens=3, temperature=1.3, top_k=3, ignore_eos=True,
                            repetition_penalty=1.6, presence_penalty=1.2, frequency_penalty=0.7)


def exact_penalized_joint(model) -> dict[tuple[int, ...], float]:
    """P(o0, o1, o2) under PEN_PARAMS: penalties (reference formula), then temperature and
    top-k, enumerated over the supports."""
    pen = dict(repetition_penalty=1.6, presence_penalty=1.2, frequency_penalty=0.7)
    frontier = {(): 1.0}
    for _ in range(3):
        ctxs = list(frontier)
        logits = sampling.last_logits(model, [sampling.PROMPT + list(c) for c in ctxs])
        nxt = {}
        for c, row in zip(ctxs, logits):
            x = reference_logits(row, sampling.PROMPT, list(c), pen)
            p = target_probs(x[None], PEN_PARAMS)[0]
            for tok in p.nonzero().view(-1).tolist():
                nxt[c + (tok,)] = frontier[c] * float(p[tok])
        frontier = nxt
    return frontier


@pytest.fixture(scope="module")
def pen_joint(tiny_dir):
    probs = exact_penalized_joint(tiny_engine(tiny_dir).model)
    assert abs(sum(probs.values()) - 1) < 1e-4
    return probs


def test_penalties_change_the_joint(tiny_dir, pen_joint):
    plain = sampling.exact_joint(tiny_engine(tiny_dir).model)
    tv = 0.5 * sum(abs(pen_joint.get(s, 0) - plain.get(s, 0)) for s in set(pen_joint) | set(plain))
    assert tv > 0.1, tv


def sample(eng):
    outs = eng.generate([sampling.PROMPT] * sampling.N_SAMPLES, PEN_PARAMS)
    eng.check_memory()
    return [tuple(o.token_ids) for o in outs]


@pytest.mark.parametrize("shape", [None, (2, 1, 3), (2, 3, 6)])
def test_sampling_with_penalties_matches_exact_joint(tiny_dir, pen_joint, shape):
    """Plain (shape None) and speculative (S, K, N) sampling."""
    S, K, N = shape or (None, None, None)
    if S is None:
        eng = tiny_engine(tiny_dir, max_running_requests=64, seed=4)
    else:
        base = tiny_engine(tiny_dir)
        eng = tiny_engine(tiny_dir, max_running_requests=64, seed=5,
                          speculative=dict(algorithm="eagle", draft_model="scripted",
                                           num_steps=S, topk=K, num_draft_tokens=N),
                          drafter=sampling.NoisySelfDrafter(base.model))
    stat, dof = sampling.chi_square(sample(eng), pen_joint)
    assert stat < sampling.CHI2_999[dof], (stat, dof)
    if S is not None:
        st = eng.spec_stats()
        assert 0 < st.accepted_tokens < st.verify_steps * S


@pytest.mark.parametrize("kw,match", [
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3.0), r"frequency_penalty=-3.0 must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0.0 must be > 0")])
def test_bad_penalties_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kw)
