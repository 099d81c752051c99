"""The CPU matmul libraries (model/cpu_blas.py): each equals `x @ w` over shapes, the
oneDNN copy of a weight follows in-place changes, weights under autograd are left to torch."""

import pytest
import torch

from eaglekv.model import cpu_blas
from eaglekv.model.llama import linear

MODES = [m for m in cpu_blas.MODES
         if m not in ("onednn", "onednn1") or cpu_blas.onednn_available()]


@pytest.fixture
def blas_mode():
    old = cpu_blas.set_mode("numpy")
    cpu_blas.set_mode(old)
    threads = torch.get_num_threads()

    def use(name):
        cpu_blas.set_mode(name)
    yield use
    cpu_blas.set_mode(old)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 16, 17, 33])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 960), (1536, 576), (96, 4097)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_library_equals_the_reference_matmul(blas_mode, mode, rows, k, n, bias):
    blas_mode(mode)
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k, generator=g)
    w_t = torch.randn(k, n, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    want = x.double() @ w_t.double() + (0 if b is None else b.double())
    cpu_blas.prepack([w_t])                   # onednn: reordered now, not at its 16th call
    got = linear(x, w_t, b)
    assert hasattr(w_t, "_eaglekv_packed") == (mode in ("onednn", "onednn1"))
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_a_strided_input_is_multiplied_as_its_values(blas_mode):
    blas_mode("onednn")
    g = torch.Generator().manual_seed(1)
    big = torch.randn(6, 2 * 64, generator=g)
    x = big[:, ::2]                           # not contiguous
    w_t = torch.randn(64, 32, generator=g)
    cpu_blas.prepack([w_t])
    torch.testing.assert_close(linear(x, w_t), x @ w_t, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_the_packed_copy_follows_a_weight_changed_in_place(blas_mode):
    blas_mode("onednn")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, generator=g)
    w_t = torch.randn(32, 48, generator=g)
    cpu_blas.prepack([w_t])
    first = linear(x, w_t)
    packed = w_t._eaglekv_packed[1]
    assert linear(x, w_t) is not None and w_t._eaglekv_packed[1] is packed   # kept
    w_t.mul_(2.0)                             # e.g. a test scripting a draft's weights
    torch.testing.assert_close(linear(x, w_t), 2 * first, rtol=1e-5, atol=1e-5)
    assert w_t._eaglekv_packed[1] is not packed


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_a_weight_is_reordered_at_its_pack_after_th_call_of_2_to_16_rows(blas_mode):
    """Ski rental: OpenBLAS until the weight's PACK_AFTER-th call of 2-16 rows, then oneDNN;
    one row and long chunks never count (OpenBLAS takes them)."""
    blas_mode("onednn")
    w_t = torch.randn(32, 48)
    for rows in (1, cpu_blas.ONEDNN_MAX_ROWS + 1, 64):
        linear(torch.randn(rows, 32), w_t)
    assert not hasattr(w_t, "_eaglekv_calls")
    for i in range(1, cpu_blas.PACK_AFTER + 1):
        x = torch.randn(cpu_blas.ONEDNN_MIN_ROWS + i % 3, 32)
        torch.testing.assert_close(linear(x, w_t), x @ w_t, rtol=1e-5, atol=1e-5)
        assert hasattr(w_t, "_eaglekv_packed") == (i == cpu_blas.PACK_AFTER)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_prepack_reorders_each_cpu_fp32_weight_once(blas_mode):
    blas_mode("onednn")
    a, b = torch.randn(16, 8), torch.randn(8, 4)
    skipped = [torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, requires_grad=True),
               torch.randn(16)]
    assert cpu_blas.prepack([a, b, a, *skipped]) == (16 * 8 + 8 * 4) * 4
    assert hasattr(a, "_eaglekv_packed") and hasattr(b, "_eaglekv_packed")
    assert not any(hasattr(w, "_eaglekv_packed") for w in skipped)
    blas_mode("numpy")
    assert cpu_blas.prepack([torch.randn(4, 4)]) == 0


def test_a_speculative_cpu_engine_prepacks_its_target_and_draft_weights(tiny_dir):
    """Every linear weight of the target and the draft is reordered while the engine is
    built (so its first verify costs what the later ones do), and generation is unchanged."""
    from eaglekv.model.llama import linear_weights
    from helpers import spec, tiny_engine
    if not cpu_blas.packs():
        pytest.skip("oneDNN is not the library in use")
    e = tiny_engine(tiny_dir, speculative=spec("eagle", 3, 1, 4))
    weights = linear_weights(e.model) + linear_weights(e.runner.drafter.model)
    assert len(weights) >= 4 * e.model_config.num_layers + 1 + 2
    assert all(hasattr(w, "_eaglekv_packed") for w in weights)
    assert "weights prepacked" in e.load_times


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_under_autograd_gets_its_gradient(blas_mode, mode):
    blas_mode(mode)
    w_t = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(5, 16)
    linear(x, w_t).sum().backward()
    torch.testing.assert_close(w_t.grad, x.sum(0)[:, None].expand(16, 8), rtol=1e-5, atol=1e-5)
    assert not hasattr(w_t, "_eaglekv_packed")


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("mode,sleeps,wide", [("onednn", True, 2), ("onednn", False, 1),
                                              ("onednn1", True, 1)])
def test_onednn_calls_take_every_core_only_where_openblas_sleeps(blas_mode, monkeypatch,
                                                                 mode, sleeps, wide):
    """Each 2-16-row call runs on all of torch's threads and puts the count back (every
    other op, and one row on OpenBLAS, keep the caller's one thread); where OpenBLAS's
    threads spin after a call (numpy loaded before eaglekv set OPENBLAS_THREAD_TIMEOUT), and
    in `onednn1`, one thread throughout."""
    blas_mode(mode)
    monkeypatch.setattr(cpu_blas, "openblas_sleeps", lambda: sleeps)
    monkeypatch.setattr(cpu_blas, "_ALL_THREADS", 2)
    w_t = torch.randn(32, 48)
    cpu_blas.prepack([w_t])
    torch.set_num_threads(1)
    seen, real = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    for rows in (4, 1, 16, 17, 2):
        seen.clear()
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x, w_t), x @ w_t, rtol=1e-5, atol=1e-5)
        dnn = 2 <= rows <= 16
        assert seen == ([2, 1] if dnn and wide == 2 else []), rows
        assert torch.get_num_threads() == 1
    assert cpu_blas.describe() == f"{mode} {wide}t"


@pytest.mark.parametrize("first,env,want_value,want_sleeps", [
    ("", {}, "4", True),                        # eaglekv before numpy: set, applies
    ("import numpy; ", {}, None, False),        # numpy first: OpenBLAS spins, one thread
    ("", {"OPENBLAS_THREAD_TIMEOUT": "28"}, "28", False),     # the user's value is kept
    ("import numpy; ", {"OPENBLAS_THREAD_TIMEOUT": "4"}, "4", True)])
def test_import_eaglekv_makes_openblas_threads_sleep_unless_numpy_came_first(
        first, env, want_value, want_sleeps):
    import os
    import subprocess
    import sys
    code = (first + "import os, eaglekv; from eaglekv.model import cpu_blas; "
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), cpu_blas.openblas_sleeps())")
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == [str(want_value), str(want_sleeps)]


def test_an_unknown_library_is_refused_by_name():
    with pytest.raises(ValueError, match="'mkl'.*onednn"):
        cpu_blas.set_mode("mkl")
