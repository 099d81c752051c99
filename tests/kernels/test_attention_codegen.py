"""The attention kernels compiled for the H200 (sm_90) without a GPU (Triton's NVIDIA backend
runs on the CPU): the checked decode and short-extend kernels are built as the unchecked ones
are, without software pipelining of the key loop (no async copies). On the H200 the pipelined
checked kernels ran 1.2-1.6x the unpipelined unchecked ones (2026-12-04), most of what the
index checks cost a speculative step; this keeps the two from drifting apart again.

The compiles run in a fresh process: other test modules switch this one's kernels to the
Triton interpreter (TRITON_INTERPRET=1 at import), which cannot compile for a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# found, not imported: triton imported here, before a later module sets TRITON_INTERPRET=1 for
# its own import, leaves that module's kernels uncallable when tests/kernels runs alone
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from eaglekv.kernels import attention_triton as at

PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
        "table_ptr": "*i32", "err_ptr": "*i64", "mask_ptr": "*u8", "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32", "ticket_ptr": "*i32"}

def copies(fn, constexprs, num_stages):
    sig = {n: PTRS.get(n, "*i64") if n.endswith("_ptr") else
           ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    sig.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                         for k, v in constexprs.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": num_stages})
    return k.asm["ttgir"].count("async_copy")

DEC = dict(H=9, G=3, GP=16, D=64, DP=64, BLOCK_N=64, SPLITS=4, SP=4, FUSED_MERGE=False,
           F32DOT=False, USE_GDC=False, MIN_CHUNK=0, PREFETCH=False)
EXT = dict(H=9, G=3, GP=4, D=64, DP=64, BLOCK_M=16, BLOCK_N=64, CUSTOM=True, F32DOT=False)
short = 8 <= at.SHORT_EXTEND                                     # a verify window of 8
out = {f"decode{c}": copies(at._decode_kernel, dict(DEC, CHECK=c), at.key_loop_stages(c, True))
       for c in (0, 1)}
out |= {f"extend{c}": copies(at._extend_kernel, dict(EXT, CHECK=c),
                             at.key_loop_stages(c, short)) for c in (0, 1)}
out["stages"] = {f"{k}{c}": at.key_loop_stages(c, k == "decode" or short)
                 for k in ("decode", "extend") for c in (0, 1)}
out["extend1_default"] = copies(at._extend_kernel, dict(EXT, CHECK=1), at.DEFAULT_STAGES)
fn = at._decode_kernel
cx = dict(DEC, FUSED_MERGE=True, CHECK=0)
sig = {n: PTRS.get(n, "*i64") if n.endswith("_ptr") else
       ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
sig.update({k: "constexpr" for k in cx})
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
out["decode_fused_ticket"] = "atom.global.gpu.acq_rel.add" in ptx
out["decode_fused_reads_l2"] = "ld.global.cg" in ptx
out["extend_merge"] = copies(at._extend_merge_kernel, dict(H=9, D=64, DP=64, SP=8),
                            1)
from eaglekv.kernels import table_guard_triton as tg
fn = tg._guard_rows_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(table_ptr="*i32", rows_ptr="*i32", start_ptr="*i64", pre_ptr="*i64",
           ext_ptr="*i64", start_out="*i64", pre_out="*i64", ext_out="*i64",
           keys_out="*i64", err_ptr="*i64")
for has_pre in (False, True):
    cx = dict(HAS_PRE=has_pre, BLOCK=tg.BLOCK, SPLIT=tg.MAX_SPLIT)
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out[f"table_guard{int(has_pre)}_ptx"] = len(k.asm["ptx"])
from eaglekv.kernels import greedy_triton as gt
fn = gt._greedy_pick_kernel
src = ASTSource(fn, {"x_ptr": "*bf16", "out_ptr": "*i64", "V": "i32", "s0": "i32",
                     "BLOCK": "constexpr"}, constexprs={(fn.arg_names.index("BLOCK"),): gt.BLOCK})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
out["greedy_pick_ptx"] = len(k.asm["ptx"])
fn = gt._greedy_part_kernel
cx = dict(P=24, BLOCK=gt.SPLIT_BLOCK)
sig = {"x_ptr": "*bf16", "pm_ptr": "*fp32", "pi_ptr": "*i32", "V": "i32", "s0": "i32",
       "chunk": "i32", **{c: "constexpr" for c in cx}}
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in cx.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
out["greedy_part_ptx"] = len(k.asm["ptx"])
fn = gt._greedy_reduce_kernel
cx = dict(P=24, PP=32)
sig = {"pm_ptr": "*fp32", "pi_ptr": "*i32", "out_ptr": "*i64", "V": "i32",
       **{c: "constexpr" for c in cx}}
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in cx.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
out["greedy_reduce_ptx"] = len(k.asm["ptx"])
from eaglekv.kernels import fused_triton as ft
fn = ft._rope_store_qkv_kernel
ptrs = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
        "loc_ptr": "*i64", "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
        "err_ptr": "*i64"}
for c in (0, 1):
    sig = {n: ptrs.get(n, "i32") for n in fn.arg_names}
    cx = dict(H=9, HKV=3, D=64, HB=16, PB=32, ASSERT=False, BY_HAND=False, CHECK=bool(c),
              USE_GDC=False)
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    first_load = ptx.find("ld.global.b16")
    first_branch = ptx.find(" bra")
    out[f"rope{c}_loads_before_branch"] = first_branch < 0 or 0 <= first_load < first_branch
# programmatic dependent launch (kernels/pdl.py): each kernel waits before reading anything an
# earlier kernel writes; the gemv kernel loads its first weight tile before that wait
def ptx_of(fn, ptrs, cx, **options):
    sig = {n: ptrs.get(n, "*i64") if n.endswith("_ptr") else
           ("fp32" if n in ("qk_scale", "eps") else "i32") for n in fn.arg_names}
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, **options})
    return k.asm["ptx"], k.metadata

def gdc(ptx):
    wait, first_ld = ptx.find("griddepcontrol.wait"), ptx.find("ld.global")
    return {"wait": wait >= 0, "trigger": "griddepcontrol.launch_dependents" in ptx,
            "load_before_wait": 0 <= first_ld < wait}

gemv_ptrs = {n: "*bf16" for n in ("x_ptr", "r_ptr", "nw_ptr", "w_ptr", "out_ptr", "res_ptr")}
for norm, silu in ((True, False), (True, True), (False, False)):
    cx = dict(NORM=norm, HAS_RESIDUAL=norm, SILU=silu, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024,
              BY_HAND=False, USE_GDC=True, DOT=False, IEEE=False, ROW2=True)
    ptx, meta = ptx_of(ft._gemv_kernel, gemv_ptrs, cx, num_stages=2, launch_pdl=True)
    out[f"gemv_gdc_{int(norm)}{int(silu)}"] = gdc(ptx)
    out["launch_pdl_in_metadata"] = bool(getattr(meta, "launch_pdl", False))
# row groups (fused.GEMV_GROUP_MAX_ROWS: 5-8 rows in groups of the 4-row tile, GROUPS=True)
cx = dict(NORM=True, HAS_RESIDUAL=True, SILU=True, BLOCK_M=4, BLOCK_N=4, BLOCK_K=1024,
          BY_HAND=False, USE_GDC=True, DOT=False, IEEE=False, ROW2=False, GROUPS=True)
out["gemv_gdc_11g"] = gdc(ptx_of(ft._gemv_kernel, gemv_ptrs, cx, num_stages=2,
                                 launch_pdl=True)[0])
cx = dict(H=9, HKV=3, D=64, HB=16, PB=32, ASSERT=False, BY_HAND=False, CHECK=True, USE_GDC=True)
out["rope_gdc"] = gdc(ptx_of(ft._rope_store_qkv_kernel, ptrs, cx)[0])
for M in (1, 4, "4g"):  # the qkv gemv with the rope epilogue (fused.FUSE_GEMV_ROPE); 4g: groups
    cx = dict(H=9, HKV=3, D=64, HAS_RESIDUAL=True, BLOCK_M=4 if M == "4g" else M, BLOCK_N=4,
              BLOCK_K=1024, BY_HAND=False, CHECK=True, ASSERT=False, USE_GDC=True, DOT=False,
              IEEE=False, ROW2=True, GROUPS=M == "4g")
    out[f"gemv_rope_gdc_{M}"] = gdc(ptx_of(ft._gemv_rope_kernel, dict(
        gemv_ptrs, cos_ptr="*fp32", sin_ptr="*fp32", q_ptr="*bf16", kc_ptr="*bf16",
        vc_ptr="*bf16"), cx, num_stages=2, launch_pdl=True)[0])
for M in (1, 4, "4g"):  # the MLP in one launch (fused.FUSE_MLP): x the fp32 accumulator
    cx = dict(HAS_RESIDUAL=True, BLOCK_M=4 if M == "4g" else M, BLOCK_N=8 if M == 1 else 4,
              BLOCK_K=1024, ZBLOCK=16, BY_HAND=False, USE_GDC=True, IEEE=False, ATOMIC=True,
              DOWN=True, ROW2=True, GROUPS=M == "4g")
    ptx = ptx_of(ft._mlp_kernel, dict(gemv_ptrs, x_ptr="*fp32", wd_ptr="*bf16",
                                      acc_ptr="*fp32", zero_ptr="*fp32"), cx, num_stages=1,
                 launch_pdl=True)[0]
    wait = ptx.find("griddepcontrol.wait")
    out[f"mlp_gdc_{M}"] = gdc(ptx)
    out[f"mlp_loads_before_wait_{M}"] = ptx[:wait].count("ld.global")
    out[f"mlp_adds_{M}"] = ("red.global" in ptx or "atom.global" in ptx) and ".f32" in ptx
for merged in (True, False):     # the merge and the o projection in one launch (MERGE_O)
    cx = dict(H=9, D=64, DP=64, SPLITS=16, SP=16, MERGED=merged, NC=9, BLOCK_N=64, ZBLOCK=32,
              USE_GDC=True)
    ptx = ptx_of(ft._merge_o_kernel, dict(PTRS, w_ptr="*bf16", acc_ptr="*fp32",
                                          zero_ptr="*fp32",
                                          mid_o_ptr="*fp32" if merged else "*bf16"),
                 cx, launch_pdl=True)[0]
    out[f"merge_o_gdc_{int(merged)}"] = gdc(ptx)
    out[f"merge_o_adds_{int(merged)}"] = ("red.global" in ptx or "atom.global" in ptx)
out["decode_gdc"] = gdc(ptx_of(at._decode_kernel, PTRS, dict(DEC, CHECK=0, USE_GDC=True),
                               num_stages=3)[0])
out["decode_prefetch_gdc"] = gdc(ptx_of(at._decode_kernel, PTRS,
                                        dict(DEC, CHECK=0, USE_GDC=True, PREFETCH=True),
                                        num_stages=3)[0])
out["merge_gdc"] = gdc(ptx_of(at._merge_kernel, PTRS, dict(H=9, D=64, DP=64, SPLITS=16, SP=16,
                                                           USE_GDC=True))[0])
out["extend_gdc"] = gdc(ptx_of(at._extend_kernel, PTRS, dict(EXT, CHECK=1, USE_GDC=True),
                               num_stages=2)[0])
out["extend_merge_gdc"] = gdc(ptx_of(at._extend_merge_kernel, PTRS,
                                     dict(H=9, D=64, DP=64, SP=8, USE_GDC=True))[0])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def async_copies() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "EAGLEKV_TRITON_ON_CPU")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    if r.returncode != 0:
        if "GPUTarget" in r.stderr or "ptxas" in r.stderr or "ImportError" in r.stderr:
            pytest.skip(f"cannot compile for sm_90 here: {r.stderr[-300:]}")
        raise AssertionError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("has_pre", [0, 1])
def test_the_once_a_forward_check_compiles_for_sm90(async_copies, has_pre):
    """`table_guard_triton`'s kernel (decode and extend) compiles for the H200: the Triton
    interpreter the other tests run it under accepts code a GPU compile refuses."""
    assert async_copies[f"table_guard{has_pre}_ptx"] > 1000


def test_the_greedy_pick_compiles_for_sm90(async_copies):
    """One program a row, and the split row's partials and their reduce."""
    assert async_copies["greedy_pick_ptx"] > 1000
    assert async_copies["greedy_part_ptx"] > 1000 and async_copies["greedy_reduce_ptx"] > 500


@pytest.mark.parametrize("check", [0, 1])
def test_rope_store_issues_its_loads_before_any_branch(async_copies, check):
    """The checked RoPE + K/V store kernel records a bad position or slot after its stores:
    a branch on them ahead of the tile loads made every load wait for the index loads
    (1.33 us a launch against 1.14 unchecked on an H100, 2026-12-05)."""
    assert async_copies[f"rope{check}_loads_before_branch"]


def test_checked_decode_key_loop_is_not_pipelined(async_copies):
    assert async_copies["stages"]["decode1"] == 1 and async_copies["decode1"] == 0


def test_checked_short_extend_key_loop_is_not_pipelined(async_copies):
    assert async_copies["stages"]["extend1"] == 1 and async_copies["extend1"] == 0


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_unchecked_kernels_take_the_default_stages(async_copies, kind):
    """What the target's layers run since the once-a-forward check: on the H200 the unchecked
    kernels ran 2-12% faster at Triton's default stages than unpipelined (2026-12-05); they
    compile for sm_90 that way."""
    assert async_copies["stages"][f"{kind}0"] == 3 and async_copies[f"{kind}0"] >= 0


def test_the_checked_kernel_would_be_pipelined_by_default(async_copies):
    """What the tests above guard against: with Triton's default stages the checked extend's
    loop is pipelined (so they can fail)."""
    assert async_copies["extend1_default"] > 0


def test_the_split_extend_and_its_merge_compile_for_sm90(async_copies):
    """The verify's split-K (8 splits a kv head at batch 1, checked and unchecked) and its
    merge kernel (no key loop, nothing to pipeline) compile for the H200: a compile error
    fails the fixture."""
    assert async_copies["extend_merge"] == 0 and "extend0" in async_copies


def test_the_fused_decode_merge_takes_its_ticket_with_release_and_acquire(async_copies):
    """The split-K decode merged in its own launch: for sm_90 the ticket is a gpu-scope
    acq_rel atomic (the splits' partials are visible to the one that draws the last ticket)
    and the merge reads them from L2 (`ld.global.cg`), not from a stale L1."""
    assert async_copies["decode_fused_ticket"] and async_copies["decode_fused_reads_l2"]


@pytest.mark.parametrize("kernel", ["gemv_gdc_10", "gemv_gdc_11", "gemv_gdc_00",
                                    "gemv_rope_gdc_1", "gemv_rope_gdc_4", "gemv_gdc_11g",
                                    "gemv_rope_gdc_4g"])
def test_the_gemv_kernel_prefetches_its_weights_before_the_pdl_wait(async_copies, kernel):
    """Under PDL (kernels/pdl.py) the matrix-vector kernel (also with the RoPE + K/V store
    epilogue, 1 and 4 rows) loads its first weight tile (no kernel's output) before
    `griddepcontrol.wait`, reads the activations after it, and lets
    the next kernel launch; the launch option reaches the compiled kernel's metadata."""
    assert async_copies[kernel] == {"wait": True, "trigger": True, "load_before_wait": True}
    assert async_copies["launch_pdl_in_metadata"]


@pytest.mark.parametrize("kernel", ["rope_gdc", "decode_gdc", "merge_gdc", "extend_gdc",
                                    "extend_merge_gdc"])
def test_pdl_kernels_wait_before_their_first_load(async_copies, kernel):
    """RoPE + K/V store, decode attention and its merge, extend attention and its merge
    (attention_triton.EXTEND_PDL, off by default) read only what earlier kernels wrote: under
    PDL their first global load comes after `griddepcontrol.wait`."""
    assert async_copies[kernel] == {"wait": True, "trigger": True, "load_before_wait": False}


def test_decode_prefetch_loads_before_its_wait(async_copies):
    """With `DECODE_PREFETCH` (a one-token decode over the checked table copy) the decode
    kernel's first global loads (the lengths, the first tile's slots, the older keys' K/V)
    come before `griddepcontrol.wait`; it still waits and lets the next kernel launch."""
    assert async_copies["decode_prefetch_gdc"] == {"wait": True, "trigger": True,
                                                   "load_before_wait": True}


@pytest.mark.parametrize("rows", [1, 4, "4g"])     # 4g: 5-8 rows in row groups of 4
def test_the_fused_mlp_prefetches_its_weights_and_adds_atomically(async_copies, rows):
    """The MLP in one launch (`fused_triton._mlp_kernel`) compiles for sm_90: under PDL its
    three weight tiles (gate, up, down's rows) are loaded before `griddepcontrol.wait` (each
    thread's share of 3 x BLOCK_N x 1024 bf16: scalar b16 loads offline, where the launch's
    16-byte alignment is not specialised),
    it waits and lets the next kernel launch, and down's partials are fp32 atomic adds."""
    assert async_copies[f"mlp_gdc_{rows}"] == {"wait": True, "trigger": True,
                                               "load_before_wait": True}
    bn = 8 if rows == 1 else 4
    assert async_copies[f"mlp_loads_before_wait_{rows}"] >= 3 * bn * 1024 // 128
    assert async_copies[f"mlp_adds_{rows}"]


@pytest.mark.parametrize("merged", [1, 0])
def test_merge_and_o_projection_prefetch_o_and_add_atomically(async_copies, merged):
    """The decode's merge with the o projection in one launch (`fused_triton._merge_o_kernel`,
    from split-K partials or from an attention output) compiles for sm_90: its head's block
    of o is read before `griddepcontrol.wait`, it waits and lets the next kernel launch, and
    the products are atomic adds."""
    assert async_copies[f"merge_o_gdc_{merged}"] == {"wait": True, "trigger": True,
                                                     "load_before_wait": True}
    assert async_copies[f"merge_o_adds_{merged}"]
