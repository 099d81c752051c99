"""`eaglekv serve` flags -> EngineConfig and ServerConfig (issue 11: the flags of `vllm serve`
and SGLang's `launch_server` too). Arguments are parsed into configs; no model is loaded."""

from __future__ import annotations

import pytest

from eaglekv.cli import build_parser, main, serve_configs
from eaglekv.config import EngineConfig, SpecConfig
from eaglekv.errors import ConfigError
from eaglekv.server.settings import MAX_REQUEST_BYTES, MAX_SUB_REQUESTS, ServerConfig

NO_ENV: dict = {}


def configs(*argv: str, environ=NO_ENV) -> tuple[EngineConfig, ServerConfig]:
    return serve_configs(build_parser().parse_args(["serve", *argv]), environ)


def engine(*argv: str) -> EngineConfig:
    return configs(*argv)[0]


def server(*argv: str, environ=NO_ENV) -> ServerConfig:
    return configs(*argv, environ=environ)[1]


# --- defaults: what `eaglekv serve` did before the new flags -----------------------------------

def test_defaults_unchanged():
    e, s = configs()
    assert e == EngineConfig(max_total_tokens=4096)      # the CLI's pool size, as before
    assert s == ServerConfig(model_name="default")
    assert (s.default_max_tokens, s.max_request_bytes, s.max_sub_requests, s.api_key,
            s.chat_template) == (256, MAX_REQUEST_BYTES, MAX_SUB_REQUESTS, None, None)


def test_existing_flags_still_work():
    e, s = configs("--model", "m", "--dtype", "bf16", "--page-size", "4",
                   "--max-total-tokens", "1024", "--chunked-prefill-size", "0",
                   "--max-running-requests", "3", "--served-model-name", "smol",
                   "--default-max-tokens", "64", "--spec", "eagle", "--draft", "random",
                   "--num-steps", "2", "--topk", "2", "--num-draft-tokens", "5")
    assert (e.model, e.dtype, e.page_size, e.max_total_tokens, e.chunked_prefill_size,
            e.max_running_requests) == ("m", "bf16", 4, 1024, None, 3)
    assert e.speculative == SpecConfig(algorithm="eagle", draft_model="random", num_steps=2,
                                       topk=2, num_draft_tokens=5)
    assert (s.model_name, s.default_max_tokens) == ("smol", 64)


# --- model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["m1"], ["--model", "m1"], ["--model-path", "m1"],
                                  ["m1", "--model", "m1"], ["--port", "0", "m1"]])
def test_model_positional_or_flag(argv):
    e, s = configs(*argv)
    assert e.model == "m1" and s.model_name == "m1"


def test_model_given_twice_differently_names_both():
    with pytest.raises(ConfigError, match=r"MODEL 'm1' and as --model/--model-path 'm2'"):
        configs("m1", "--model", "m2")


# --- engine sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--max-context-len", "--max-model-len", "--context-length"])
def test_context_length_aliases(flag):
    assert engine(flag, "1000").max_context_len == 1000
    assert engine().max_context_len is None                # the model's own


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization", "--mem-fraction-static",
                                  "--mem-fraction"])
def test_memory_fraction_aliases_size_the_pool(flag):
    e = engine(flag, "0.5")
    assert e.mem_fraction == 0.5 and e.max_total_tokens is None   # sized from the fraction


def test_memory_fraction_aliases_agreeing_are_fine_differing_are_an_error():
    e = engine("--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.5")
    assert e.mem_fraction == 0.5
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization=0.5 and "
                       r"--mem-fraction\(-static\)=0.3"):
        engine("--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.3")


def test_memory_fraction_with_max_total_tokens_is_an_error():
    with pytest.raises(ConfigError, match=r"--max-total-tokens=2048 .* 0.5 would go unused"):
        engine("--gpu-memory-utilization", "0.5", "--max-total-tokens", "2048")


def test_memory_fraction_out_of_range_names_the_value():
    with pytest.raises(ConfigError, match=r"mem_fraction=0.99 must be in \(0, 0.95\]"):
        engine("--gpu-memory-utilization", "0.99")


@pytest.mark.parametrize("flag", ["--max-running-requests", "--max-num-seqs"])
def test_max_running_requests_aliases(flag):
    assert engine(flag, "5").max_running_requests == 5


def test_seed():
    assert engine("--seed", "7").seed == 7
    assert engine().seed == EngineConfig().seed


# --- speculative decoding ------------------------------------------------------------------------

@pytest.mark.parametrize("json_text,flags", [
    ('{"method": "eagle", "model": "default", "num_speculative_tokens": 3}',
     ["--spec", "eagle", "--draft", "default", "--num-steps", "3", "--num-draft-tokens", "4"]),
    ('{"method": "eagle3", "model": "random", "num_speculative_tokens": 5}',
     ["--spec", "eagle3", "--draft", "random", "--num-steps", "5"]),
    ('{"method": "EAGLE", "model": "random"}', ["--spec", "eagle", "--draft", "random"]),
    ('{"method": "eagle", "model": "random", "num_speculative_tokens": 4, "topk": 4, '
     '"num_draft_tokens": 16}',
     ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "random",
      "--speculative-num-steps", "4", "--speculative-eagle-topk", "4",
      "--speculative-num-draft-tokens", "16"]),
    ('{"method": "multi_layer_eagle", "model": "random", "num_speculative_tokens": 2}',
     ["--spec", "multi_layer_eagle", "--draft", "random", "--num-steps", "2"]),
])
def test_speculative_config_equals_explicit_flags(json_text, flags):
    from_json = engine("--speculative-config", json_text).speculative
    assert from_json == engine(*flags).speculative
    assert from_json.enabled


def test_speculative_config_chain_verifies_steps_plus_one():
    sp = engine("--speculative-config", '{"method": "eagle", "model": "random", '
                '"num_speculative_tokens": 6}').speculative
    assert (sp.num_steps, sp.topk, sp.num_draft_tokens) == (6, 1, 7)
    assert engine("--spec", "eagle", "--draft", "random", "--num-steps", "6").speculative == sp


def test_sglang_speculative_aliases():
    sp = engine("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                "--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
                "--speculative-num-draft-tokens", "4").speculative
    assert sp == SpecConfig(algorithm="eagle3", draft_model="d", num_steps=2, topk=2,
                            num_draft_tokens=4)


def test_no_speculative_flags_is_plain_decoding():
    assert engine().speculative == SpecConfig()


@pytest.mark.parametrize("json_text,match", [
    ('{"method": "eagle", ', r"--speculative-config '\{\"method\": \"eagle\", ' is not valid JSON"),
    ('["eagle"]', r"must be a JSON object"),
    ('{"method": "eagle", "model": "random", "draft_tensor_parallel_size": 1, "x": 2}',
     r"unknown keys \['x'\]"),
    ('{"model": "random"}', r"method=None: eaglekv runs the methods"),
    ('{"method": "ngram", "model": "random"}', r"method='ngram': eaglekv runs the methods "
                                              r"\['eagle', 'eagle3', 'multi_layer_eagle'\]"),
    ('{"method": "eagle", "model": "random", "num_speculative_tokens": 2.5}',
     r"num_speculative_tokens=2.5 must be an int >= 1"),
    ('{"method": "eagle", "model": "random", "topk": 0}', r"topk=0 must be an int >= 1"),
    ('{"method": "eagle", "model": 3}', r"model=3 must be a draft checkpoint"),
    ('{"method": "eagle"}', r"needs a draft_model"),
    ('{"method": "eagle", "model": "random", "num_speculative_tokens": 3, '
     '"num_draft_tokens": 9}', r"num_draft_tokens must be num_steps \+ 1 = 4, not 9"),
])
def test_speculative_config_errors_name_the_value(json_text, match):
    with pytest.raises(ConfigError, match=match):
        engine("--speculative-config", json_text)


@pytest.mark.parametrize("flags,named", [
    (["--spec", "eagle"], "--spec/--speculative-algorithm"),
    (["--draft", "random"], "--draft/--speculative-draft-model-path"),
    (["--speculative-num-steps", "3"], "--num-steps/--speculative-num-steps"),
    (["--topk", "1"], "--topk/--speculative-eagle-topk"),
    (["--num-draft-tokens", "4"], "--num-draft-tokens/--speculative-num-draft-tokens"),
])
def test_speculative_config_with_explicit_flags_is_an_error(flags, named):
    with pytest.raises(ConfigError, match=f"--speculative-config and {named} both set"):
        engine("--speculative-config", '{"method": "eagle", "model": "random"}', *flags)


def test_unknown_speculative_algorithm_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--speculative-algorithm", "NEXTN"])
    assert e.value.code == 2 and "'nextn'" in capsys.readouterr().err


# --- server settings -----------------------------------------------------------------------------

def test_chat_template_reads_a_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert server("--chat-template", str(path)).chat_template == path.read_text()


def test_chat_template_inline():
    text = "{{ messages[0].content }}"
    assert server("--chat-template", text).chat_template == text


def test_chat_template_missing_file_names_it(tmp_path):
    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(ConfigError, match=f"--chat-template '{missing}' is neither a file nor"):
        server("--chat-template", missing)


def test_chat_template_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jinja"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        server("--chat-template", str(path))


@pytest.mark.parametrize("environ,flag,key", [
    ({}, [], None),
    ({"EAGLEKV_API_KEY": "k1"}, [], "k1"),
    ({"VLLM_API_KEY": "k2"}, [], "k2"),
    ({"EAGLEKV_API_KEY": "k1", "VLLM_API_KEY": "k2"}, [], "k1"),
    ({"EAGLEKV_API_KEY": "", "VLLM_API_KEY": "k2"}, [], "k2"),    # empty: unset
    ({"EAGLEKV_API_KEY": "k1", "VLLM_API_KEY": "k2"}, ["--api-key", "k0"], "k0"),
])
def test_api_key_flag_then_env(environ, flag, key):
    assert server(*flag, environ=environ).api_key == key


def test_api_key_read_from_the_process_env_by_default(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k3")
    monkeypatch.delenv("EAGLEKV_API_KEY", raising=False)
    assert serve_configs(build_parser().parse_args(["serve"]))[1].api_key == "k3"


def test_server_limits():
    s = server("--max-request-bytes", "65536", "--max-sub-requests", "8",
               "--default-max-tokens", "32", "--served-model-name", "smol")
    assert (s.max_request_bytes, s.max_sub_requests, s.default_max_tokens, s.model_name) == \
        (65536, 8, 32, "smol")
    with pytest.raises(ConfigError, match="max_request_bytes=10 must be >= 1024"):
        server("--max-request-bytes", "10")


# --- the command: errors are one line and exit 2, before any model loads ------------------------

@pytest.mark.parametrize("argv,message", [
    (["serve", "m1", "--model", "m2"], "ConfigError: the model is given twice"),
    (["serve", "--speculative-config", "{bad"], "ConfigError: --speculative-config '{bad' is "
                                                "not valid JSON"),
    (["serve", "--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.3"],
     "ConfigError: --gpu-memory-utilization=0.5"),
])
def test_serve_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eaglekv: error: " + message) and err.count("\n") == 1


def test_bad_flag_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-model-len", "lots"])
    assert e.value.code == 2 and "--max-context-len/--max-model-len/--context-length" in \
        capsys.readouterr().err


def test_speculative_config_accepts_vllm_draft_tp_1():
    e, _ = configs("--speculative-config", '{"method": "eagle", "model": "random", '
                   '"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}')
    assert e.speculative == SpecConfig(algorithm="eagle", draft_model="random", num_steps=2,
                                       num_draft_tokens=3)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size=2"):
        configs("--speculative-config", '{"method": "eagle", "model": "random", '
                '"draft_tensor_parallel_size": 2}')
