"""Triton store_cache equals the PyTorch reference; out-of-range slots write nothing and
raise KVIndexError. Runs on the GPU when there is one, else under TRITON_INTERPRET=1 (small
shapes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel module are imported
triton = pytest.importorskip("triton")

from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.kernels.guard import kv_guard  # noqa: E402
from eaglekv.kernels.store_cache import store_cache, store_cache_torch  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
ROWS = [(3, 64), (8, 128), (1, 576), (5, 7), (2, 1024)] + ([(8, 4096 // 2)] if ON_GPU else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


def caches(slots, heads, dim, dtype):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(slots, heads, dim, generator=g).to(dtype).to(DEV)
    return kc, (kc + 1).clone()


@pytest.mark.parametrize("heads,dim", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_matches_reference(heads, dim, dtype, idx_dtype, layout):
    n, slots = 6, 40
    big = torch.randn(n, heads, 2 * dim).to(dtype).to(DEV)
    k = big[..., :dim] if layout == "strided" else big[..., :dim].contiguous()
    v = big[..., dim:] if layout == "strided" else big[..., dim:].contiguous()
    idx = torch.tensor([7, 1, 39, 20, 0, 38], dtype=idx_dtype, device=DEV)
    kc, vc = caches(slots, heads, dim, dtype)
    rk, rv = kc.clone().cpu(), vc.clone().cpu()
    store_cache(k, v, kc, vc, idx)
    store_cache_torch(k.cpu(), v.cpu(), rk, rv, idx.cpu())
    assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_explicit_splits(split):
    kc, vc = caches(16, 4, 64, torch.float16)
    k = torch.randn(3, 4, 64, dtype=torch.float16, device=DEV)
    idx = torch.tensor([3, 9, 15], device=DEV)
    rk, rv = kc.clone().cpu(), vc.clone().cpu()
    store_cache(k, k * 2, kc, vc, idx, num_split=split)
    store_cache_torch(k.cpu(), (k * 2).cpu(), rk, rv, idx.cpu())
    assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)


@pytest.mark.parametrize("bad,limit", [(-1, 32), (32, 32), (2**40, 32), (30, 30), (31, 30)])
def test_out_of_range_writes_nothing_and_raises(bad, limit):
    """Canary rows on both sides and every valid row stay bit-identical; the error names the
    first bad index, the limit and the count."""
    slots = 32
    kc, vc = caches(slots, 2, 64, torch.float32)
    before_k, before_v = kc.clone(), vc.clone()
    idx = torch.tensor([5, bad, 6, bad], dtype=torch.int64, device=DEV)
    k = torch.full((4, 2, 64), 9.0, device=DEV)
    with pytest.raises(KVIndexError, match=rf"slot {bad} out of range \[0, {limit}\) in "
                                           rf"store_cache \(2 of 4 indices bad\)"):
        store_cache(k, k, kc, vc, idx, size_limit=limit)
    changed = (kc != before_k).any(-1).any(-1).nonzero().view(-1).tolist()
    assert changed == [5, 6]       # the good rows were written, nothing else
    assert torch.equal(vc[7:], before_v[7:]) and torch.equal(vc[:5], before_v[:5])


def test_deferred_error_names_layer_and_clears():
    """Inside a guard step the error waits for raise_if_error(); the buffer is reset after."""
    kc, vc = caches(16, 1, 32, torch.float32)
    guard = kv_guard(DEV)
    k = torch.ones(2, 1, 32, device=DEV)
    with guard.step():
        store_cache(k, k, kc, vc, torch.tensor([1, 2], device=DEV), layer=0)
        store_cache(k, k, kc, vc, torch.tensor([3, 99], device=DEV), layer=4)
        store_cache(k, k, kc, vc, torch.tensor([-5, 4], device=DEV), layer=5)
    with pytest.raises(KVIndexError, match=r"slot 99 out of range \[0, 16\) in store_cache "
                                           r"\(layer 4, 1 of 2 indices bad; 2 bad in this step\)"):
        guard.raise_if_error()
    guard.raise_if_error()  # nothing left
    assert torch.equal(kc[3], torch.ones(1, 32, device=DEV))


def test_unchecked_variant_matches_when_in_range():
    kc, vc = caches(16, 2, 64, torch.bfloat16)
    rk, rv = kc.clone(), vc.clone()
    k = torch.randn(4, 2, 64, device=DEV).to(torch.bfloat16)
    idx = torch.tensor([0, 5, 10, 15], device=DEV, dtype=torch.int32)
    store_cache(k, k, kc, vc, idx, checked=False)
    store_cache(k, k, rk, rv, idx)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


def test_first_bad_index_across_token_blocks():
    """Many tokens (several programs): the reported index is the earliest bad position's."""
    slots, n = 64, 37
    kc, vc = caches(slots, 1, 64, torch.float16)
    before = kc.clone()
    idx = torch.arange(n, device=DEV)
    idx[33], idx[20], idx[35] = -7, 500, 64
    k = torch.randn(n, 1, 64, device=DEV).to(torch.float16)
    with pytest.raises(KVIndexError, match=r"slot 500 out of range \[0, 64\) in store_cache "
                                           r"\(3 of 37 indices bad\)"):
        store_cache(k, k, kc, vc, idx)
    good = [i for i in range(n) if i not in (20, 33, 35)]
    assert torch.equal(kc[good], k[good]) and torch.equal(kc[n:], before[n:])
    assert torch.equal(kc[20], before[20]) and torch.equal(kc[33], before[33])


# The cached launch (`store_cache_triton_fast`): on the GPU the second call of a signature goes
# straight to the launcher; these tests make each of its inputs vary. On CPU (interpreter)
# nothing is cached and the same tests run the full path.

def reference_store(k, v, kc, vc, idx, **kw):
    rk, rv = kc.clone().cpu(), vc.clone().cpu()
    store_cache_torch(k.cpu(), v.cpu(), rk, rv, idx.cpu(), **kw)
    return rk, rv


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_repeated_calls_hit_the_cached_launch_and_match(idx_dtype):
    from eaglekv.kernels import store_cache_triton as st
    kc, vc = caches(64, 3, 64, torch.bfloat16)
    for step in range(4):                 # same shapes, new data and new slots every call
        g = torch.Generator().manual_seed(step)
        k = torch.randn(5, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
        v = torch.randn(5, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
        idx = torch.randperm(64, generator=g)[:5].to(idx_dtype).to(DEV)
        rk, rv = reference_store(k, v, kc, vc, idx)
        store_cache(k, v, kc, vc, idx, size_limit=60 if step % 2 else 0)
        assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)
    cached = [x for x in st._LAUNCHES.values() if x is not None]
    assert bool(cached) == ON_GPU         # the GPU path really took the cached launch


def test_cached_launch_still_guards_every_call():
    """A signature launched once with good slots, then with bad ones: still masked, still
    raised, and the error names this call's index and layer."""
    kc, vc = caches(32, 2, 64, torch.float32)
    k = torch.full((3, 2, 64), 4.0, device=DEV)
    for _ in range(2):
        store_cache(k, k, kc, vc, torch.tensor([1, 2, 3], device=DEV), layer=2)
    before = kc.clone()
    with pytest.raises(KVIndexError, match=r"slot 32 out of range \[0, 32\) in store_cache "
                                           r"\(layer 7, 1 of 3 indices bad\)"):
        store_cache(k * 2, k * 2, kc, vc, torch.tensor([4, 32, 5], device=DEV), layer=7)
    changed = (kc != before).any(-1).any(-1).nonzero().view(-1).tolist()
    assert changed == [4, 5]
    guard = kv_guard(DEV)
    with guard.step():                    # deferred: the first bad call of the step wins
        store_cache(k, k, kc, vc, torch.tensor([6, 7, 8], device=DEV), layer=0)
        store_cache(k, k, kc, vc, torch.tensor([9, -1, 10], device=DEV), layer=1)
        store_cache(k, k, kc, vc, torch.tensor([99, 11, 12], device=DEV), layer=3)
    with pytest.raises(KVIndexError, match=r"slot -1 .* \(layer 1, 1 of 3 indices "
                                           r"bad; 2 bad in this step\)"):
        guard.raise_if_error()
    assert torch.equal(kc[6:13].cpu(), torch.full((7, 2, 64), 4.0))


def test_alignment_and_strides_change_the_signature():
    """Same shapes, but k starting one element off (not 16-byte aligned) or strided: each is
    its own launch and copies correctly."""
    kc, vc = caches(40, 1, 64, torch.float16)
    base = torch.randn(4 * 130 + 1, dtype=torch.float16, device=DEV)
    idx = torch.tensor([3, 17, 30, 39], device=DEV)
    aligned = base[:4 * 64].view(4, 1, 64)
    shifted = base[1:4 * 64 + 1].view(4, 1, 64)
    strided = base[:4 * 130].view(4, 130)[:, 2:66].reshape(4, 1, 64)   # row stride 130
    for k in (aligned, shifted, aligned, strided, shifted):
        rk, rv = reference_store(k, k, kc, vc, idx)
        store_cache(k, k, kc, vc, idx)
        assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)


def test_strided_indices():
    """A strided index tensor (every other slot) is read in its logical order."""
    kc, vc = caches(32, 2, 32, torch.float32)
    base = torch.tensor([1, 100, 5, 100, 9, 100, 31, 100], device=DEV)
    idx = base[::2]                                                       # (4,) stride 2
    k = torch.randn(4, 2, 32, device=DEV)
    for _ in range(2):
        rk, rv = reference_store(k, -k, kc, vc, idx)
        store_cache(k, -k, kc, vc, idx)
        assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)


def test_fast_launch_off_gives_the_same(monkeypatch):
    kc, vc = caches(24, 2, 64, torch.bfloat16)
    k = torch.randn(6, 2, 64, device=DEV).to(torch.bfloat16)
    idx = torch.tensor([0, 4, 8, 12, 16, 23], device=DEV)
    rk, rv = kc.clone(), vc.clone()
    store_cache(k, k, kc, vc, idx)
    store_cache(k, k, kc, vc, idx)
    from eaglekv.kernels.guard import FLAGS, reload_env_flags
    monkeypatch.setenv("EAGLEKV_TRITON_FAST_LAUNCH", "0")
    try:
        assert not reload_env_flags().fast_launch
        store_cache(k, k, rk, rv, idx)
    finally:
        monkeypatch.undo()
        reload_env_flags()
    assert FLAGS.fast_launch
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


_BAD_STORE = """
import torch
from eaglekv.kernels.store_cache import store_cache
kc = torch.zeros(8, 64, device="cuda")
k = torch.ones(2, 64, device="cuda")
store_cache(k, k, kc, kc.clone(), torch.tensor([1, 9], device="cuda"))
torch.cuda.synchronize()
print("NO ASSERT")
"""


@pytest.mark.skipif(not ON_GPU, reason="the interpreter ignores tl.device_assert")
@pytest.mark.parametrize("assert_on", [True, False])
def test_device_assert_switch(assert_on):
    """EAGLEKV_DEVICE_ASSERT=1: a bad slot is a hard device assert (the process's CUDA context
    dies, as with SGLang's guard); without it, the same store raises KVIndexError."""
    env = {**os.environ, "EAGLEKV_DEVICE_ASSERT": "1" if assert_on else "0"}
    r = subprocess.run([sys.executable, "-c", _BAD_STORE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "NO ASSERT" not in r.stdout
    if assert_on:
        assert "device-side assert" in r.stderr or "Assertion" in r.stderr, r.stderr[-2000:]
        assert "KVIndexError" not in r.stderr
    else:
        assert "KVIndexError: slot 9 out of range [0, 8)" in r.stderr, r.stderr[-2000:]


class _InterpretedLaunch:
    """Stands in for a CompiledKernel on CPU: its launcher runs the kernel under the Triton
    interpreter with exactly the arguments the cached launch passes."""

    function, packed_metadata = 0, None

    def __init__(self):
        self.launches = 0

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        from eaglekv.kernels.store_cache_triton import _store_cache_kernel
        assert (g2, launch_metadata, enter, exit_) == (1, None, None, None)
        self.launches += 1
        _store_cache_kernel[(g0, g1)](*args)


@pytest.fixture
def interpreted_fast_launch(monkeypatch):
    """On CPU, make the miss path hand back a launcher so that the hit path runs too."""
    if ON_GPU:
        pytest.skip("the GPU runs the real cached launch in the tests above")
    from eaglekv.kernels import store_cache_triton as st
    fake = _InterpretedLaunch()
    real = st.store_cache_triton

    def full_path(*args, **kwargs):
        real(*args, **kwargs)
        return fake

    monkeypatch.setattr(st, "store_cache_triton", full_path)
    monkeypatch.setattr(st, "_RAW_STREAM", lambda device: 0)
    monkeypatch.setattr(st, "_LAUNCHES", {})
    return st, fake


def test_cached_launch_on_cpu_matches_and_guards(interpreted_fast_launch):
    st, fake = interpreted_fast_launch
    kc, vc = caches(48, 3, 16, torch.float32)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        k, v = torch.randn(5, 3, 16, generator=g), torch.randn(5, 3, 16, generator=g)
        idx = torch.randperm(48, generator=g)[:5]
        rk, rv = reference_store(k, v, kc, vc, idx)
        store_cache(k, v, kc, vc, idx, layer=1)
        assert torch.equal(kc, rk) and torch.equal(vc, rv)
    assert fake.launches == 2 and len(st._LAUNCHES) == 1     # call 1 full path, 2 and 3 hits
    before = kc.clone()
    k = torch.full((5, 3, 16), 7.0)
    with pytest.raises(KVIndexError, match=r"slot 48 out of range \[0, 48\) in store_cache "
                                           r"\(layer 6, 2 of 5 indices bad\)"):
        store_cache(k, k, kc, vc, torch.tensor([0, 48, 2, -3, 4]), layer=6)
    assert fake.launches == 3                                 # the bad call was a hit too
    changed = (kc != before).any(-1).any(-1).nonzero().view(-1).tolist()
    assert changed == [0, 2, 4]


def test_cached_launch_signature_on_cpu(interpreted_fast_launch, monkeypatch):
    """A new alignment, a view that needs a copy, or an active launch hook never reuse a
    launch; the cache is bounded."""
    st, fake = interpreted_fast_launch
    kc, vc = caches(40, 1, 64, torch.float32)
    base = torch.randn(4 * 130 + 1)
    idx = torch.tensor([3, 17, 30, 39])
    aligned, shifted = base[:256].view(4, 1, 64), base[1:257].view(4, 1, 64)
    for k in (aligned, shifted, aligned, shifted):
        rk, rv = reference_store(k, k, kc, vc, idx)
        store_cache(k, k, kc, vc, idx)
        assert torch.equal(kc, rk) and torch.equal(vc, rv)
    assert fake.launches == 2                  # one hit each for aligned and shifted
    kc2, vc2 = caches(40, 2, 32, torch.float32)
    copied = base[:520].view(4, 130)[:, :128].reshape(4, 2, 64)[:, :, :32]  # (4, 2, 32)
    for _ in range(2):                         # heads 64 apart, 32 wide: (4, 64) needs a copy
        rk, rv = reference_store(copied, copied, kc2, vc2, idx)
        store_cache(copied, copied, kc2, vc2, idx)
        assert torch.equal(kc2, rk) and torch.equal(vc2, rv)
    assert fake.launches == 2 and sum(x is not None for x in st._LAUNCHES.values()) == 2
    hook = type("Hook", (), {"calls": [print]})()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    store_cache(aligned, aligned, kc, vc, idx)
    assert fake.launches == 2                  # a profiler hook: the full path
    monkeypatch.setattr(st, "_MAX_LAUNCHES", 3)
    for n in (1, 2, 3):
        store_cache(aligned[:n], aligned[:n], kc, vc, idx[:n])
    assert len(st._LAUNCHES) <= 3
