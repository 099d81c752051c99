"""Speculative sampling keeps the target distribution: the joint law of the first three output
tokens under speculation equals the exact one computed from the target model (chi-square),
for topk == 1 (speculative sampling with the draft's q) and topk > 1 (multi-candidate
rejection over a tree). The draft is the target with noise added to its logits, so that both
acceptance and rejection happen often."""

from __future__ import annotations

import pytest

from eaglekv import SamplingParams
from helpers import tiny_engine
from sampling_helpers import (CHI2_999, N_SAMPLES, PARAMS, PROMPT, NoisySelfDrafter, chi_square,
                              exact_joint)


def run(eng, n=N_SAMPLES):
    outs = eng.generate([PROMPT] * n, PARAMS)
    eng.check_memory()
    assert eng.allocator.is_full()
    return [tuple(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def joint(tiny_dir):
    eng = tiny_engine(tiny_dir)
    probs = exact_joint(eng.model)
    assert abs(sum(probs.values()) - 1) < 1e-4
    return probs


def test_plain_sampling_matches_exact_joint(tiny_dir, joint):
    stat, dof = chi_square(run(tiny_engine(tiny_dir, max_running_requests=64, seed=1)), joint)
    assert stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("S,K,N", [(2, 1, 3), (2, 2, 4), (2, 3, 6)])
def test_speculative_sampling_matches_exact_joint(tiny_dir, joint, S, K, N):
    base = tiny_engine(tiny_dir)
    eng = tiny_engine(tiny_dir, max_running_requests=64, seed=2,
                      speculative=dict(algorithm="eagle", draft_model="scripted", num_steps=S,
                                       topk=K, num_draft_tokens=N),
                      drafter=NoisySelfDrafter(base.model))
    samples = run(eng)
    stat, dof = chi_square(samples, joint)
    assert stat < CHI2_999[dof], (stat, dof)
    st = eng.spec_stats()
    # the test must exercise both outcomes: some drafts accepted, some rejected
    assert 0 < st.accepted_tokens < st.verify_steps * S


def test_statistic_detects_a_wrong_distribution(tiny_dir, joint):
    """The same test rejects samples from a different temperature (it can fail)."""
    eng = tiny_engine(tiny_dir, max_running_requests=64, seed=3)
    wrong = SamplingParams(max_new_tokens=3, temperature=0.9, top_k=3, ignore_eos=True)
    samples = [tuple(o.token_ids) for o in eng.generate([PROMPT] * N_SAMPLES, wrong)]
    stat, dof = chi_square(samples, joint)
    assert stat > CHI2_999[dof], (stat, dof)
