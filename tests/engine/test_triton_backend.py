"""The Triton attention backend inside the engine (target and draft), run by the Triton
interpreter on CPU (on the GPU when there is one): the same greedy tokens as the PyTorch
backend for plain decoding (prefill extend, decode) and for EAGLE chains and trees (draft
decode over the draft kv-indices, tree verify, window draft extend), and the books balanced."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel modules are imported
pytest.importorskip("triton")

from eaglekv import SamplingParams  # noqa: E402
from helpers import spec, tiny_engine  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
SP = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42], list(range(1, 12)), [9] * 7]


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in tiny_engine(tiny_dir, max_running_requests=4).generate(
        PROMPTS, SP)]


@pytest.mark.parametrize("case", ["plain-ps1", "plain-ps4", "chain-window", "tree-window",
                                  "tree-after-sync"])
def test_triton_backend_equals_torch(tiny_dir, reference, case):
    kind, rest = case.split("-", 1)
    opts = dict(device=DEV, max_running_requests=4, attention_backend="triton",
                page_size=4 if rest == "ps4" or kind == "tree" else 1)
    if kind != "plain":
        S, K, N = (3, 1, 4) if kind == "chain" else (3, 2, 5)
        opts["speculative"] = spec("eagle", S, K, N)
    engine = tiny_engine(tiny_dir, **opts)
    if kind != "plain":
        engine.runner.window_extend = rest == "window"
        assert type(engine.runner.drafter.backend).__name__ == "TritonAttentionBackend"
    assert type(engine.backend).__name__ == "TritonAttentionBackend"
    assert [o.token_ids for o in engine.generate(PROMPTS, SP)] == reference
    engine.check_memory()
    assert engine.allocator.is_full()
