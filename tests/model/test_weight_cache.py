"""The converted-weights cache (model/weight_cache.py), the cached GGUF tokenizer
(model/tokenizer.py) and lazy imports: a hit equals a fresh conversion, a damaged entry is
detected and rebuilt, an unwritable cache falls back to none with a warning, and outputs are
the same with the cache on, cold, warm and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglekv.model.config import ModelConfig
from eaglekv.model.llama import LlamaForCausalLM, fuse_weights
from eaglekv.model.loader import load_checkpoint


def load(path, **kw):
    return load_checkpoint(path, load_tokenizer=False, dtype=torch.float32, **kw)


def cache_file(root: Path) -> Path:
    files = list(root.glob("weights/*/model.safetensors"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EAGLEKV_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The fused layout converted in memory, without any cache."""
    ck = load_checkpoint(tiny_dir, load_tokenizer=False)
    return fuse_weights(ck.config, dict(ck.state_dict), torch.float32)


def assert_same(w, ref):
    assert set(w) == set(ref)
    for n in ref:
        assert w[n].dtype == ref[n].dtype and torch.equal(w[n], ref[n]), n


def test_first_load_writes_then_hits(tiny_dir, cache, reference):
    """The first load converts and writes a safetensors file; the second maps it: same config,
    same tensors bit for bit, and the model holds the mapped tensors themselves (no copy)."""
    first = load(tiny_dir)
    assert {"read", "convert", "cache write"} <= set(first.load_times)
    assert_same(first.state_dict, reference)
    second = load(tiny_dir)
    assert "cache hit" in second.load_times and "convert" not in second.load_times
    assert second.config == first.config
    assert_same(second.state_dict, reference)
    from safetensors import safe_open   # a valid safetensors file for other readers too
    with safe_open(str(cache_file(cache)), framework="pt") as f:
        assert torch.equal(f.get_tensor("layers.1.qkv"), reference["layers.1.qkv"])
    model = LlamaForCausalLM.from_fused(second.config, second.state_dict)
    assert model.layers[0].qkv.data_ptr() == second.state_dict["layers.0.qkv"].data_ptr()


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":            # one byte inside the tensor data
        data[len(data) * 2 // 3] ^= 0x40
    elif how == "truncate":
        del data[-1000:]
    elif how == "header":
        data[8:40] = b"{" * 32
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "header", "empty"])
def test_damaged_entry_is_rebuilt(tiny_dir, cache, reference, how):
    """A flipped byte, a cut file, a broken header or an empty file is reported and rebuilt,
    never used: the load still returns the right weights and the next load is a clean hit."""
    load(tiny_dir)
    damage(cache_file(cache), how)
    with pytest.warns(UserWarning, match="is damaged"):
        again = load(tiny_dir)
    assert "convert" in again.load_times
    assert_same(again.state_dict, reference)
    third = load(tiny_dir)
    assert "cache hit" in third.load_times
    assert_same(third.state_dict, reference)


def test_changed_source_gets_a_new_entry(tmp_path, tiny_dir, cache):
    """The key follows the source's identity: a touched config.json is a new entry."""
    src = tmp_path / "model"
    src.mkdir()
    for f in tiny_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    load(src)
    os.utime(src / "config.json", ns=(1, 1))
    assert "convert" in load(src).load_times
    assert len(list(cache.glob("weights/*/model.safetensors"))) == 2


def test_cache_off(tiny_dir, tmp_path, monkeypatch, reference):
    """An empty EAGLEKV_CACHE converts every time and writes nothing."""
    monkeypatch.setenv("EAGLEKV_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    ck = load(tiny_dir)
    assert "convert" in ck.load_times and "cache write" not in ck.load_times
    assert_same(ck.state_dict, reference)
    assert not any(tmp_path.rglob("*.safetensors"))


def test_unwritable_cache_falls_back(tiny_dir, tmp_path, monkeypatch, reference):
    """A cache directory that cannot be created is a warning, not a failure."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("EAGLEKV_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot write the cache"):
        ck = load(tiny_dir)
    assert_same(ck.state_dict, reference)


def test_engine_tokens_equal_with_cache_cold_warm_off(tiny_dir, cache, monkeypatch):
    """Greedy tokens of the engine are the same with the cache cold, warm and off."""
    from eaglekv import Engine, SamplingParams
    sp = SamplingParams(max_new_tokens=12)
    runs = []
    for mode in ("cold", "warm", "off"):
        if mode == "off":
            monkeypatch.setenv("EAGLEKV_CACHE", "")
        engine = Engine(model=str(tiny_dir), max_total_tokens=256, max_running_requests=2)
        runs.append([o.token_ids for o in engine.generate([[1, 2, 3, 4], [9, 8, 7]], sp)])
    assert runs[0] == runs[1] == runs[2]


def test_gguf_config_without_transformers_equals_autoconfig():
    """The engine's path builds the default GGUF's ModelConfig from the metadata dict; it
    equals the one through transformers' AutoConfig, RoPE inputs included."""
    from eaglekv.model.gguf_loader import gguf_config_dict, hf_config_from_dict, read_gguf
    from eaglekv.model.loader import config_from_dict, default_model_path
    from eaglekv.model.rope import inv_freq_and_scale
    path = default_model_path()
    d = gguf_config_dict(read_gguf(path), path)
    light = config_from_dict(d)
    full = ModelConfig.from_hf(hf_config_from_dict(d))
    assert light == full
    a, b = (inv_freq_and_scale(c.hf_config, c.head_dim) for c in (light, full))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


# ---- the GGUF tokenizer, cached ----------------------------------------------------------------
@pytest.mark.slow
def test_cached_tokenizer_equals_transformers(cache):
    """The tokenizer rebuilt from the cache's tokenizer.json encodes, decodes and renders the
    chat template exactly as transformers' GGUF tokenizer does."""
    from transformers import AutoTokenizer

    from eaglekv.model.loader import default_model_path
    from eaglekv.model.tokenizer import load_gguf_tokenizer
    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    load_gguf_tokenizer(path)                       # converts and writes
    tok = load_gguf_tokenizer(path)                 # from tokenizer.json
    assert list(cache.glob("tokenizer/*/tokenizer.json"))
    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café ☕ 日本語",
             "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159", ""]
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == \
                    hf.decode(ids, skip_special_tokens=skip)
    convs = [[{"role": "user", "content": "Why is the sky blue?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
    for conv in convs:
        for gen in (True, False):
            assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == \
                hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == \
        (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
    saved = cache / "saved"
    tok.save_pretrained(saved)   # what bench/guidellm_tokenizer.py hands to guidellm
    again = AutoTokenizer.from_pretrained(saved)
    assert again.encode(texts[2]) == hf.encode(texts[2])
    assert json.loads((saved / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


# ---- lazy imports ------------------------------------------------------------------------------
def imported_after(code: str, env: dict | None = None) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return {m for m in out if "." not in m}


def test_import_eaglekv_is_light():
    """`import eaglekv` loads neither torch nor transformers; the engine's names still resolve,
    and the CPU engine's modules pull in no transformers, triton or fastapi."""
    assert not {"torch", "transformers", "numpy"} & imported_after("import eaglekv")
    mods = imported_after("from eaglekv import Engine, EngineConfig, SamplingParams\n"
                          "import eaglekv.cli")
    assert "torch" in mods and not {"transformers", "triton", "fastapi", "uvicorn"} & mods


@pytest.mark.slow
def test_warm_default_engine_needs_no_transformers(smol_engine, weight_cache_dir):
    """With the default model in the cache, building the engine imports no transformers."""
    if weight_cache_dir is None:
        pytest.skip("run without a cache (EAGLEKV_CACHE empty)")
    mods = imported_after("from eaglekv import Engine\n"
                          "e = Engine(model='default', max_total_tokens=64)\n"
                          "assert e.tokenizer.encode('Hello') == [19556]",
                          env={"EAGLEKV_CACHE": str(weight_cache_dir)})
    assert "transformers" not in mods and "eaglekv" in mods
