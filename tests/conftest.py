"""Shared fixtures: tiny random Llama-family checkpoints (made with transformers, saved as
safetensors) and the default SmolLM2 model with its HF transformers oracle."""

from __future__ import annotations

import pytest
import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_tiny(path, model_type: str = "llama", seed: int = 0, **overrides):
    """Save a random HF model of `model_type` to `path`; returns the HF model (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # weights big enough that the greedy argmax is rarely a near-tie
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def tiny_engine(tiny_dir, **options):
    from eaglekv import Engine, EngineConfig
    options.setdefault("max_total_tokens", 2048)
    drafter = options.pop("drafter", None)
    return Engine(EngineConfig(model=str(tiny_dir), **options), drafter=drafter)


@pytest.fixture(scope="session")
def smol_engine():
    from eaglekv import Engine, EngineConfig
    return Engine(EngineConfig(model="default", max_total_tokens=4096, max_running_requests=4))


@pytest.fixture(scope="session")
def smol_hf():
    from eaglekv.bench.e2e import load_hf
    return load_hf("default", torch.float32, "cpu")


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF transformers greedy continuation (stops at EOS like eaglekv does)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def forward_chunks(engine, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `ids` through the engine's model as a prefill plus extends of the given sizes on
    the paged cache; returns the logits of every position (len(ids), V). Frees its KV."""
    from eaglekv.core import ForwardBatch
    assert sum(chunks) == len(ids)
    row = engine.req_to_token.alloc()
    pos, last, logits = 0, -1, []
    try:
        for n in chunks:
            slots = engine.allocator.alloc(n, pos, last)
            engine.req_to_token.req_to_token[row, pos:pos + n] = slots.int()
            batch = ForwardBatch.build([ids[pos:pos + n]], [pos], [row], slots)
            logits.append(engine.model.forward(batch, engine.backend).logits)
            pos, last = pos + n, int(slots[-1])
    finally:
        engine.allocator.free(engine.req_to_token.req_to_token[row, :pos])
        engine.req_to_token.free(row)
    return torch.cat(logits)
