"""The CPU matmul libraries (model/cpu_blas.py): each equals `x @ w` over shapes, the
oneDNN copy of a weight follows in-place changes, weights under autograd are left to torch."""

import pytest
import torch

from eaglekv.model import cpu_blas
from eaglekv.model.llama import linear

MODES = [m for m in cpu_blas.MODES if m != "onednn" or cpu_blas.onednn_available()]


@pytest.fixture
def blas_mode():
    old = cpu_blas.set_mode("numpy")
    cpu_blas.set_mode(old)

    def use(name):
        cpu_blas.set_mode(name)
    yield use
    cpu_blas.set_mode(old)


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
    got = linear(x, w_t, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_a_strided_input_is_multiplied_as_its_values(blas_mode):
    blas_mode("onednn")
    g = torch.Generator().manual_seed(1)
    big = torch.randn(6, 2 * 64, generator=g)
    x = big[:, ::2]                           # not contiguous
    w_t = torch.randn(64, 32, generator=g)
    torch.testing.assert_close(linear(x, w_t), x @ w_t, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_the_packed_copy_follows_a_weight_changed_in_place(blas_mode):
    blas_mode("onednn")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, generator=g)
    w_t = torch.randn(32, 48, generator=g)
    first = linear(x, w_t)
    packed = w_t._eaglekv_packed[1]
    assert linear(x, w_t) is not None and w_t._eaglekv_packed[1] is packed   # kept
    w_t.mul_(2.0)                             # e.g. a test scripting a draft's weights
    torch.testing.assert_close(linear(x, w_t), 2 * first, rtol=1e-5, atol=1e-5)
    assert w_t._eaglekv_packed[1] is not packed


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="this torch has no oneDNN")
def test_one_row_and_long_chunks_go_to_openblas_and_the_rest_to_the_packed_weight(blas_mode):
    blas_mode("onednn")
    w_t = torch.randn(32, 48)
    for rows in (1, cpu_blas.ONEDNN_MAX_ROWS + 1, 64):
        linear(torch.randn(rows, 32), w_t)
        assert not hasattr(w_t, "_eaglekv_packed")      # OpenBLAS, nothing packed
    linear(torch.randn(cpu_blas.ONEDNN_MIN_ROWS, 32), w_t)
    assert hasattr(w_t, "_eaglekv_packed")


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_under_autograd_gets_its_gradient(blas_mode, mode):
    blas_mode(mode)
    w_t = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(5, 16)
    linear(x, w_t).sum().backward()
    torch.testing.assert_close(w_t.grad, x.sum(0)[:, None].expand(16, 8), rtol=1e-5, atol=1e-5)
    assert not hasattr(w_t, "_eaglekv_packed")


def test_an_unknown_library_is_refused_by_name():
    with pytest.raises(ValueError, match="'mkl'.*onednn"):
        cpu_blas.set_mode("mkl")
