"""The attention kernels compiled for the H200 (sm_90) without a GPU (Triton's NVIDIA backend
runs on the CPU): the checked decode and short-extend kernels are built as the unchecked ones
are, without software pipelining of the key loop (no async copies). On the H200 the pipelined
checked kernels ran 1.2-1.6x the unpipelined unchecked ones (2026-12-04), most of what the
index checks cost a speculative step; this keeps the two from drifting apart again."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:                                   # pragma: no cover
    pytest.skip("no Triton compiler API", allow_module_level=True)

from eaglekv.kernels import attention_triton as at  # noqa: E402

PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
        "table_ptr": "*i32", "err_ptr": "*i64", "mask_ptr": "*u8", "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int):
    sig = {n: PTRS.get(n, "*i64") if n.endswith("_ptr") else
           ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    sig.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                         for k, v in constexprs.items()})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:                            # pragma: no cover
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")


def async_copies(kernel) -> int:
    return kernel.asm["ttgir"].count("async_copy")


@pytest.mark.parametrize("check", [0, 1])
def test_decode_key_loop_is_not_pipelined(check):
    k = compile_sm90(at._decode_kernel, dict(H=9, G=3, GP=16, D=64, DP=64, BLOCK_N=64,
                                             SPLITS=4, F32DOT=False, CHECK=check),
                     num_warps=4, num_stages=at.DECODE_STAGES)
    assert async_copies(k) == 0


@pytest.mark.parametrize("check", [0, 1])
def test_short_extend_key_loop_is_not_pipelined(check):
    stages = 1 if 8 <= at.SHORT_EXTEND else at.DEFAULT_STAGES     # a verify window of 8
    k = compile_sm90(at._extend_kernel, dict(G=3, GP=4, D=64, DP=64, BLOCK_M=16, BLOCK_N=64,
                                             CUSTOM=True, F32DOT=False, CHECK=check),
                     num_warps=4, num_stages=stages)
    assert async_copies(k) == 0


def test_the_checked_kernel_would_be_pipelined_by_default():
    """What the test above guards against: with Triton's default stages the checked extend's
    loop is pipelined (so the check above can fail)."""
    k = compile_sm90(at._extend_kernel, dict(G=3, GP=4, D=64, DP=64, BLOCK_M=16, BLOCK_N=64,
                                             CUSTOM=True, F32DOT=False, CHECK=1),
                     num_warps=4, num_stages=at.DEFAULT_STAGES)
    assert async_copies(k) > 0
