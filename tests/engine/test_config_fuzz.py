"""Config fuzzing (issue 16): random speculative and engine settings either raise ConfigError
at construction, naming what is wrong, or a short greedy generate completes, equals plain
decoding token for token, and leaves every KV slot free. Any other exception is a failure."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglekv import SamplingParams
from eaglekv.errors import ConfigError, RequestError
from helpers import tiny_engine

PROMPT = [3, 14, 15, 92, 65]
NEW = 6

# each field valid most of the time, so that both outcomes come up (a config with any bad
# field is refused, so uniformly drawn fields would almost never run)
configs = st.fixed_dictionaries({
    "algorithm": st.sampled_from(["eagle"] * 6 + ["eagle3"] * 3 + ["multi_layer_eagle"] * 2
                                 + ["none", "medusa"]),
    "num_steps": st.sampled_from([None] * 4 + [1, 2, 3, 4, 5] * 2 + [0, -1]),
    "topk": st.sampled_from([None] * 4 + [1, 1, 2, 3, 0]),
    "num_draft_tokens": st.sampled_from([None] * 6 + [2, 3, 4, 5, 6, 8, 12, 1, 0]),
    "adaptive": st.sampled_from([None] * 4 + [False, True]),
    "page_size": st.sampled_from([1, 1, 1, 2, 4, 16, 0, -3]),
    "max_running_requests": st.sampled_from([1, 2, 4, 4, 5, 0, -1]),
    "max_context_len": st.sampled_from([None, None, 64, 32, 16, 2, 1, -1]),
    "max_total_tokens": st.sampled_from([512, 512, 256, 128, 64, 16, 0, -5]),
    "dtype": st.sampled_from(["float32"] * 4 + ["bfloat16", "float16", "int8", "fp64"]),
})


@pytest.fixture(scope="module")
def plain_outputs(deep_dir):
    """Plain greedy of PROMPT per dtype (the references)."""
    out = {}

    def get(dtype: str) -> list[int]:
        if dtype not in out:
            eng = tiny_engine(deep_dir, dtype=dtype)
            out[dtype] = eng.generate([PROMPT], SamplingParams(max_new_tokens=NEW,
                                                              ignore_eos=True))[0].token_ids
        return out[dtype]
    return get


counts = {"refused": 0, "ran": 0}


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cfg=configs)
def test_a_random_config_is_refused_clearly_or_runs_losslessly(deep_dir, plain_outputs, cfg):
    spec = {k: cfg[k] for k in ("algorithm", "num_steps", "topk", "num_draft_tokens",
                                "adaptive") if cfg[k] is not None}
    spec["draft_model"] = "random"
    engine_opts = {k: cfg[k] for k in ("page_size", "max_running_requests",
                                       "max_total_tokens", "dtype")}
    if cfg["max_context_len"] is not None:
        engine_opts["max_context_len"] = cfg["max_context_len"]
    try:
        eng = tiny_engine(deep_dir, speculative=spec, **engine_opts)
    except ConfigError as e:
        assert str(e), "a ConfigError must say what is wrong"
        counts["refused"] += 1
        return
    try:
        out = eng.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    except (ConfigError, RequestError) as e:   # a request it cannot hold: refused, said why
        assert str(e)
        counts["refused"] += 1
        return
    ref = plain_outputs(cfg["dtype"])
    if cfg["dtype"] == "float32":        # lower precision: verify and decode may round apart
        n = len(out.token_ids)
        assert out.token_ids == ref[:n], (cfg, out.token_ids, ref)
    eng.check_memory()
    assert eng.allocator.is_full()
    counts["ran"] += 1


def test_the_fuzzer_exercised_both_outcomes():
    """Runs after the fuzz test (file order): both kinds of config came up."""
    if counts["refused"] + counts["ran"] == 0:
        pytest.skip("the fuzz test did not run")
    assert counts["refused"] >= 30 and counts["ran"] >= 40, counts
    print(f"config fuzz: {counts}")
