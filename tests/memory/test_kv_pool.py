"""The CPU KV pool is zeros, like torch.zeros, yet commits memory only where K/V rows are
written (an anonymous memory map; issue 17: a short `generate` paid 180 MiB for its pool)."""

from __future__ import annotations

import os

import pytest
import torch

from eaglekv.memory import KVPool


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_cpu_pool_is_zero_and_commits_only_written_pages():
    before = rss_mib()
    pool = KVPool(65536, 16, 8, 4, 64)           # 2 x 8 layers x 65552 x 4 x 64 fp32: 256 MiB
    assert pool.kv.numel() * 4 == 2 * 8 * 65552 * 4 * 64 * 4
    assert rss_mib() - before < 16               # nothing committed yet
    k = torch.randn(32, 4, 64)
    for layer in range(8):                       # a 32-token request in every layer
        pool.set_kv_buffer(layer, torch.arange(16, 48), k, k)
    grown = rss_mib() - before
    assert grown < 16
    assert torch.equal(pool.k_buffer[3][16:48], k) and torch.equal(pool.v_buffer[7][16:48], k)
    assert not pool.kv[:, :, 48:].any() and not pool.kv[:, :, :16].any()   # zeros elsewhere
    pool.kv[0].fill_(1.0)                        # touching the K half commits it: 128 MiB
    assert rss_mib() - before > 100
