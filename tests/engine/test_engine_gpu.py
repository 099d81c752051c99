"""On the GPU: the engine matches its CPU run, and a bad slot fails only its batch."""

from __future__ import annotations

import pytest
import torch

from eaglekv import KVIndexError, SamplingParams
from helpers import tiny_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_greedy_equals_cpu(tiny_dir):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 42], list(range(1, 30))]
    cpu = [o.token_ids for o in tiny_engine(tiny_dir).generate(prompts, sp)]
    gpu_engine = tiny_engine(tiny_dir, device="cuda")
    assert [o.token_ids for o in gpu_engine.generate(prompts, sp)] == cpu
    gpu_engine.check_memory()


def test_gpu_bad_slot_fails_batch_then_serves(tiny_dir, monkeypatch):
    engine = tiny_engine(tiny_dir, device="cuda", max_total_tokens=256)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = engine.generate([[5, 17, 42]], sp)[0].token_ids
    real_alloc = engine.allocator.alloc
    calls = {"n": 0}

    def bad_alloc(n, seq_len=0, last_slot=-1):
        s = real_alloc(n, seq_len, last_slot)
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step of the request gets a garbage slot
            engine.allocator.free(s)
            return torch.full_like(s, 10**6)
        return s
    monkeypatch.setattr(engine.allocator, "alloc", bad_alloc)
    with pytest.raises(KVIndexError, match=r"slot 1000000 out of range \[0, 257\)"):
        engine.generate([[1, 2, 3, 4]], sp)
    monkeypatch.setattr(engine.allocator, "alloc", real_alloc)
    assert engine.allocator.is_full()
    assert engine.generate([[5, 17, 42]], sp)[0].token_ids == ref
    engine.check_memory()
