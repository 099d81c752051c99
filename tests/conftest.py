"""Shared fixtures: tiny random Llama-family checkpoints (made with transformers, saved as
safetensors) and the default SmolLM2 model with its HF transformers oracle. Plain helper
functions and constants live in helpers.py (and draft_helpers.py, sampling_helpers.py); test
modules import those, never each other or this file."""

from __future__ import annotations

import os

import eaglekv  # noqa: F401  (before torch loads numpy: OpenBLAS's threads sleep, cpu_blas)
import pytest
import torch

from helpers import make_tiny


@pytest.fixture(scope="session", autouse=True)
def weight_cache_dir(tmp_path_factory):
    """The weight and tokenizer cache (model/weight_cache.py) in a fresh directory per session,
    never the user's; `EAGLEKV_CACHE= make test` runs the whole session without one."""
    if os.environ.get("EAGLEKV_CACHE", "x").strip() in ("", "off"):
        yield None
        return
    path = tmp_path_factory.mktemp("eaglekv_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLEKV_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny(path)
    return path


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """8 layers, so EAGLE-3's captured layers (1, L//2 - 1, L - 4) = (1, 3, 4) are distinct."""
    path = tmp_path_factory.mktemp("tiny_deep")
    make_tiny(path, num_hidden_layers=8, seed=3)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine():
    from eaglekv import Engine, EngineConfig
    return Engine(EngineConfig(model="default", max_total_tokens=4096, max_running_requests=4))


@pytest.fixture(scope="session")
def smol_hf():
    from eaglekv.bench.e2e import load_hf
    return load_hf("default", torch.float32, "cpu")
