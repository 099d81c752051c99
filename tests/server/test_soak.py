"""A short soak (issue 16; the long one is bench/soak_cpu.py): SmolLM2 over real HTTP under 4
openai clients for 15 s, each client's second request poisoned with one of the four kinds
(bad sampling values, a huge body, two hang-ups) and a tenth of the others at random: every
other request is answered, every poisoned one as it should be, and then the engine is idle
with its books balanced and every KV slot free."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from eaglekv.server.local import LocalServer  # noqa: E402
from eaglekv.testing.soak import run_load  # noqa: E402

pytestmark = pytest.mark.slow


def test_short_soak(smol_engine):
    server = LocalServer(smol_engine, "smollm2", default_max_tokens=16)
    try:
        res = run_load(server.url, "smollm2", duration_s=15, concurrency=4, poison_rate=0.1,
                       seed=1)
        server.wait_idle(120)            # idle, then Engine.check_memory
        assert server.on_engine(lambda e: e.allocator.is_full())
    finally:
        server.stop()
    assert res["failed"] == 0, res["failures"]
    assert not res["poison_unexpected"], res["poison_unexpected"]
    assert res["answered_ok"] >= 4 and all(res["poisoned"].values()), res
