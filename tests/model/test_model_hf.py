"""The model equals HF transformers: logits of tiny random Llama-family checkpoints and of
SmolLM2 in fp32, over prefill and incremental extends on the paged cache."""

from __future__ import annotations

import pytest
import torch

from helpers import forward_chunks, make_tiny, tiny_engine

ARCHS = {
    "llama": ("llama", {}),
    "llama_tied_gqa1": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama3_rope": ("llama", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "linear_rope": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qknorm": ("qwen3", dict(head_dim=32)),
}


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_logits_match_hf(tmp_path, name, page_size):
    """Prefill + extends of 1 and 3 tokens give HF's full-sequence logits (fp32, 1e-4)."""
    model_type, overrides = ARCHS[name]
    hf = make_tiny(tmp_path, model_type, **overrides)
    engine = tiny_engine(tmp_path, page_size=page_size)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = forward_chunks(engine, ids, [17, 1, 3, 1, 1])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    engine.check_memory()
    assert engine.allocator.is_full()


@pytest.mark.slow
def test_smollm2_logits_match_hf(smol_engine, smol_hf):
    """SmolLM2-135M (Q4_1 GGUF, dequantized to fp32): logits within 1e-3 of HF's."""
    ids = smol_engine.encode("The quick brown fox jumps over the lazy dog. " * 3)
    with torch.inference_mode():
        ref = smol_hf(torch.tensor([ids])).logits[0]
    ours = forward_chunks(smol_engine, ids, [len(ids) - 4, 1, 2, 1])
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
