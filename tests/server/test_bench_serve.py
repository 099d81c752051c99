"""`eaglekv bench-serve` end to end on SmolLM2 (its own module: the engine may be driven by
one EngineLoop at a time, and test_server.py's lives until that module ends)."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow


def test_bench_serve_rows(smol_engine, monkeypatch):
    """`eaglekv bench-serve` on two prompts: every row present, answers identical."""
    from eaglekv.bench import serve
    monkeypatch.setattr(serve, "PROMPTS", serve.PROMPTS[:2])
    rows = serve.bench_engine(smol_engine, "plain", [2], max_tokens=4)
    assert [r["mode"].split(",")[0] for r in rows] == ["direct Engine.chat"] * 2 + ["server"]
    assert all(r["output_tokens"] == 8 for r in rows)
    assert rows[-1]["identical_to_direct"] and rows[-1]["ttft_s_p50"] > 0
    smol_engine.check_memory()
