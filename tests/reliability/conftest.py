"""Fixtures shared by the fault-injection modules."""

from __future__ import annotations

import pytest

from eaglekv.memory import KVPool


@pytest.fixture(scope="module")
def canaries():
    """Every KV pool built in the module carries 4 canary rows around its valid rows."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVPool, "canary_rows", 4)
        yield
