"""One poisoned request never fails the others (CPU, fp32, tiny random target).

Validation: every sampling parameter probed at its extremes is either refused with a
ConfigError naming the value, or mapped to a value whose fp32 distribution is finite.
Isolation: with validation bypassed, a request whose distribution is not finite fails alone
(RequestFailed, finish_reason "error"), in the plain and the speculative engine, in prefill or
mid-decode; the others' outputs equal a run without it, and the allocator is back to full.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.config import FP32_TINY
from eaglekv.sampling import apply_penalties, sample_next, target_probs, valid_probs
from eaglekv.errors import ConfigError, RequestFailed
from helpers import tiny_engine

EXTREMES = [1e-40, 1e-300, 1e300, math.inf, -math.inf, math.nan, -0.0, 5e-324]
ERR = "refused"
# what SamplingParams makes of each extreme: the value kept, or ERR
EXPECTED = {
    "temperature": [0.0, 0.0, ERR, ERR, ERR, ERR, 0.0, 0.0],          # < 1e-5: greedy
    "top_p": [FP32_TINY, FP32_TINY, ERR, ERR, ERR, ERR, ERR, FP32_TINY],
    "repetition_penalty": [ERR] * 8,                                    # [0.01, 100]
    "presence_penalty": [1e-40, 1e-300, ERR, ERR, ERR, ERR, -0.0, 5e-324],
    "frequency_penalty": [1e-40, 1e-300, ERR, ERR, ERR, ERR, -0.0, 5e-324],
}
EDGES = [("temperature", 1e-5, 1e-5), ("temperature", 9.9e-6, 0.0), ("temperature", 1e4, 1e4),
         ("temperature", 1.0001e4, ERR), ("repetition_penalty", 0.01, 0.01),
         ("repetition_penalty", 100.0, 100.0), ("repetition_penalty", 0.0099, ERR),
         ("repetition_penalty", 100.5, ERR), ("top_p", 1.0, 1.0), ("top_p", 1.0000001, ERR),
         ("presence_penalty", 2.0, 2.0), ("frequency_penalty", -2.0001, ERR)]
CASES = [(n, v, e) for n, es in EXPECTED.items() for v, e in zip(EXTREMES, es)] + EDGES


def _sampleable(params: SamplingParams) -> bool:
    """Large fp32 logits through the penalties and target_probs give a usable distribution."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 256, generator=g) * 40                       # (3, V)
    ctx = list(range(0, 256, 3))
    x = apply_penalties(logits, [params] * 3, [ctx] * 3, [ctx] * 3)
    p = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0) if params.greedy \
        else target_probs(x, params)
    return bool(valid_probs(p).all())


@pytest.mark.parametrize("name,value,expected", CASES)
def test_extreme_sampling_values(name, value, expected):
    kw = {name: value}
    if name in ("top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        kw["temperature"] = 1.0          # sampled, so the value matters downstream
    if expected == ERR:
        with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r} must be")):
            SamplingParams(**kw)
        return
    p = SamplingParams(**kw)
    assert getattr(p, name) == expected
    assert _sampleable(p)


def test_tiny_top_p_keeps_the_top_token():
    """Even bypassing the mapping (1e-300 rounds to 0 in fp32), target_probs keeps the
    argmax: a one-hot, never NaN."""
    p = SamplingParams(temperature=1.0)
    object.__setattr__(p, "top_p", 1e-300)
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    probs = target_probs(logits, p)
    assert torch.equal(probs, torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, True), 1))


def test_sample_next_fails_bad_rows_alone():
    """NaN logits on a greedy row, a 1e-40 temperature on a sampled row: both None; the other
    rows get exactly the tokens they get in a batch of their own."""
    logits = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)) * 5
    logits[1, 7] = math.nan
    good = SamplingParams(temperature=0.9)
    bad = SamplingParams(temperature=0.9)
    object.__setattr__(bad, "temperature", 1e-40)
    params = [SamplingParams(), SamplingParams(), good, bad, good]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(5)]  # noqa: E731
    got = sample_next(logits, params, gens())
    assert got[1] is None and got[3] is None
    keep = [0, 2, 4]
    g = gens()
    alone = sample_next(logits[keep], [params[i] for i in keep], [g[i] for i in keep])
    assert [got[i] for i in keep] == alone


POISONS = {"temperature": 1e-40, "repetition_penalty": 1e-40}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 47)), [100, 3, 100, 3]]


def _others(greedy: bool):
    """Three good requests: greedy and seeded sampled ones (all greedy where `greedy`)."""
    t = (0.0, 0.0) if greedy else (0.8, 1.1)
    return [SamplingParams(max_new_tokens=14, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=t[0], seed=7, ignore_eos=True,
                           logprobs=1),
            SamplingParams(max_new_tokens=10, temperature=t[1], top_p=0.9, seed=9,
                           ignore_eos=True)]


def _run(eng, poison: str | None, after: int = 0, greedy: bool = False):
    """The three good requests, plus (when `poison`) a fourth whose `poison` parameter is set
    past validation (as a bug would) from the start (after=0) or once it has `after` tokens.
    Returns (the good ones' tokens and logprobs, the poisoned Req)."""
    reqs = [eng.add_request(PROMPTS[i], p) for i, p in enumerate(_others(greedy))]
    bad = None
    if poison:
        params = SamplingParams(max_new_tokens=12, temperature=0.0 if greedy else 1.0, seed=3,
                                ignore_eos=True, logprobs=2)
        bad = eng.add_request(PROMPTS[3], params)
    poisoned = False
    while eng.has_unfinished():
        if bad is not None and not poisoned and len(bad.output_ids) >= after:
            object.__setattr__(bad.params, poison, POISONS[poison])
            poisoned = True
        eng.step()
    eng.check_memory()
    assert eng.allocator.is_full()
    return [(r.output_ids, [lp.logprob for lp in r.output_logprobs]) for r in reqs], bad


def _check(outs, ref, bad, after):
    # the same tokens; logprobs to fp32 rounding: the poisoned request was in the batch, and
    # a BLAS may sum a row in another order for another row count (OpenBLAS on one of this
    # project's machines did, for a 39-row prefill against 35)
    assert [t for t, _ in outs] == [t for t, _ in ref]
    for (_, got), (_, want) in zip(outs, ref):
        assert got == pytest.approx(want, abs=1e-5)
    assert bad.finish_reason == "error" and isinstance(bad.error, RequestFailed)
    assert f"request {bad.rid}: the sampling distribution is not finite" in str(bad.error)
    assert bad.to_output().finish_reason == "error"
    assert len(bad.output_ids) == len(bad.output_logprobs)
    assert len(bad.output_ids) >= after if after else bad.output_ids == []


@pytest.mark.parametrize("after", [0, 3])
@pytest.mark.parametrize("poison", list(POISONS))
def test_plain_engine_poisoned_request_fails_alone(tiny_dir, poison, after):
    ref, _ = _run(tiny_engine(tiny_dir, max_running_requests=4), None)
    outs, bad = _run(tiny_engine(tiny_dir, max_running_requests=4), poison, after)
    _check(outs, ref, bad, after)


def _spec(tiny_dir, K: int):
    S = 3
    spec = dict(algorithm="eagle", draft_model="random", num_steps=S, topk=K,
                num_draft_tokens=S + 1 if K == 1 else 6)
    return tiny_engine(tiny_dir, page_size=4, max_running_requests=4, speculative=spec)


@pytest.mark.parametrize("K", [1, 2])          # a sampled chain (p/q rule), a top-k tree
@pytest.mark.parametrize("after", [0, 3])      # fails in prefill, fails in a verify step
@pytest.mark.parametrize("poison", list(POISONS))
def test_speculative_poisoned_request_fails_alone(tiny_dir, poison, after, K):
    ref, _ = _run(_spec(tiny_dir, K), None)
    outs, bad = _run(_spec(tiny_dir, K), poison, after)
    _check(outs, ref, bad, after)


@pytest.mark.parametrize("K", [None, 1, 2])    # plain; greedy chain; greedy tree
@pytest.mark.parametrize("after", [0, 3])
def test_greedy_batch_poisoned_by_repetition_penalty(tiny_dir, after, K):
    """All greedy (the argmax paths): a 1e-40 repetition penalty makes +inf logits."""
    make = (lambda: tiny_engine(tiny_dir, max_running_requests=4)) if K is None \
        else (lambda: _spec(tiny_dir, K))
    ref, _ = _run(make(), None, greedy=True)
    outs, bad = _run(make(), "repetition_penalty", after, greedy=True)
    _check(outs, ref, bad, after)


def test_generate_raises_the_failed_requests_error(tiny_dir):
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    bad = SamplingParams(max_new_tokens=5, temperature=1.0)
    object.__setattr__(bad, "temperature", 1e-40)
    with pytest.raises(RequestFailed, match="temperature=1e-40"):
        eng.generate(PROMPTS[:2], [_others(True)[0], bad])
    assert not eng.has_unfinished()
    eng.check_memory()
    assert eng.allocator.is_full()
    # the engine goes on serving
    assert eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"


@pytest.mark.parametrize("spec", [False, True])
def test_runner_error_fails_its_step_alone(tiny_dir, spec):
    """An exception other than KVIndexError inside the runner (a bug, a device error): the
    step's requests fail with their KV and the slots the step took freed, the error is
    raised, and the engine serves the next request exactly (before, the requests kept
    running over slots whose K/V were never written)."""
    from helpers import spec as spec_cfg
    opts = {"speculative": spec_cfg("eagle", 3, 1, 4)} if spec else {}
    engine = tiny_engine(tiny_dir, max_running_requests=4, **opts)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = engine.generate([[5, 17, 42]], sp)[0].token_ids
    reqs = [engine.add_request(p, sp) for p in ([5, 17, 42], [9] * 7)]
    engine.step()
    engine.step()
    run = engine.runner.run

    def broken(plan):
        raise RuntimeError("device fell over")
    engine.runner.run = broken
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.step()
    engine.runner.run = run
    assert [r.finish_reason for r in reqs] == ["error", "error"]
    assert not engine.running and engine.allocator.is_full()
    engine.check_memory()
    assert engine.generate([[5, 17, 42]], sp)[0].token_ids == ref
