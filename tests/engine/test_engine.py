"""Engine behaviour on a tiny random Llama: continuous batching equals one-at-a-time,
preemption, seeding, stop rules, streaming, KV contents, guarded reads, clear errors."""

from __future__ import annotations

import pytest
import torch

from eaglekv import ConfigError, KVIndexError, ModelLoadError, RequestError, SamplingParams
from eaglekv.core import ForwardBatch
from helpers import tiny_engine

PROMPTS = [[5, 17, 42], list(range(1, 30)), [200, 3, 9, 9, 1, 77, 250], [11] * 12,
           list(range(100, 160, 3)), [7]]
MAX_NEW = [12, 5, 20, 9, 16, 1]


def solo_outputs(tiny_dir, params_list, page_size=1):
    engine = tiny_engine(tiny_dir, page_size=page_size, max_running_requests=1)
    return [engine.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params_list)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batched_equals_one_at_a_time(tiny_dir, page_size):
    """6 requests, at most 3 running: they join and leave between steps, output unchanged."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    ref = solo_outputs(tiny_dir, params, page_size)
    engine = tiny_engine(tiny_dir, page_size=page_size, max_running_requests=3)
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref
    assert [len(o.token_ids) for o in outs] == MAX_NEW
    assert all(o.finish_reason == "length" for o in outs)
    engine.check_memory()
    assert engine.allocator.is_full()


def test_preemption_recomputes_and_keeps_output(tiny_dir):
    """A KV pool too small for all running requests preempts the newest; output unchanged."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    ref = solo_outputs(tiny_dir, params)
    engine = tiny_engine(tiny_dir, max_running_requests=4, max_total_tokens=48)
    outs = engine.generate(PROMPTS, params)
    assert engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
    engine.check_memory()
    assert engine.allocator.is_full()


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir):
    """The same seed gives the same tokens alone or inside a batch; another seed differs."""
    engine = tiny_engine(tiny_dir, max_running_requests=4)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], sp)[0].token_ids
    batch = engine.generate(PROMPTS[:3], [sp, SamplingParams(max_new_tokens=8),
                                          SamplingParams(max_new_tokens=30, temperature=0.7)])
    assert batch[0].token_ids == alone
    other = engine.generate([PROMPTS[0]], SamplingParams(
        max_new_tokens=24, temperature=1.0, top_p=0.9, seed=124, ignore_eos=True))[0]
    assert other.token_ids != alone
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    top1 = engine.generate([PROMPTS[0]], SamplingParams(
        max_new_tokens=24, temperature=1.3, top_k=1, ignore_eos=True, seed=5))[0]
    assert top1.token_ids == greedy.token_ids
    engine.check_memory()


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {9: 27.88, 19: 43.82, 29: 58.30}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 10, 1.0), (0.7, 20, 1.0),
                                                     (1.5, 30, 0.95)])
def test_sampling_distribution_matches_target(tiny_dir, tiny_hf, temperature, top_k, top_p):
    """4000 first tokens follow softmax(logits / T) restricted to top-k / top-p (chi-square)."""
    from eaglekv.sampling import target_probs
    prompt = PROMPTS[2]
    sp = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    with torch.inference_mode():
        logits = tiny_hf(torch.tensor([prompt])).logits[0, -1]
    p = target_probs(logits, sp).double()
    # the reference distribution itself: exactly top_k tokens at most, renormalised
    assert int((p > 0).sum()) <= top_k and abs(float(p.sum()) - 1) < 1e-6
    engine = tiny_engine(tiny_dir, max_running_requests=64, seed=7)
    n = 4000
    toks = [o.token_ids[0] for o in engine.generate([prompt] * n, sp)]
    counts = torch.bincount(torch.tensor(toks), minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0, "sampled a token outside top-k / top-p"
    support = p > 0
    expected = p[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    crit = CHI2_999.get(dof) or dof + 3.1 * (2 * dof) ** 0.5 + 3  # normal approx. of p=0.001
    assert chi2 < crit, f"chi2={chi2:.1f} >= {crit:.1f} with {dof} dof"
    engine.check_memory()


def test_stop_token_ids_and_length(tiny_dir):
    """A stop token ends the request with 'stop' (token kept); otherwise 'length'."""
    engine = tiny_engine(tiny_dir)
    free = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                       stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    assert free.finish_reason == "length"
    engine.check_memory()


def test_eos_stops_unless_ignored(tiny_dir):
    """A model EOS id ends the request; ignore_eos runs on to max_new_tokens."""
    engine = tiny_engine(tiny_dir)
    free = engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    engine.eos_ids = frozenset({free.token_ids[2]})
    for r in (engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=10)),):
        while not r.finished:
            engine.step()
        assert r.finish_reason == "stop" and r.output_ids[-1] == free.token_ids[2]
    again = engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert again.token_ids == free.token_ids


def test_stream_yields_the_same_tokens(tiny_dir):
    """Deltas of `stream` concatenate to the `generate` output, the last one has the reason."""
    engine = tiny_engine(tiny_dir)
    sp = SamplingParams(max_new_tokens=15, ignore_eos=True)
    ref = engine.generate([PROMPTS[1]], sp)[0]
    deltas = list(engine.stream(PROMPTS[1], sp))
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    engine.check_memory()


@pytest.mark.parametrize("page_size", [1, 4])
def test_decoded_kv_equals_fresh_prefill(tiny_dir, page_size):
    """K/V written token by token during decode equal one prefill of the same tokens."""
    engine = tiny_engine(tiny_dir, page_size=page_size)
    req = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(12):
        engine.step()
    ids, n = req.all_ids[:req.kv_len], req.kv_len
    slots = engine.req_to_token.req_to_token[req.row, :n].long()
    row = engine.req_to_token.alloc()
    fresh = engine.allocator.alloc(n)
    engine.req_to_token.req_to_token[row, :n] = fresh.int()
    engine.model.forward(ForwardBatch.build([ids], [0], [row], fresh), engine.backend)
    for layer in range(engine.model_config.num_layers):
        k, v = engine.kv_pool.get_kv_buffer(layer)
        torch.testing.assert_close(k[slots], k[fresh], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[slots], v[fresh], rtol=1e-5, atol=1e-5)
    engine.allocator.free(fresh)
    engine.req_to_token.free(row)
    while not req.finished:
        engine.step()
    engine.check_memory()
    assert engine.allocator.is_full()


def test_corrupt_slot_fails_only_that_batch(tiny_dir):
    """A garbage slot id in req_to_token raises KVIndexError naming it (nothing read out of
    bounds); the engine frees what it can and serves the next request correctly."""
    engine = tiny_engine(tiny_dir, max_total_tokens=256)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = engine.generate([PROMPTS[0]], sp)[0].token_ids
    req = engine.add_request(PROMPTS[1], sp)
    engine.step()
    engine.req_to_token.req_to_token[req.row, 3] = 10**6
    with pytest.raises(KVIndexError, match=r"slot 1000000 out of range \[0, 257\)"):
        engine.step()
    assert req.finish_reason == "error"
    assert engine.allocator.is_full()
    assert engine.generate([PROMPTS[0]], sp)[0].token_ids == ref
    engine.check_memory()


def test_request_errors_are_clear(tiny_dir):
    engine = tiny_engine(tiny_dir, max_context_len=64, max_total_tokens=40)
    with pytest.raises(RequestError, match=r"60 tokens \+ max_new_tokens=10 = 70 exceeds "
                                           r"max_context_len=64"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(RequestError, match="needs 49 KV slots .* holds 40 slots"):
        engine.generate([[1] * 30], SamplingParams(max_new_tokens=20))
    with pytest.raises(RequestError, match=r"token id 999 outside the vocabulary \[0, 256\)"):
        engine.generate([[1, 999]])
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate([[]])
    with pytest.raises(RequestError, match="needs a tokenizer"):
        engine.generate("text without a tokenizer")
    assert not engine.has_unfinished()
    engine.check_memory()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k=-2 must be an int >= 0"),
    (dict(stop=("",)), "stop=.* non-empty strings"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float8"), "dtype='float8' unknown"),
    (dict(page_size=0), "page_size=0 must be an int >= 1"),
    (dict(max_running_requests=0), "max_running_requests=0 must be >= 1"),
    (dict(max_total_tokens=2, page_size=4), "max_total_tokens=2 must be >= page_size=4"),
    (dict(mem_fraction=1.5), r"mem_fraction=1.5 must be in \(0, 0.95\]"),
    (dict(bogus_option=1), r"unknown engine options \['bogus_option'\]"),
])
def test_engine_config_validation(kwargs, match):
    from eaglekv import Engine
    with pytest.raises(ConfigError, match=match):
        Engine(**kwargs)


def test_missing_and_mismatched_models(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file
    with pytest.raises(ModelLoadError, match="does not exist"):
        tiny_engine(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    sd = load_file(str(tiny_dir / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight has shape "
                                             r"\(64, 64\), config expects \(128, 64\)"):
        tiny_engine(bad)
    del sd["model.norm.weight"]
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor model.norm.weight"):
        tiny_engine(bad)
    (bad / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture model_type='gpt2'"):
        tiny_engine(bad)


def test_abort_running_and_waiting_frees_everything(tiny_dir):
    """Engine.abort (a client went away): a running and a queued request both end with
    finish_reason 'abort', the other request is untouched, and the pool is back to full."""
    eng = tiny_engine(tiny_dir, max_running_requests=2)
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = eng.generate([[5, 6, 7]], p)[0].token_ids
    a, b, c = (eng.add_request(ids, p) for ids in ([1, 2, 3, 4], [5, 6, 7], [9, 9]))
    eng.step()                               # a and b run, c waits (two rows)
    assert c in eng.waiting and a in eng.running
    eng.abort(a)
    eng.abort(c)
    eng.abort(c)                             # twice: a no-op
    assert (a.finish_reason, c.finish_reason) == ("abort", "abort")
    while eng.has_unfinished():
        eng.step()
    assert b.output_ids == ref
    eng.check_memory()


def test_batched_sampling_equals_the_per_row_rule():
    """sample_next computes the sampled rows' distributions in one batch: each row equals
    target_probs of its own params (temperature, top-k, top-p, mixed in one batch), and each
    row's draw is torch.multinomial over it with the request's own generator."""
    from eaglekv.sampling import batched_target_probs, sample_next, target_probs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=g) * 3
    logits[3, 5] = 40.0                                         # a near-certain row
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0.7, 0, 0.95), (1.0, 0, 1.0), (1.3, 20, 1.0), (0.5, 5, 0.5), (1.0, 400, 0.9),
               (0.9, 1, 1.0), (2.0, 0, 0.0001)]]
    batched = batched_target_probs(logits, params)
    for r, p in enumerate(params):
        torch.testing.assert_close(batched[r], target_probs(logits[r], p), atol=1e-6, rtol=1e-5)
    mixed = params[:5] + [SamplingParams(temperature=0.0)]
    seeds = list(range(10, 16))
    got = sample_next(logits[:6], mixed, [torch.Generator().manual_seed(s) for s in seeds])
    want = [int(torch.multinomial(target_probs(logits[r], p), 1,
                                  generator=torch.Generator().manual_seed(s))[0])
            if not p.greedy else int(logits[r].argmax()) for r, (p, s) in
            enumerate(zip(mixed, seeds))]
    assert got == want


def test_the_pool_fraction_leaves_out_the_memory_prepacking_will_take(tiny_dir, monkeypatch):
    """A CPU speculative engine reorders its weights for oneDNN after sizing the pool: the
    pool's fraction is of the memory free without those bytes."""
    from eaglekv.config import EngineConfig
    from eaglekv.engine import memory_plan
    from eaglekv.model import cpu_blas
    from eaglekv.model.config import ModelConfig
    monkeypatch.setattr(memory_plan, "free_memory_bytes", lambda device: 1 << 30)
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", mem_fraction=0.5,
                       max_running_requests=1024)
    mc = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, max_position_embeddings=4096,
                     tie_word_embeddings=True, attention_bias=False, qk_norm=False)
    whole = memory_plan.plan_kv_size(cfg, mc, 4096)
    half = memory_plan.plan_kv_size(cfg, mc, 4096, reserved_bytes=1 << 29)
    assert half == pytest.approx(whole / 2, abs=cfg.page_size)
    with pytest.raises(ConfigError, match="less than one page"):
        memory_plan.plan_kv_size(cfg, mc, 4096, reserved_bytes=1 << 31)
    if cpu_blas.packs():   # what the engine reserves: its weights' bytes at least
        from helpers import spec
        e = tiny_engine(tiny_dir, speculative=spec("eagle", 3, 1, 4))
        from eaglekv.model.llama import linear_weights
        assert e._prepack_bytes(e.config.speculative, None) == sum(
            w.numel() * 4 for w in linear_weights(e.model))
