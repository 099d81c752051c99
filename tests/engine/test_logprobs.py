"""Logprobs (CPU, fp32, tiny random targets): each output token's logprob and top-k equal
HF transformers' log-softmax of the same sequence, for greedy and sampled requests; speculative
decoding (EAGLE chain and tree, EAGLE-3, multi-layer EAGLE; page sizes 1 and 4) reports the same
figures as plain decoding; stream deltas carry them; bad values are refused."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.errors import ConfigError
from eaglekv.speculative.drafter import ScriptedDrafter
from helpers import PROMPTS, oracle, spec, tiny_engine


@pytest.fixture(scope="module")
def deep_hf(deep_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(deep_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """(len(output), V) log-softmax of the logits that chose each output token."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1:len(prompt) + len(output) - 1]
    return torch.log_softmax(logits.float(), -1)


def assert_matches(lps, ref: torch.Tensor, output: list[int], k: int, atol=1e-4):
    assert [lp.token_id for lp in lps] == output
    for lp, row, tok in zip(lps, ref, output):
        assert lp.logprob == pytest.approx(float(row[tok]), abs=atol)
        vals, ids = torch.topk(row, k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=atol)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_plain_logprobs_equal_hf(deep_dir, deep_hf, k):  # noqa: F811
    eng = tiny_engine(deep_dir, max_running_requests=4)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=k),
              SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=k, temperature=0.8,
                             seed=3),
              SamplingParams(max_new_tokens=7, ignore_eos=True),          # not asked: None
              SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=k, top_k=5,
                             temperature=1.3, seed=4)]
    outs = eng.generate(PROMPTS, params)
    assert outs[2].logprobs is None
    for o, p, prompt in zip(outs, params, PROMPTS):
        if p.logprobs is None:
            continue
        assert len(o.logprobs) == len(o.token_ids) == p.max_new_tokens
        assert_matches(o.logprobs, hf_logprobs(deep_hf, prompt, o.token_ids), o.token_ids, k)
    eng.check_memory()


FAMILIES = [("eagle", 3, 1, 4), ("eagle", 3, 2, 6), ("eagle3", 3, 2, 6),
            ("multi_layer_eagle", 3, 1, 4)]


@pytest.fixture(scope="module")
def refs(deep_dir):  # noqa: F811
    eng = tiny_engine(deep_dir, max_running_requests=4)
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=64,
                                                                      ignore_eos=True))]


def scripted(deep_dir, refs, alg, S, K, N, ps=1):  # noqa: F811
    """An engine whose draft proposes the reference, wrong at every third output position,
    so steps accept full runs, partial runs and nothing."""
    drafter = ScriptedDrafter(oracle(PROMPTS, refs, lambda j: j % 3 == 0, topk=K), 256)
    return tiny_engine(deep_dir, page_size=ps, max_running_requests=2, drafter=drafter,
                       speculative=spec(alg, S, K, N, draft="scripted"))


@pytest.mark.parametrize("alg,S,K,N", FAMILIES)
@pytest.mark.parametrize("ps", [1, 4])
def test_speculative_logprobs_equal_plain(deep_dir, deep_hf, refs, alg, S, K, N, ps):  # noqa: F811
    """The figures of every committed token, accepted draft or bonus, are the target's."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=3) for n in (20, 13)]
    plain = tiny_engine(deep_dir, max_running_requests=2).generate(PROMPTS[:2], params)
    eng = scripted(deep_dir, refs, alg, S, K, N, ps)
    outs = eng.generate(PROMPTS[:2], params)
    for o, r, prompt in zip(outs, plain, PROMPTS):
        assert o.token_ids == r.token_ids
        assert o.spec.accepted_tokens > 0 and min(o.spec.accept_histogram) <= S  # rejections too
        assert_matches(o.logprobs, hf_logprobs(deep_hf, prompt, o.token_ids), o.token_ids, 3)
        for a, b in zip(o.logprobs, r.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    eng.check_memory()


def test_sampled_speculative_logprobs_equal_hf(deep_dir, deep_hf):  # noqa: F811
    """Sampled acceptance (a random draft's probabilities, residual bonus) still reports the
    target's figures."""
    eng = tiny_engine(deep_dir, max_running_requests=2, speculative=spec("eagle", 3, 2, 6))
    p = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2, temperature=0.9, seed=5)
    out = eng.generate(PROMPTS[0], p)[0]
    assert out.spec.verify_steps > 0
    assert_matches(out.logprobs, hf_logprobs(deep_hf, PROMPTS[0], out.token_ids),
                   out.token_ids, 2)


def test_stream_deltas_carry_logprobs(deep_dir, refs):  # noqa: F811
    eng = scripted(deep_dir, refs, "eagle", 3, 1, 4)
    p = SamplingParams(max_new_tokens=11, ignore_eos=True, logprobs=1)
    ref = tiny_engine(deep_dir).generate(PROMPTS[1], p)[0]
    toks, lps = [], []
    for d in eng.stream(PROMPTS[1], p):
        assert len(d.logprobs) == len(d.token_ids)
        toks += d.token_ids
        lps += d.logprobs
    assert toks == ref.token_ids
    assert [lp.token_id for lp in lps] == toks
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                       abs=1e-4)


def test_stop_token_keeps_logprobs_aligned(deep_dir, refs):  # noqa: F811
    eng = scripted(deep_dir, refs, "eagle", 3, 1, 4)
    full = tiny_engine(deep_dir).generate(PROMPTS[0], SamplingParams(max_new_tokens=20,
                                                                     ignore_eos=True))[0]
    stop = full.token_ids[6]
    first = full.token_ids.index(stop)
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                  stop_token_ids=(stop,), logprobs=0))[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.top == [] for lp in out.logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, "3"])
def test_bad_logprobs_refused(bad):
    with pytest.raises(ConfigError, match=rf"logprobs={bad!r} must be an int in \[0, 20\]"):
        SamplingParams(logprobs=bad)


def test_openai_formats_without_a_tokenizer():
    """A model with no tokenizer shows tokens as `token_id:N`; offsets run on across chunks."""
    pytest.importorskip("fastapi")
    from eaglekv import TokenLogprob
    from eaglekv.server.logprobs import LogprobFormatter
    fmt = LogprobFormatter(None)
    lps = [TokenLogprob(7, -0.5, [(7, -0.5), (3, -1.5)]), TokenLogprob(12, -2.0, [(1, -0.1)])]
    block, end = fmt.completion(lps, offset=4)
    assert block == {"tokens": ["token_id:7", "token_id:12"], "token_logprobs": [-0.5, -2.0],
                     "top_logprobs": [{"token_id:7": -0.5, "token_id:3": -1.5},
                                      {"token_id:1": -0.1}],
                     "text_offset": [4, 14]}
    assert end == 25
    chat = fmt.chat(lps[:1])
    assert chat["refusal"] is None
    assert chat["content"] == [{"token": "token_id:7", "logprob": -0.5,
                                "bytes": list(b"token_id:7"),
                                "top_logprobs": [
                                    {"token": "token_id:7", "logprob": -0.5,
                                     "bytes": list(b"token_id:7")},
                                    {"token": "token_id:3", "logprob": -1.5,
                                     "bytes": list(b"token_id:3")}]}]
