"""`eaglekv bench --device cuda` (or `--table` on any device): every row of issue 13's and
issue 15's tables in one process.

For each mode (plain; EAGLE chains S1/S3/S5, the tree S4/K2/N8, and `adaptive`, all with the
shipped draft) and batch size (1, 4, 16, 64): total tokens/s of B greedy requests of
`new_tokens` each (EOS ignored; the engines are built first and the repeats alternate between
the modes, so drift hits every mode alike),
the accept length, the speculative runner's host time per phase (draft, verify, accept,
extend), and a profiler pass that counts device kernels and device time per step, with the
device's idle time by gap size and (speculative modes) the device time of each part of the
step (draft, verify, accept, extend); HF
transformers greedy at batch 1 beside them. `--llama8b` adds a Llama-3.1-8B-shaped model with
random bf16 weights built on the device: its decode step (replayed graph) against the
weight-streaming roofline at the measured copy bandwidth. JSON + PNG (tokens/s against batch
size, one line per mode) go to --out (a directory).
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import importlib
import io
import json
import os
import pstats
import runpy
import sys
import statistics
import time
import traceback

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from eaglekv.config import DEFAULT_SCHEDULER_STEPS, EngineConfig, SamplingParams, SpecConfig
from eaglekv.errors import ConfigError
from eaglekv.engine import Engine

PROMPT = "Write a short story about a robot who learns to paint."
MODES = {"plain": None,
         "plain_1step": None,     # num_scheduler_steps=1: one sync a token (before the chains)
         "plain_fused": None,     # graphs captured with the norm_matmul kernel (off by default)
         "eagle_chain_S1K1N2": dict(num_steps=1, topk=1, num_draft_tokens=2),
         "eagle_chain_S3K1N4": dict(num_steps=3, topk=1, num_draft_tokens=4),
         "eagle_chain_S5K1N6": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_tree_S4K2N8": dict(num_steps=4, topk=2, num_draft_tokens=8),
         # EAGLE-3 chains; S6 and S7 for the fifth head (held-out rate .27 at the fifth draft
         # position on the CPU, higher on the bench prompts)
         **{f"eagle3_chain_S{S}K1N{S + 1}": dict(algorithm="eagle3", num_steps=S, topk=1,
                                                num_draft_tokens=S + 1) for S in (5, 3, 6, 7)},
         "eagle3_tree_S4K2N8": dict(algorithm="eagle3", num_steps=4, topk=2,
                                    num_draft_tokens=8),
         # the wider trees: held-out accept 4.01 / 4.34 with the shipped EAGLE-3 head (CPU fp32)
         "eagle3_tree_S6K4N16": dict(algorithm="eagle3", num_steps=6, topk=4,
                                     num_draft_tokens=16),
         "eagle3_tree_S7K4N24": dict(algorithm="eagle3", num_steps=7, topk=4,
                                     num_draft_tokens=24),
         "adaptive": dict(adaptive=True),
         "adaptive_eagle3": dict(algorithm="eagle3", adaptive=True),   # the EAGLE-3 head
         # with the wide tree among its candidates: the best fixed shape at batch 4 on the
         # H200 (2026-12-05), which the device's default candidates do not have
         "adaptive_eagle3_trees": dict(algorithm="eagle3", adaptive=True,
                                       shapes=((3, 1, 4), (5, 1, 6), (4, 2, 8), (6, 4, 16))),
         # the CPU's candidates and the 7-step chain: the fifth EAGLE-3 head's S7 ran 2.55x
         # plain against S5's 2.33x on the bench prompts on the CPU (2026-12-06)
         "adaptive_eagle3_s7": dict(algorithm="eagle3", adaptive=True,
                                    shapes=((1, 1, 2), (3, 1, 4), (5, 1, 6), (7, 1, 8))),
         # the device's candidates and the 7-step chain: the fifth EAGLE-3 head's fixed S7 ran
         # 1.82x plain at batch 1 on an H100 where adaptive (S3, S5, S4K2N8) ran 1.60x
         # (2026-12-06, gpu_bench_h100_20261206_v5_chains.json)
         "adaptive_gpu_s7": dict(adaptive=True, shapes=((3, 1, 4), (5, 1, 6), (7, 1, 8),
                                                        (4, 2, 8))),
         "adaptive_eagle3_gpu_s7": dict(algorithm="eagle3", adaptive=True,
                                        shapes=((3, 1, 4), (5, 1, 6), (7, 1, 8), (4, 2, 8))),
         # the device's candidates before the gated 7-step chain joined them (2026-12-06)
         "adaptive_eagle3_base": dict(algorithm="eagle3", adaptive=True,
                                      shapes=((3, 1, 4), (5, 1, 6), (4, 2, 8))),
         # the CPU's candidates before the 7-step chain joined them (2026-12-06): S1, S3, S5
         "adaptive_cpu3": dict(adaptive=True, shapes=((1, 1, 2), (3, 1, 4), (5, 1, 6))),
         "adaptive_eagle3_cpu3": dict(algorithm="eagle3", adaptive=True,
                                      shapes=((1, 1, 2), (3, 1, 4), (5, 1, 6))),
         "adaptive_cpu3_random_draft": dict(adaptive=True, draft_model="random",
                                            shapes=((1, 1, 2), (3, 1, 4), (5, 1, 6))),
         # a randomly initialised EAGLE head (acceptance ~0): what speculation costs where
         # its drafts always fail, fixed and adaptive (issue 15: it must not lose to plain)
         "eagle_chain_S1K1N2_random_draft": dict(num_steps=1, topk=1, num_draft_tokens=2,
                                                 draft_model="random"),
         "eagle_chain_S3K1N4_random_draft": dict(num_steps=3, topk=1, num_draft_tokens=4,
                                                 draft_model="random"),
         "adaptive_random_draft": dict(adaptive=True, draft_model="random"),
         # the exploration budget's unspent part kept without a cap (before 2026-12-06)
         "adaptive_nocap": dict(adaptive=True),
         "adaptive_random_draft_nocap": dict(adaptive=True, draft_model="random"),
         # built and run with every index check off (guard.unchecked): what the checks cost
         "plain_unchecked": None,
         "eagle_chain_S5K1N6_unchecked": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # checked in every layer's attention kernel, the way before the once-a-forward check
         "plain_layerchecks": None,
         "eagle_chain_S5K1N6_layerchecks": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # num_scheduler_steps=1: one whole-step replay a sync (before the speculative chains)
         "eagle_chain_S5K1N6_1step": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle3_chain_S5K1N6_1step": dict(algorithm="eagle3", num_steps=5, topk=1,
                                           num_draft_tokens=6),
         "eagle3_tree_S6K4N16_1step": dict(algorithm="eagle3", num_steps=6, topk=4,
                                           num_draft_tokens=16),
         "adaptive_1step": dict(adaptive=True),
         # the Triton matrix-vector kernel for decode-sized matmuls (fused.FUSE_GEMV): as
         # shipped since 2026-12-05 it takes qkv and gate_up with add + RMSNorm before and
         # SiLU*mul after (one launch each, cuBLAS the bare matmuls); `_gemv` puts every
         # matmul in it (EAGLEKV_GEMV=1, as measured on the H100 that day), `_cublas` none
         # (cuBLAS and the separate glue kernels, the way before)
         "plain_gemv": None,
         "eagle_chain_S5K1N6_gemv": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "plain_cublas": None,
         "eagle_chain_S5K1N6_cublas": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # the fused matmuls in the kernel up to 8 rows (fused.GEMV_MAX_ROWS = 8, shipped 4):
         # S5's verify at batch 1 (6 rows) then carries its norms too; not yet measured
         "eagle_chain_S5K1N6_gemv8": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "plain_gemv8": None,
         # the verify's extend attention without split-K (attention_triton.EXTEND_SPLITS = 1),
         # the way before 2026-12-05 evening: what the split gains
         "eagle_chain_S5K1N6_xs1": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle3_chain_S5K1N6_xs1": dict(algorithm="eagle3", num_steps=5, topk=1,
                                         num_draft_tokens=6),
         "eagle3_tree_S6K4N16_xs1": dict(algorithm="eagle3", num_steps=6, topk=4,
                                         num_draft_tokens=16),
         # the split-K decode merged in the decode launch (attention_triton.FUSED_DECODE_MERGE
         # on; shipped off, the separate merge kernel, until measured): what that gains
         "plain_fmerge": None,
         "eagle_chain_S5K1N6_fmerge": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # programmatic dependent launch of the decode step's Triton kernels (kernels/pdl.py,
         # shipped off until measured): alone, with every matmul in the gemv kernel (every
         # boundary of a layer then Triton to Triton), and with the fused decode merge
         "plain_pdl": None,
         "plain_gemv_pdl": None,
         "plain_fmerge_pdl": None,
         # num_scheduler_steps=64: twice the shipped chain (32 tokens a sync for plain; 11
         # whole S5 steps instead of 6): what the host's work between chains costs
         "plain_k64": None,
         "eagle_chain_S5K1N6_k64": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_chain_S5K1N6_pdl": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_chain_S5K1N6_fmerge_pdl": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # PDL off (shipped on since 2026-12-05 night, and with it every decode-sized matmul
         # in the gemv kernel): the engine the way before, cuBLAS for o and down
         "plain_nopdl": None,
         # a request prefilled alone replays a captured prefill (cuda_graph_prefill_tokens
         # 256; off by default until measured): at batch 1 the eager prefill was 16-24 ms of a
         # 256-token run's ~175 ms on the H100
         # the gemv kernel's tile capped at BLOCK_M * BLOCK_K = 1024 (max_tile; off by
         # default): decode batches of 2-4 and, with gemv8, S5's 6-row verify in the kernel
         # at the occupancy of one row
         "plain_gt1k": None,
         "eagle_chain_S5K1N6_gemv8_gt1k": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # and the extend attention under PDL too (attention_triton.EXTEND_PDL, off by
         # default): with gemv8_gt1k a verify layer chains Triton to Triton
         "eagle_chain_S5K1N6_xpdl": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_chain_S5K1N6_gemv8_gt1k_xpdl": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "plain_pg": None,
         "eagle_chain_S5K1N6_pg": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "adaptive_pg": dict(adaptive=True),
         "eagle_chain_S5K1N6_nopdl": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle3_chain_S5K1N6_nopdl": dict(algorithm="eagle3", num_steps=5, topk=1,
                                           num_draft_tokens=6),
         # the qkv gemv with RoPE + the K/V store as its epilogue (fused.FUSE_GEMV_ROPE, off
         # by default until measured): one kernel a layer fewer in the target's decode-sized
         # forwards (the plain decode and, with gemv8, S5's verify; the shipped drafts' layer
         # has no input norm, so their steps keep the two kernels)
         "plain_grope": None,
         "eagle_chain_S5K1N6_grope": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_chain_S5K1N6_gemv8_gt1k_xpdl_grope": dict(num_steps=5, topk=1,
                                                          num_draft_tokens=6),
         "adaptive_grope": dict(adaptive=True),
         # the decode attention's split-K capped (attention.MAX_SPLITS 1 or 4; shipped 16): a
         # graph captures the split count of the context limit (16 at batch 1), so a batch-1
         # decode of a few hundred keys runs 48 programs of one key block each and the merge
         # kernel after them; with one split the kernel writes the output itself (no merge
         # launch) at the cost of a longer key loop per program
         "plain_sp1": None,
         "plain_sp4": None,
         "plain_grope_sp1": None,
         "eagle_chain_S5K1N6_sp1": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # the greedy pick with one program a row (greedy_triton.SPLIT_MAX_ROWS 0), the way
         # before 2026-12-06: one program scanned a row's 49152 logits (10.7 us at batch 1)
         "plain_gp1": None,
         "eagle_chain_S5K1N6_gp1": dict(num_steps=5, topk=1, num_draft_tokens=6),
         # everything built and not yet measured at once (a candidate default)
         "plain_grope_sp1_pg": None,
         # the qkv gemv's RoPE epilogue off (on by default for small qkv weights since
         # 2026-12-06): the way before
         "plain_nopg": None,
         "eagle_chain_S5K1N6_nopg": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "adaptive_nopg": dict(adaptive=True),
         "plain_nogrope": None,
         "eagle_chain_S5K1N6_nogrope": dict(num_steps=5, topk=1, num_draft_tokens=6),
         "eagle_chain_S5K1N6_gemv8_gt1k_xpdl_grope_pg": dict(num_steps=5, topk=1,
                                                             num_draft_tokens=6),
         "adaptive_grope_pg": dict(adaptive=True)}
# the gemv kernel's tensor-core tile for 5-16 rows (fused.GEMV_DOT_MAX_ROWS 16): S5's 6-token
# verify at batch 1 and a tree's 8 or 16 then run Triton to Triton (qkv with norm + RoPE +
# store, o, gate_up with norm + SiLU*mul, down), as the decode does; decode batches of 5-16
# too. `_nodot`: cuBLAS and the glue kernels for them; `_dot_xpdl`: the extend attention under
# PDL as well
MODES.update({f"{m}_{v}": MODES[m]
              for m, variants in (("plain", ("dot", "nodot")),
                                  ("eagle_chain_S5K1N6", ("dot", "nodot", "dot_xpdl")),
                                  ("eagle_tree_S4K2N8", ("dot",)),
                                  ("eagle3_chain_S5K1N6", ("dot",)),
                                  ("eagle3_tree_S6K4N16", ("dot",)),
                                  ("adaptive", ("dot", "nodot")))
              for v in variants})
# a chain's verify through the decode kernel (triton_backend.CHAIN_VERIFY_DECODE_MAX_TOKENS 64:
# verifies of <= 64 tokens, e.g. S5/S7 at batch 1-8: the default since 2026-12-06); `_novdec`:
# the extend kernel for every verify, as shipped before
MODES.update({f"{m}_{v}": MODES[m]
              for m in ("eagle_chain_S5K1N6", "eagle3_chain_S5K1N6", "eagle3_chain_S7K1N8",
                        "adaptive", "adaptive_eagle3_gpu_s7")
              for v in ("vdec", "novdec")})
# verifies of up to 128 tokens through the decode kernel (S5 / S7 at batch 16: not measured)
MODES.update({f"{m}_vdec128": MODES[m] for m in ("eagle3_chain_S5K1N6", "eagle3_chain_S7K1N8",
                                                 "adaptive_eagle3")})

# the gemv kernel's tile capped at 1024 products a row block (`_gt1k`) where its matmuls have
# 2-4 rows: S3's 4-token verify at batch 1 and the default at batch 2-4 (the 4-row tile takes
# 128 registers a thread, 205 with SiLU*mul: 2-4 programs an SM, bench/gemv_regs.py; the 8B
# shape's 4-token verify cost 2.02 decode steps on the H200, 8 tokens 1.11)
MODES.update({f"{m}_gt1k": MODES[m] for m in ("eagle3_chain_S3K1N4", "adaptive_eagle3")})

# the split-K decode's merge inside the o projection (`_omerge`: fused.GEMV_MERGE, off until
# measured; a one-token forward's o-proj programs each merge the row's partials, no merge
# launch), and with at most 8 splits (`_sp8`: half the partials each program reads)
MODES.update({"plain_omerge": None, "plain_omerge_sp8": None, "plain_sp8": None,
              "plain_omerge_om8w": None, "adaptive_eagle3_omerge": MODES["adaptive_eagle3"],
              # with chains of 64 (`_k64`: the host's gap between two chains halved a token)
              "plain_omerge_k64": None, "plain_omerge_sp8_k64": None,
              # a whole decode chain as one graph at batch <= 4 (`_cg`:
              # cuda_graph.CHAIN_GRAPH_MAX_BATCH, off until measured)
              "plain_cg": None, "plain_k64_cg": None, "plain_omerge_cg": None,
              "plain_omerge_k64_cg": None,
              # the decode kernel's first key tile read before its PDL wait (`_dpf`:
              # attention_triton.DECODE_PREFETCH, off until measured), alone and with the rest
              "plain_dpf": None, "plain_omerge_dpf": None, "plain_omerge_k64_cg_dpf": None,
              "plain_omerge_sp8_k64_cg_dpf": None,
              # K tiles of 2048 (`_bk2k`): down's K of 1536 in the tile read before the wait
              "plain_bk2k": None, "plain_omerge_k64_cg_dpf_bk2k": None,
              # the two +2-3% settings together (a candidate default)
              "plain_k64_bk2k": None,
              # the MLP in one launch (`_fmlp`: fused.FUSE_MLP, off until measured; down split
              # into an fp32 accumulator by atomics), 4 / 16 intermediate columns a program at
              # batch 1 (`_fmlp4`, `_fmlp16`; 8 by default)
              "plain_fmlp": None, "plain_fmlp4": None, "plain_fmlp16": None,
              "plain_k64_fmlp": None, "plain_k64_bk2k_fmlp": None,
              # the decode's merge and the o projection in one launch (`_mo`: fused.MERGE_O,
              # off until measured), alone and with the fused MLP (4 launches a layer)
              "plain_mo": None, "plain_fmlp_mo": None, "plain_fmlp4_mo": None,
              "plain_fmlp16_mo": None, "plain_fmlp8w8_mo": None, "plain_fmlp16w8_mo": None,
              # both fusions as `EAGLEKV_FUSE_MLP=1 EAGLEKV_MERGE_O=1` set them (`_fuse`: the
              # MLP fusion for one row, merge + o up to four), what a flipped default would be
              "plain_fuse": None, "plain_fuse_r2d": None,
              "eagle3_chain_S7K1N8_fuse": MODES["eagle3_chain_S7K1N8"],
              "adaptive_eagle3_fuse": MODES["adaptive_eagle3"],
              # and merge + o up to 8 rows (`_mo8`: S5 / S7 verifies at batch 1 too)
              "eagle3_chain_S7K1N8_fuse_mo8": MODES["eagle3_chain_S7K1N8"],
              "eagle3_chain_S5K1N6_fuse_mo8": MODES["eagle3_chain_S5K1N6"],
              "adaptive_eagle3_fuse_mo8": MODES["adaptive_eagle3"],
              "plain_k64_bk2k_fmlp_mo": None, "adaptive_eagle3_fmlp_mo": MODES["adaptive_eagle3"],
              "eagle3_chain_S3K1N4_fmlp_mo": MODES["eagle3_chain_S3K1N4"],
              # both fusions off (`_nofuse`: the default until 2026-12-07, twenty-second
              # session, when the GPU suite passed with them on)
              "plain_nofuse": None, "eagle3_chain_S3K1N4_nofuse": MODES["eagle3_chain_S3K1N4"],
              # the gemv's one-row products in the weight tile's layout (`_r2d`), with and
              # without the fusions; `_r3d`: the 3-D form (the default)
              "plain_r2d": None, "plain_nofuse_r2d": None, "plain_r3d": None,
              "eagle3_chain_S7K1N8_r2d": MODES["eagle3_chain_S7K1N8"],
              "adaptive_eagle3_r2d": MODES["adaptive_eagle3"],
              "eagle3_chain_S7K1N8_nofuse": MODES["eagle3_chain_S7K1N8"],
              "adaptive_eagle3_nofuse": MODES["adaptive_eagle3"],
              "eagle3_chain_S3K1N4_fmlp": MODES["eagle3_chain_S3K1N4"],
              "adaptive_eagle3_fmlp": MODES["adaptive_eagle3"],
              "adaptive_eagle3_dpf": MODES["adaptive_eagle3"],
              "adaptive_eagle3_omerge_k64_cg_dpf": MODES["adaptive_eagle3"],
              # speculative chains of 2 / 3 times the default steps (`_sx2`, `_sx3`:
              # eagle_worker.SPEC_CHAIN_X): the host's gap between chains paid less often
              **{f"{m}_{x}": MODES[m] for m in ("eagle3_chain_S3K1N4", "eagle3_chain_S7K1N8",
                                                "adaptive_eagle3")
                 # the draft's layer in the gemv layout (`_dgemv`: fused.DRAFT_GEMV); the MLP
                 # in one launch up to 8 rows (`_mlp8`: the verifies of S5 / S7 at batch 1),
                 # with merge + o up to 8 rows too (`_mo8`)
                 # and the qkv of 5-8 rows in the gemv's row groups (`_g8`): with `_mlp8_mo8`
                 # a verify layer of S7 at batch 1 in four launches, like a decode's
                 for x in ("sx2", "sx3", "dgemv", "dgemv_sx2", "mlp8", "mlp8_mo8",
                           "mlp8_mo8_dgemv", "g8", "g8_mlp8_mo8", "g8_mlp8_mo8_dgemv")},
              # the verify window and the draft as they were before 2026-12-07's flip
              # (`_nog8`: no row groups, `_mlp1`: the fused MLP for one row, `_mo4`: merge +
              # o to four rows, `_nodgemv`: the draft's layer with cuBLAS): `_v4` below is all
              # three of the verify's; plain at batch 5-8 is what `plain_nog8` compares
              **{f"{m}_{x}": MODES[m] for m in ("eagle3_chain_S3K1N4", "eagle3_chain_S5K1N6",
                                                "eagle3_chain_S7K1N8", "adaptive_eagle3")
                 for x in ("nodgemv", "nog8_mlp1_mo4", "nog8_mlp1_mo4_nodgemv")},
              "plain_nog8": None, "plain_nog8_mlp1_mo4": None, "plain_pack": None,
              "plain_nopack": None,
              **{f"{m}_{x}": MODES[m] for m in ("eagle3_chain_S7K1N8", "adaptive_eagle3")
                 for x in ("pack", "nopack")},
              "eagle3_chain_S5K1N6_g8_mlp8_mo8": MODES["eagle3_chain_S5K1N6"],
              "eagle3_chain_S5K1N6_mlp8": MODES["eagle3_chain_S5K1N6"],
              "eagle3_chain_S5K1N6_mlp8_mo8": MODES["eagle3_chain_S5K1N6"], "plain_mlp8": None})

# adaptive with its cost cells measured as each step ran (`_rawcost`: adaptive_worker.
# CHAINED_COSTS off, as shipped before 2026-12-06 evening) or as chains run (`_ccost`: on, the
# default since: exploring steps as whole chains, chains cut short by a budget's end not
# observed once a cell is known)
MODES.update({f"{m}_{v}": MODES[m] for m in ("adaptive", "adaptive_eagle3",
                                             "adaptive_eagle3_gpu_s7")
              for v in ("ccost", "rawcost")})

# mode suffixes: the same shape with other checks, or without chains (not "fixed shapes" of
# the adaptive comparison: that is with the shipped settings)
VARIANTS = ("_unchecked", "_layerchecks", "_1step", "_gemv", "_cublas", "_gemv8", "_xs1",
            "_fmerge", "_pdl", "_nopdl", "_k64", "_pg", "_gt1k", "_xpdl", "_grope", "_sp1",
            "_sp4", "_gp1", "_nogrope", "_nopg", "_nocap", "_dot", "_nodot", "_vdec",
            "_novdec", "_ccost", "_rawcost", "_vdec128", "_omerge", "_sp8", "_om8w", "_cg", "_dpf",
            "_bk2k", "_fmlp", "_fmlp4", "_fmlp16", "_mo", "_nofuse", "_r3d", "_r2d", "_fuse",
            "_mo8", "_sx2", "_sx3", "_dgemv", "_mlp8", "_g8", "_nodgemv", "_nog8", "_mo4",
            "_pack", "_nopack")
# a part of a mode's name -> (module, attribute, its value while the engine is built); parts
# combine ("plain_fmerge_pdl")
MODULE_VARIANTS = {"xs1": ("eaglekv.kernels.attention_triton", "EXTEND_SPLITS", 1),
                   "cg": ("eaglekv.cuda_graph", "CHAIN_GRAPH_MAX_BATCH", 4),
                   "dpf": ("eaglekv.kernels.attention_triton", "DECODE_PREFETCH", True),
                   "mo": ("eaglekv.kernels.fused", "MERGE_O", True),
                   "mo8": ("eaglekv.kernels.fused", "MERGE_O_MAX_ROWS", 8),
                   "dgemv": ("eaglekv.kernels.fused", "DRAFT_GEMV", True),
                   "mlp8": ("eaglekv.kernels.fused", "FUSE_MLP_MAX_ROWS", 8),
                   "g8": ("eaglekv.kernels.fused", "GEMV_GROUP_MAX_ROWS", 8),
                   "nog8": ("eaglekv.kernels.fused", "GEMV_GROUP_MAX_ROWS", 0),
                   "mlp1": ("eaglekv.kernels.fused", "FUSE_MLP_MAX_ROWS", 1),
                   "mo4": ("eaglekv.kernels.fused", "MERGE_O_MAX_ROWS", 4),
                   "nodgemv": ("eaglekv.kernels.fused", "DRAFT_GEMV", False),
                   "sx2": ("eaglekv.speculative.eagle_worker", "SPEC_CHAIN_X", 2.0),
                   "sx3": ("eaglekv.speculative.eagle_worker", "SPEC_CHAIN_X", 3.0),
                   # the gemv's one-row products in the weight tile's layout (`_r2d`, off
                   # until timed) or in the 3-D form (`_r3d`, the default)
                   "r2d": ("eaglekv.kernels.fused_triton", "GEMV_ONE_ROW_2D", True),
                   "r3d": ("eaglekv.kernels.fused_triton", "GEMV_ONE_ROW_2D", False),
                   "fmerge": ("eaglekv.kernels.attention_triton", "FUSED_DECODE_MERGE", True),
                   "pdl": ("eaglekv.kernels.pdl", "PDL", True),
                   "nopdl": ("eaglekv.kernels.pdl", "PDL", False),
                   "xpdl": ("eaglekv.kernels.attention_triton", "EXTEND_PDL", True),
                   "grope": ("eaglekv.kernels.fused", "FUSE_GEMV_ROPE", True),
                   "nogrope": ("eaglekv.kernels.fused", "FUSE_GEMV_ROPE", False),
                   "sp1": ("eaglekv.kernels.attention", "MAX_SPLITS", 1),
                   "sp4": ("eaglekv.kernels.attention", "MAX_SPLITS", 4),
                   "sp8": ("eaglekv.kernels.attention", "MAX_SPLITS", 8),
                   "omerge": ("eaglekv.kernels.fused", "GEMV_MERGE", True),
                   "om8w": ("eaglekv.kernels.fused_triton", "GEMV_MERGE_WARPS", 8),
                   "gp1": ("eaglekv.kernels.greedy_triton", "SPLIT_MAX_ROWS", 0),
                   "nocap": ("eaglekv.speculative.adaptive", "EXPLORE_CAP", float("inf")),
                   "dot": ("eaglekv.kernels.fused", "GEMV_DOT_MAX_ROWS", 16),
                   "nodot": ("eaglekv.kernels.fused", "GEMV_DOT_MAX_ROWS", 0),
                   # a chain's verify of <= 64 tokens through the decode kernel
                   "vdec": ("eaglekv.attention.triton_backend",
                            "CHAIN_VERIFY_DECODE_MAX_TOKENS", 64),
                   "novdec": ("eaglekv.attention.triton_backend",
                              "CHAIN_VERIFY_DECODE_MAX_TOKENS", 0),
                   "vdec128": ("eaglekv.attention.triton_backend",
                               "CHAIN_VERIFY_DECODE_MAX_TOKENS", 128),
                   # the prefill graphs packing a step's prefills (cuda_graph.
                   # PREFILL_GRAPH_PACK, on by default since 2026-12-08)
                   "pack": ("eaglekv.cuda_graph", "PREFILL_GRAPH_PACK", True),
                   "nopack": ("eaglekv.cuda_graph", "PREFILL_GRAPH_PACK", False),
                   # adaptive's cost cells as chains cost (adaptive_worker.CHAINED_COSTS)
                   "ccost": ("eaglekv.speculative.adaptive_worker", "CHAINED_COSTS", True),
                   "rawcost": ("eaglekv.speculative.adaptive_worker", "CHAINED_COSTS", False)}
ADAPTIVE_MODES = ("adaptive", "adaptive_eagle3", "adaptive_eagle3_trees", "adaptive_eagle3_s7",
                  "adaptive_gpu_s7", "adaptive_eagle3_gpu_s7",
                  "adaptive_random_draft", "adaptive_cpu3", "adaptive_eagle3_cpu3",
                  "adaptive_cpu3_random_draft", "adaptive_ccost", "adaptive_eagle3_ccost",
                  "adaptive_eagle3_gpu_s7_ccost", "adaptive_rawcost", "adaptive_eagle3_rawcost",
                  "adaptive_eagle3_gpu_s7_rawcost", "adaptive_eagle3_base")


def split_mode(mode: str) -> tuple[str, str | None]:
    """`name@lib` -> (name, lib): the mode `name` with the CPU matmul library `lib`
    (model/cpu_blas.py: onednn, onednn1, numpy, torch), so libraries compare in one process."""
    name, _, lib = mode.partition("@")
    return name, lib or None


def mode_checks(mode: str):
    """`*_unchecked` modes capture their graphs and run with the index checks off
    (`guard.unchecked`, measurement only); `*_layerchecks` modes with the attention reads
    checked in every layer's kernel (`triton_backend.layer_checks`); `@lib` modes run with
    that CPU matmul library; every other mode as shipped."""
    from eaglekv.attention.triton_backend import layer_checks
    from eaglekv.kernels import guard
    from eaglekv.model import cpu_blas
    name, lib = split_mode(mode)
    stack = contextlib.ExitStack()
    if name.endswith("_unchecked"):
        stack.enter_context(guard.unchecked())
    if name.endswith("_layerchecks"):
        stack.enter_context(layer_checks())
    if lib is not None:
        stack.enter_context(cpu_blas.using(lib))
    return stack


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_engine(args, mode: str, max_batch: int) -> Engine:
    from eaglekv.kernels import fused
    name = split_mode(mode)[0]
    default = fused.FUSE_NORM_MATMUL, fused.FUSE_GEMV, fused.GEMV_MAX_ROWS
    fused.FUSE_NORM_MATMUL = name == "plain_fused"
    parts = name.split("_")
    if "gemv" in parts or "cublas" in parts:
        fused.FUSE_GEMV = "gemv" in parts
    if "gemv8" in parts:
        fused.GEMV_MAX_ROWS = 8
    gemv_config = None
    if "gt1k" in parts or "bk2k" in parts:
        from eaglekv.kernels import fused_triton
        gemv_config = dict(fused_triton.GEMV_CONFIG)
        if "gt1k" in parts:      # the gemv's BLOCK_M * BLOCK_K capped (fused_triton.gemv_block_k)
            fused_triton.GEMV_CONFIG["max_tile"] = 1024
        if "bk2k" in parts:      # K tiles of 2048: SmolLM2's down (K 1536) in the one tile
            fused_triton.GEMV_CONFIG["block_k"] = 2048    # the kernel reads before its wait
    undo = []
    fmlp = [p for p in parts if p.startswith("fmlp")]
    if "nofuse" in parts or "fuse" in parts:   # the fused MLP and the merge + o launch
        undo += [(fused, "FUSE_MLP", fused.FUSE_MLP), (fused, "MERGE_O", fused.MERGE_O)]
        fused.FUSE_MLP = fused.MERGE_O = "fuse" in parts
    if fmlp:                     # the MLP in one launch up to 4 rows; fmlpN: N columns at M = 1
        from eaglekv.kernels import fused_triton
        undo += [(fused, "FUSE_MLP", fused.FUSE_MLP),
                 (fused, "FUSE_MLP_MAX_ROWS", fused.FUSE_MLP_MAX_ROWS),
                 (fused_triton, "MLP_CONFIG", fused_triton.MLP_CONFIG)]
        fused.FUSE_MLP, fused.FUSE_MLP_MAX_ROWS = True, 4
        if fmlp[0] != "fmlp":    # fmlpN or fmlpNwW: N columns a program, W warps
            bn, _, nw = fmlp[0][4:].partition("w")
            fused_triton.MLP_CONFIG = {**fused_triton.MLP_CONFIG, 1: (int(bn), int(nw or 4))}
    for part, (module, attr, value) in MODULE_VARIANTS.items():
        if part in parts:
            mod = importlib.import_module(module)
            undo.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
    try:                                                  # what the graphs capture
        with mode_checks(mode):
            return _make_engine(args, mode, max_batch)
    finally:
        fused.FUSE_NORM_MATMUL, fused.FUSE_GEMV, fused.GEMV_MAX_ROWS = default
        if gemv_config is not None:
            fused_triton.GEMV_CONFIG.clear()
            fused_triton.GEMV_CONFIG.update(gemv_config)
        for mod, attr, was in reversed(undo):
            setattr(mod, attr, was)


def _make_engine(args, mode: str, max_batch: int) -> Engine:
    mode = split_mode(mode)[0]
    spec = MODES[mode]
    sc = SpecConfig() if spec is None else SpecConfig(
        **{"algorithm": "eagle", "draft_model": args.draft, **spec})
    return Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                               max_running_requests=max_batch,
                               max_total_tokens=max_batch * (max(args.new_tokens,
                                                                 PROFILE_NEW_TOKENS) + 64) + 4096,
                               speculative=sc, disable_cuda_graph=args.disable_cuda_graph,
                               waiting_served_ratio=getattr(args, "waiting_served_ratio", 0.0),
                               max_waiting_steps=getattr(args, "max_waiting_steps", 20),
                               num_scheduler_steps=scheduler_steps(mode),
                               cuda_graph_prefill_tokens=prefill_graph_tokens(mode)))


def prefill_graph_tokens(mode: str) -> int | None:
    """cuda_graph_prefill_tokens of a mode: 256 (`*_pg`), 0 (`*_nopg`: eager prefills, the
    default until 2026-12-06), else the engine's default."""
    parts = mode.split("_")
    return 256 if "pg" in parts else 0 if "nopg" in parts else None


def scheduler_steps(mode: str) -> int | None:
    """num_scheduler_steps of a mode: 1 (`*_1step`), 64 (`*_k64`), else the default."""
    parts = mode.split("_")
    return 1 if "1step" in parts else 64 if "k64" in parts else None


def prompts(engine: Engine, B: int, source: str | None = None) -> list[list[int]]:
    """B prompts that differ in their last tokens (token ids for a model without a tokenizer);
    `source` (`--prompts`, eval-draft's format, e.g. the held-out prompts): its prompts in
    order, cycled to B."""
    if source is not None:
        from eaglekv.training.eval_draft import load_prompts, prompt_ids
        ids = prompt_ids(engine, load_prompts(source))
        return [ids[i % len(ids)] for i in range(B)]
    if engine.tokenizer is None:
        return [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(B)]
    base = engine.encode(PROMPT)
    return [base + engine.encode(f" Story {i}.") for i in range(B)]


def timed_generate(engine: Engine, ps: list[list[int]], n: int,
                   concurrency: int | None = None) -> tuple[float, list, dict]:
    """`engine.generate(ps)` timed, step by step: (tokens/s, the token ids, where the time
    went: the prefill steps (until every request of the first wave has its first token), the
    decode steps' count, sum and spread, and the rest (adding the requests, the outputs'
    detokenization)). Every step ends at a host sync, so a step's wall is its whole cost.

    `concurrency`: at most that many requests in flight, a new one added as soon as one
    finishes (continuous batching, as a server under load or vLLM's and SGLang's throughput
    benchmarks run it); the later waves' prefills then count among the decode steps. None:
    every request at once, the batch ending with its slowest request.

    The phases also count the decode steps that began with every one of the `c` places
    decoding (`full_batch_steps`, their `full_batch_ms` and the `full_batch_tokens` they
    made): without waves a batch drains to its slowest request, and a shape that drafts
    deep pays for that in the tail (SGLang's `bench_one_batch` times full-batch steps)."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    c = len(ps) if concurrency is None else concurrency
    sync()
    t = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in ps[:c]]
    walls, first = [], None
    policy = getattr(engine.worker, "policy", None)     # adaptive: what each step chose
    trace, made = [], 0
    full = [0, 0.0, 0]      # the full-batch decode steps: count, seconds, tokens made
    walls_made = []         # every step: [tokens made, ms] (fixed shapes have no step_trace)
    made_all, live = 0, c   # tokens so far; requests decoding when the step began
    traced = 0.0        # the trace's and the counts' own host time: left out of the run's
    while len(reqs) < len(ps) or any(not r.finished for r in reqs):   # time
        s = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - s)
        s = time.perf_counter()
        now_all = sum(len(r.output_ids) for r in reqs)
        walls_made.append([now_all - made_all, round(1e3 * walls[-1], 3)])
        if first is not None and live == c:
            full[0] += 1
            full[1] += walls[-1]
            full[2] += now_all - made_all
        made_all = now_all
        traced += time.perf_counter() - s
        if policy is not None:
            s = time.perf_counter()
            now = sum(len(r.output_ids) for r in reqs)
            last = policy.last
            label = "-" if last is None else last.label + ("?" if last.explore else "")
            # and the drafts the engine's fast and slow averages expect a deepest-shape step
            # to accept (what a new request's choice starts from)
            # and the costs the choice read at this batch size (ms: a plain chain's per token,
            # then each shape's per step; -1: unknown)
            live = max(1, sum(not r.finished for r in reqs))
            cells = [policy.costs.get(x, live) for x in
                     ["chain"] + [sh.label for sh in policy.shapes]]
            trace.append([label, now - made, round(1e3 * walls[-1], 3),
                          round(float(np.minimum.accumulate(policy.engine_rates).sum()), 2),
                          round(float(np.minimum.accumulate(policy.prior).sum()), 2),
                          [-1 if c is None else round(1e3 * c, 3) for c in cells]])
            made = now
            traced += time.perf_counter() - s
        if first is None and all(r.output_ids for r in reqs[:c]):
            first = len(walls)
        running = sum(not r.finished for r in reqs)
        while running < c and len(reqs) < len(ps):
            reqs.append(engine.add_request(ps[len(reqs)], params))
            running += 1
        live = running
    failed = [r for r in reqs if r.error is not None]
    if failed:
        raise failed[0].error
    outs = [r.to_output() for r in reqs]
    sync()
    dt = time.perf_counter() - t - traced
    assert all(len(o.token_ids) == n for o in outs)
    first = first or len(walls)
    decode = sorted(walls[first:]) or [0.0]
    phases = {"prefill_steps": first, "prefill_ms": 1e3 * sum(walls[:first]),
              "decode_steps": len(walls) - first, "decode_ms": 1e3 * sum(walls[first:]),
              "decode_step_ms_p50": 1e3 * decode[len(decode) // 2],
              "decode_step_ms_p90": 1e3 * decode[int(0.9 * (len(decode) - 1))],
              "decode_step_ms_max": 1e3 * decode[-1],
              "other_ms": 1e3 * (dt - sum(walls)),
              "full_batch_steps": full[0], "full_batch_ms": 1e3 * full[1],
              "full_batch_tokens": full[2], "step_walls": walls_made}
    if policy is not None:   # [the step's choice, tokens made, ms, engine / prior drafts] a step
        phases["step_trace"] = trace
    return len(ps) * n / dt, [o.token_ids for o in outs], phases


# a step profile's requests ask for this many tokens (enough for 3 + 3 * steps chains of the
# longest, 32 tokens); the bench's KV pool holds that many for every request at once, else the
# profiled steps of a large batch preempt and re-prefill (at batch 64 until 2026-12-05 night:
# its kernel counts and device times include those prefills)
PROFILE_NEW_TOKENS = 512


def step_profile(engine: Engine, ps: list[list[int]], steps: int = 5,
                 new_tokens: int = PROFILE_NEW_TOKENS) -> dict:
    """Kernels and device time per engine step while every request decodes. An adaptive
    engine's cost table is frozen meanwhile: steps under a profiler are not its costs."""
    costs = getattr(getattr(engine.runner, "policy", None), "costs", None)
    frozen = costs is not None and costs.frozen
    if costs is not None:
        costs.frozen = True
    try:
        return _step_profile(engine, ps, steps, new_tokens)
    finally:
        if costs is not None:
            costs.frozen = frozen


def _step_profile(engine: Engine, ps: list[list[int]], steps: int, new_tokens: int) -> dict:
    # enough for 3 + 3 * steps engine steps of the longest decode chain (32 tokens each)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    preempted = engine.num_preemptions
    reqs = [engine.add_request(p, params) for p in ps]
    while any(len(r.output_ids) < 3 for r in reqs):
        engine.step()
    walls, made = [], sum(len(r.output_ids) for r in reqs)
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        walls.append(time.perf_counter() - t)
    # tokens per request per step: 1 for a plain step, k for a decode chain, the accept
    # length for a speculative step
    per_step = (sum(len(r.output_ids) for r in reqs) - made) / len(reqs) / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(steps):
        engine.step()
    sync()
    cp.disable()
    for r in reqs:
        engine.abort(r)
    phases = phase_profile(engine, steps, ps, params)
    preempted = engine.num_preemptions - preempted
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = engine.model_config.num_layers
    return {"kernels_per_step": len(kernels) / steps,
            "kernels_per_target_layer": len(kernels) / steps / layers,
            "device_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / steps,
            "host_wall_ms_per_step": 1e3 * statistics.median(walls),
            "tokens_per_request_per_step": per_step,
            # > 0: the KV pool was too small, and the figures include re-prefills
            "preemptions": preempted,
            "kernel_top": kernel_top(kernels, steps),
            "timeline": device_timeline(kernels, steps),
            "host_top": host_top(cp, steps),
            **({"phase_ms_per_step": phases} if phases is not None else {})}


def phase_profile(engine: Engine, steps: int, ps: list[list[int]] | None = None,
                  params: SamplingParams | None = None) -> dict | None:
    """A speculative engine's device time a step per part (speculative/phases.py: draft,
    verify, accept, extend; `other`: the rest, e.g. plain steps), from `steps` steps run
    eagerly under the profiler: the whole-step graphs keep no marks, so for these steps they
    run their captured forward as ordinary launches over the same buffers (the kernels are
    the graph's; the launch gaps are not, so the parts are summed kernel times, not walls).
    On the CPU, the parts' CPU time. None for a plain engine.

    With `ps`: over fresh requests of those prompts (`params`), each past its first tokens
    before the profiled steps, so that no row has run out of budget in them (the step
    profile's earlier steps do not eat into these); `rows_decoding` is the fewest rows that
    entered a profiled step still decoding (fewer than len(ps): the figures are those of a
    smaller batch). Until 2026-12-07 the parts came from the step profile's own requests
    after 13 of their steps: at batch 1 a chain of ~30 tokens a step had run out of its 512
    there, and the H200 table of 2026-12-06 shows S5's and the S4/K2/N8 tree's parts as 0."""
    worker = engine.worker
    if worker is None:
        return None
    reqs = [engine.add_request(p, params) for p in (ps or [])]
    while any(len(r.output_ids) < 3 and not r.finished for r in reqs):
        engine.step()
    graphs = [g for w in (list(getattr(worker, "workers", {}).values()) or [worker])
              if (g := getattr(w, "step_graphs", None)) is not None and g.capture]
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for g in graphs:
        g.capture = False
    try:
        decoding = len(reqs)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                decoding = min(decoding, sum(not r.finished for r in reqs))
                engine.step()
            sync()
    finally:
        for g in graphs:
            g.capture = True
    for r in reqs:
        engine.abort(r)
    out = phase_sums(prof.events(), cuda, steps)
    if reqs:
        out["rows_decoding"] = decoding
    return out


def phase_sums(events, cuda: bool, steps: int) -> dict:
    """Milliseconds a step of each part marked `eaglekv::<part>` (speculative/phases.py) in a
    profile's events: on CUDA the device time of the kernels launched inside the part's host
    range (its CPU-side event's `device_time_total`), and `other` the rest of the kernels'
    time; on the CPU the part's CPU time. A mark also appears on the device's timeline as a
    user annotation whose `device_time_total` is its span, first kernel's start to last
    one's end, idle gaps included: those are left out (until 2026-12-07 they were counted
    too, so the parts of the eager steps profiled here read ~10x the step's device time)."""
    from eaglekv.speculative.phases import PHASES, PREFIX
    cpu = torch.autograd.DeviceType.CPU
    out = {name: 0.0 for name in PHASES}
    total = 0.0
    for e in events:
        mark = e.name.startswith(PREFIX)
        if e.device_type != cpu:
            if not mark:
                total += e.device_time
            continue
        if mark and e.name[len(PREFIX):] in out:
            out[e.name[len(PREFIX):]] += e.device_time_total if cuda else e.cpu_time_total
    out = {k: v / 1e3 / steps for k, v in out.items()}
    if cuda:
        out["other"] = max(0.0, total / 1e3 / steps - sum(out.values()))
    return out


# the gap classes of `device_timeline`, in microseconds: a kernel boundary inside a graph or a
# back-to-back launch (< 2), a launch the host issued late (2-100), host work or a sync with
# the device idle (>= 100)
GAP_CLASSES = ((0.0, 2.0, "under_2us"), (2.0, 100.0, "2_to_100us"),
               (100.0, float("inf"), "over_100us"))


def device_timeline(kernels, steps: int) -> dict | None:
    """Where the device was idle in the profiled steps: the span from the first kernel's
    start to the last one's end, the time some kernel ran (overlaps counted once), and the
    idle rest split by gap size (GAP_CLASSES: count and microseconds a step). A step's wall
    less its device busy time is launch gaps, kernel boundaries and the host's work between
    syncs; this tells them apart. None without kernel timestamps (the CPU)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels
                   if getattr(e, "time_range", None) is not None)
    if not spans:
        return None
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:                    # an idle gap: the device ran nothing in (end, s)
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in spans) - spans[0][0]
    out = {"span_ms_per_step": span / 1e3 / steps, "busy_ms_per_step": busy / 1e3 / steps,
           "idle_ms_per_step": (span - busy) / 1e3 / steps, "gaps": {}}
    g = np.asarray(gaps, dtype=np.float64)
    for lo, hi, name in GAP_CLASSES:
        m = (g >= lo) & (g < hi)
        out["gaps"][name] = {"count_per_step": float(m.sum()) / steps,
                             "us_per_step": float(g[m].sum()) / steps}
    return out


def kernel_top(kernels, steps: int, n: int = 30) -> list[dict]:
    """The n device kernels (by name) with the most device time a step: launches and
    microseconds a step, so a step's kernels per layer can be read by kind (a layer's
    kernels appear num_layers times a step)."""
    agg: dict[str, list[float]] = {}
    for e in kernels:
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += e.device_time
    rows = [{"kernel": name[:160], "launches_per_step": cnt / steps, "us_per_step": us / steps}
            for name, (cnt, us) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:n]


def host_top(cp: cProfile.Profile, steps: int, n: int = 25) -> list[dict]:
    """The n Python functions with the most self time a step under cProfile (which slows
    Python calls, so the figures rank the host work more than they time it); a device wait
    shows as the self time of the call that syncs (e.g. `tolist`)."""
    rows = []
    for (path, line, name), (_, calls, self_s, cum_s, _) in pstats.Stats(cp).stats.items():
        where = path.split("eaglekv/", 1)[-1] if "eaglekv/" in path else os.path.basename(path)
        rows.append({"function": f"{where}:{line}({name})", "calls_per_step": calls / steps,
                     "self_ms_per_step": 1e3 * self_s / steps,
                     "cum_ms_per_step": 1e3 * cum_s / steps})
    return sorted(rows, key=lambda r: -r["self_ms_per_step"])[:n]


class JitLoads(list):
    """Kernel names (`jit_loads`), with `details` beside them."""

    def __init__(self):
        super().__init__()
        self.details: list[dict] = []


@contextlib.contextmanager
def jit_loads():
    """The Triton kernel specialisations first launched in this process inside the block (a
    compile, or a load from the disk cache: ~1 s or ~10 ms in the middle of a timed step), by
    kernel name; None where this Triton has no `knobs.runtime.jit_cache_hook`. The list's
    `details` has, for each, Triton's description of the specialisation (the arguments'
    types, with the divisibility it assumed) and the eaglekv frames that launched it: which
    path met a specialisation that the start-up's warm-up and capture did not."""
    try:
        from triton import knobs
        hook_holder = knobs.runtime
        old = hook_holder.jit_cache_hook
    except (ImportError, AttributeError):
        yield None
        return
    seen = JitLoads()
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # eaglekv/
    bench = os.path.join(pkg, "bench") + os.sep

    def hook(*, repr: str, **_):
        seen.append(repr.split("[", 1)[0])
        frames = [f"{os.path.relpath(f.filename, pkg)}:{f.lineno}({f.name})"
                  for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(pkg) and not f.filename.startswith(bench)]
        seen.details.append({"kernel": repr, "launched_from": frames[-8:]})
        return False        # compile as usual
    hook_holder.jit_cache_hook = hook
    try:
        yield seen
    finally:
        hook_holder.jit_cache_hook = old


def run_modes(args, modes: list[str], batches: list[int]) -> dict:
    """Every mode's engine first, warmed up at every batch size; then `repeats` rounds, each
    running every mode at every batch size in turn; then the per-step profiles."""
    engines, build_s = {}, {}
    for m in modes:      # start-up: weights, KV pool, every CUDA graph's capture
        sync()
        t = time.perf_counter()
        engines[m] = make_engine(args, m, max(batches))
        sync()
        build_s[m] = time.perf_counter() - t
    waves = getattr(args, "waves", 1)      # > 1: B requests in flight, B * waves in all
    source = getattr(args, "prompts", None)
    ps = {B: prompts(next(iter(engines.values())), B * waves, source) for B in batches}
    conc = {B: B if waves > 1 else None for B in batches}
    for m, eng in engines.items():
        # the whole length once: every kernel specialisation compiled (adaptive: costs
        # measured; at least twice, as its steps split batches into sizes a first pass may not
        # reach: on an H100 on 2026-12-06 its timed runs at batch 64 compiled kernels for
        # 0.5-1.4 s)
        policy = getattr(eng.runner, "policy", None)
        for i in range(5 if policy is not None else 1):
            explored = policy.explored if policy is not None else 0
            for B in batches:
                with mode_checks(m):
                    timed_generate(eng, ps[B][:B], args.new_tokens)
            # adaptive: until a pass explores no cost (the state a later engine on this
            # device starts from: the costs are cached on disk): on an H100 a timed run at
            # batch 16 explored the S6 tree's cost in three single steps (~7% of the run)
            if i >= 1 and policy.explored == explored:
                break
        if eng.worker is not None:
            eng.worker.reset_stats()
    runs = {m: {B: [] for B in batches} for m in modes}
    toks = {m: {} for m in modes}
    stats = {m: {} for m in modes}
    for _ in range(args.repeats):
        for m, eng in engines.items():
            for B in batches:
                if eng.worker is not None:
                    eng.worker.reset_stats()
                with mode_checks(m), jit_loads() as loaded:
                    tps, toks[m][B], phases = timed_generate(eng, ps[B], args.new_tokens,
                                                             conc[B])
                runs[m][B].append(tps)
                stats[m].setdefault(B, {}).setdefault("phases", []).append(phases)
                if loaded is not None:   # a kernel compiled (or loaded) inside a timed run
                    stats[m][B].setdefault("triton_jit_loads", []).append(list(loaded))
                    if loaded.details:
                        stats[m][B].setdefault("triton_jit_details", []).extend(loaded.details)
                if eng.worker is not None:
                    st, w = eng.spec_stats(), eng.worker
                    steps = max(st.verify_steps, 1)
                    stats[m][B].update({"accept_length_mean": st.accept_length_mean,
                                        "host_ms_per_verify_step": {k: 1e3 * v / steps
                                                                    for k, v in w.timings.items()}})
                    if st.choices is not None:
                        stats[m][B]["steps_per_choice"] = dict(st.choices)
        if args.out:    # what a round measured, in case a later stage runs out of time
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "partial_runs.json"), "w") as f:
                json.dump({"runs": runs, "stats": stats}, f, indent=1)
    out = {}
    for m, eng in engines.items():
        rows = {}
        for B in batches:
            row = {"tokens_per_s": statistics.median(runs[m][B]), "runs": runs[m][B],
                   **stats[m].get(B, {})}
            rate = decode_rate(row.get("phases", []), B, args.new_tokens, waves)
            if rate is not None:
                row["decode_tokens_per_s"] = rate
            rate = full_batch_rate(row.get("phases", []))
            if rate is not None:
                row["full_batch_tokens_per_s"] = rate
            if "plain" in toks and m != "plain":
                same = sum(a == b for a, b in zip(toks[m][B], toks["plain"][B]))
                row["greedy_identical_to_plain"] = f"{same}/{len(ps[B])} requests"
            if args.device.startswith("cuda") and B in (batches[0], batches[-1]):
                with mode_checks(m):
                    row["step_profile"] = step_profile(eng, ps[B][:B])
            rows[B] = row
        out[m] = {"rows": rows, "cuda_graphs": graph_replays(eng),
                  "engine_build_s": round(build_s[m], 3)}
        policy = getattr(eng.runner, "policy", None)
        if policy is not None:
            out[m]["cost_table_ms"] = {k: 1e3 * v[0] for k, v in policy.costs.cells.items()}
            # what the choice read beside the costs: the trees' learnt corrections and the
            # engine's fast and slow acceptance per draft position
            out[m]["acceptance"] = {"corr": {s.label: round(c, 3)
                                             for s, c in policy.corr.items()},
                                    "engine_rates": [round(x, 3) for x in
                                                     policy.engine_rates.tolist()],
                                    "prior": [round(x, 3) for x in policy.prior.tolist()]}
            out[m]["why"] = policy.summary(batches[0])
    del engines
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def graph_replays(engine: Engine) -> dict:
    """Replays per captured kind (decode, verify, whole speculative step) over the mode's
    runs: which graphs actually served the steps (an empty dict: none were captured)."""
    r = engine.runner
    kinds = {"decode": getattr(r, "graphs", None), "verify": getattr(r, "verify_graphs", None),
             "spec_step": getattr(r, "step_graphs", None)}
    for shape, w in getattr(r, "workers", {}).items():    # adaptive: each shape's own
        kinds[f"verify {shape.label}"] = w.verify_graphs
        kinds[f"spec_step {shape.label}"] = w.step_graphs
    return {k: g.replays for k, g in kinds.items() if g is not None}


def hf_row(args, ids: list[int]) -> dict:
    from eaglekv.bench.e2e import load_hf, time_hf
    hf = load_hf(args.model, getattr(torch, args.dtype), args.device)
    # one untimed run of the timed length: after a warm-up of 8 tokens the first 256-token run
    # on the H200 still ran 15.0-17.7 tok/s against 43.6-47.1 after it (2026-12-06), and with
    # 2 rounds the median is their mean
    time_hf(hf, ids, args.new_tokens, args.device)
    runs = [time_hf(hf, ids, args.new_tokens, args.device) for _ in range(args.repeats)]
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tokens_per_s": statistics.median(runs), "runs": runs}


def copy_bandwidth(nbytes: int = 2**32) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write), median of 10."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        sync()
        times.append(e0.elapsed_time(e1) / 1e3)
    return nbytes / statistics.median(times[2:])


LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_theta=500000.0)


@contextlib.contextmanager
def patched(sets):
    """Module attributes set to other values for a while: `sets` is [(module, name, value)],
    each put back on leaving (a graph captured inside keeps what it read)."""
    was = [(m, a, getattr(m, a)) for m, a, _ in sets]
    try:
        for m, a, v in sets:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in reversed(was):
            setattr(m, a, v)


def llama8b_row(context: int = 512, steps: int = 50) -> dict:
    """Decode step of a Llama-3.1-8B shape (random bf16 weights made on the device) replayed
    as a captured graph at batch 1, against weights / copy bandwidth."""
    from transformers import AutoConfig

    from eaglekv.cuda_graph import DecodeGraphs, VerifyGraphs
    from eaglekv.model import LlamaForCausalLM
    from eaglekv.model.config import ModelConfig
    from eaglekv.model.llama import expected_tensors
    mc = ModelConfig.from_hf(AutoConfig.for_model("llama", **LLAMA8B))
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {}
    for name, shape in expected_tensors(mc).items():
        sd[name] = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
                    if len(shape) == 2 else torch.ones(shape, device="cuda", dtype=torch.bfloat16))
    model = LlamaForCausalLM(mc, sd, torch.bfloat16, "cuda", max_positions=context + steps + 8)
    del sd
    torch.cuda.empty_cache()
    weight_bytes = sum(x.numel() * x.element_size() for layer in model.layers
                       for x in (layer.qkv, layer.o, layer.gate_up, layer.down)) \
        + model.lm_head_t.numel() * 2 + (0 if model.embed is None else 4096 * 2)
    pool, backend, (row,) = replay_rig(mc, 1, context + steps + 8)
    from eaglekv.kernels import fused

    def decode_step_s(graphs) -> float:
        times = []
        for i in range(steps):
            pos = context + i
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graphs.replay([7], [pos], [row], np.array([pos + 1]))
            e1.record()
            sync()
            times.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(times[5:])

    def chained_step_s(graphs, k: int) -> float:
        """A step of `replay_chain`: k greedy steps back to back, one sync (the engine's plain
        decode under CUDA graphs, EngineConfig.decode_steps), so the host prepares step j + 1
        while the device runs step j."""
        times = []
        for i in range(steps // k):
            pos = context + i * k
            slots = (np.arange(k) + pos + 1)[:, None]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graphs.replay_chain([7], [pos], [row], slots)
            e1.record()
            sync()
            times.append(e0.elapsed_time(e1) / 1e3 / k)
        return statistics.median(times[1:])

    default, fused.FUSE_NORM_MATMUL = fused.FUSE_NORM_MATMUL, True   # the step with norm_matmul
    try:
        with_fused = DecodeGraphs(model, backend, 1, context + steps + 8, progress=False)
    finally:
        fused.FUSE_NORM_MATMUL = default
    graphs = DecodeGraphs(model, backend, 1, context + steps + 8, progress=False)
    fused_s, step_s, fused_s2 = (decode_step_s(with_fused), decode_step_s(graphs),
                                 decode_step_s(with_fused))
    # one-step replays of the unshipped settings (two each): the qkv gemv's RoPE epilogue, the
    # decode attention in one split (no merge launch), both
    from eaglekv.kernels import attention as attn_mod
    from eaglekv.kernels import fused_triton
    variants = {"shipped": [step_s, decode_step_s(graphs)]}
    grope = [(fused, "FUSE_GEMV_ROPE", True), (fused, "GEMV_ROPE_MAX_BYTES", None)]
    # the gemv kernel's one-row tiling (every matmul of the step but lm_head, ~90% of its
    # device time): warps, K tiles, and the rows a program at this width (GEMV_WIDE_BLOCK_N,
    # 8 since 2026-12-06: 4 was 82.3% of the roofline on an H100, 8 84.8%)
    tiling = {f"gemv_{k}{v}": [(fused_triton, "GEMV_CONFIG",
                                {**fused_triton.GEMV_CONFIG, k: v})]
              for k, v in (("num_warps", 2), ("num_warps", 8), ("block_k", 2048),
                           ("block_k", 512))}
    tiling.update({f"gemv_wide_block_n{v}": [(fused_triton, "GEMV_WIDE_BLOCK_N", v)]
                   for v in (4, 16)})
    # the K tiles of 2048 (77.5% on the H200, 2026-12-06) with the RoPE epilogue and with 8
    # warps; whole rows of K in one tile at 8 warps
    k2048 = [(fused_triton, "GEMV_CONFIG", {**fused_triton.GEMV_CONFIG, "block_k": 2048})]
    tiling.update({
        "gemv_block_k2048_grope": k2048 + grope,
        "gemv_block_k2048_nw8": [(fused_triton, "GEMV_CONFIG", {
            **fused_triton.GEMV_CONFIG, "block_k": 2048, "num_warps": 8})],
        "gemv_block_k4096_nw8": [(fused_triton, "GEMV_CONFIG", {
            **fused_triton.GEMV_CONFIG, "block_k": 4096, "num_warps": 8})]})
    # cuBLAS for the weights past 8 MB (fused.GEMV_*MAX_WEIGHT_BYTES): the bare ones (o, down)
    # or all four (qkv and gate_up then with the separate norm and SiLU*mul kernels)
    bare, every = ([(fused, "GEMV_BARE_MAX_WEIGHT_BYTES", 8 << 20)],
                   [(fused, "GEMV_MAX_WEIGHT_BYTES", 8 << 20)])
    tiling.update({"bare_cublas": bare, "all_cublas": every,
                   "bare_cublas_block_k2048": bare + k2048,
                   "bare_cublas_block_k2048_grope": bare + k2048 + grope,
                   # the one-row products in the weight tile's layout (GEMV_ONE_ROW_2D, off
                   # until timed: no smem round trip of each tile), alone and with 2048 tiles
                   "row2d": [(fused_triton, "GEMV_ONE_ROW_2D", True)],
                   "row2d_block_k2048": [(fused_triton, "GEMV_ONE_ROW_2D", True)] + k2048})
    only = os.environ.get("EAGLEKV_BENCH_8B_VARIANTS")      # a comma list: these only
    for name, sets in (("grope", grope), ("sp1", [(attn_mod, "MAX_SPLITS", 1)]),
                       ("grope_sp1", grope + [(attn_mod, "MAX_SPLITS", 1)]),
                       *tiling.items()):
        if only is not None and name not in only.split(","):
            continue
        try:       # captured and replayed with the setting (a replay's host side reads some)
            with patched(sets):
                other = DecodeGraphs(model, backend, 1, context + steps + 8, progress=False)
                variants[name] = [decode_step_s(other), decode_step_s(other)]
        except Exception as e:                          # noqa: BLE001 - costs this field only
            variants[name] = {"error": repr(e)}
        finally:
            other = None
    variants["shipped_again"] = [decode_step_s(graphs), decode_step_s(graphs)]   # the drift
    rope = {"off": variants["shipped"], "on": variants.get("grope", {"error": "not run"})}
    chain_k = min(DEFAULT_SCHEDULER_STEPS, 8)      # 6 chains inside the KV pool's steps
    try:     # new here (2026-12-05 evening, not yet run on a GPU): its failure costs the row
        chained_s = chained_step_s(graphs, chain_k)    # nothing else
    except Exception as e:                              # noqa: BLE001
        chained_s, chain_error = float("nan"), repr(e)
    else:
        chain_error = None
    del with_fused
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            graphs.replay([7], [context], [row], np.array([context + 1]))
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    def verify_s(N: int) -> float:     # one verify of N chain nodes, replayed
        vg = VerifyGraphs(model, backend, 1, N, progress=False)
        pos = torch.arange(context, context + N, device="cuda")
        mask = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()[None]
        args = (torch.full((N,), 7, device="cuda"), pos, torch.tensor([row], device="cuda"),
                torch.tensor([context], device="cuda"), pos + 1, mask)
        vt = []
        for _ in range(25):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            vg.run(*args)
            e1.record()
            sync()
            vt.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(vt[5:])

    parts = matmul_parts(model)
    verify = {}
    for N in (4, 8, 16):   # against one decode step
        t = verify_s(N)
        verify[N] = {"ms": 1e3 * t, "x_decode_step": t / step_s}
    # A verify of 4 tokens cost 1.34-1.53 decode steps on the H100 and 2.02 on the H200
    # (2026-12-06) where 8 tokens cost 1.03-1.11: its 4-row matmuls ran the gemv kernel's
    # register tile, 8 rows cuBLAS. Since 2026-12-07 2-4 rows at this K go to cuBLAS
    # (fused.GEMV_ROWS_MAX_K); the variants: the gemv tile as before (`gemv_rows`), and capped
    # at 1024 or 2048 products a row block (GEMV_CONFIG max_tile).
    gemv_rows = [(fused, "GEMV_ROWS_MAX_K", None)]
    verify_variants = {}
    for name, sets in (("gemv_rows", gemv_rows),
                       *((f"gemv_rows_max_tile{tile}",
                          gemv_rows + [(fused_triton, "GEMV_CONFIG",
                                        {**fused_triton.GEMV_CONFIG, "max_tile": tile})])
                         for tile in (1024, 2048))):
        try:
            with patched(sets):
                t = verify_s(4)
            verify_variants[name] = {"ms": 1e3 * t, "x_decode_step": t / step_s}
        except Exception as e:                          # noqa: BLE001 - costs this field only
            verify_variants[name] = {"error": repr(e)}
    bw = copy_bandwidth()
    roofline_s = weight_bytes / bw
    out = {"shape": "Llama-3.1-8B (random bf16 weights)", "context": context,
           "weight_bytes": weight_bytes, "copy_bandwidth_TBps": bw / 1e12,
           "decode_ms": 1e3 * step_s, "tokens_per_s": 1 / step_s,
           "decode_ms_norm_matmul": 1e3 * min(fused_s, fused_s2),
           "roofline_ms": 1e3 * roofline_s, "fraction_of_roofline": roofline_s / step_s,
           # the engine's plain decode: chains of chain_k steps a sync (one-step replays above
           # wait on the host between steps)
           "chain_steps": chain_k, "decode_ms_chained": 1e3 * chained_s,
           "tokens_per_s_chained": 1 / chained_s,
           "fraction_of_roofline_chained": roofline_s / chained_s, "chain_error": chain_error,
           "kernels_per_step": len(kernels) / 5,
           "device_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / 5,
           "kernel_top": kernel_top(kernels, 5), "verify_vs_decode": verify,
           "verify4_variants_vs_decode": verify_variants, "matmul_parts": parts,
           # one-step replays with the qkv gemv's RoPE epilogue off / on (two each, ms) and
           # the fraction of the roofline of the faster
           "gemv_rope_decode_ms": {k: [1e3 * t for t in v] if isinstance(v, list) else v
                                   for k, v in rope.items()},
           "gemv_rope_fraction_of_roofline": {k: roofline_s / min(v) for k, v in rope.items()
                                              if isinstance(v, list)},
           # the same for every variant (shipped, grope, sp1, grope_sp1)
           "variant_decode_ms": {k: [1e3 * t for t in v] if isinstance(v, list) else v
                                 for k, v in variants.items()},
           "variant_fraction_of_roofline": {k: roofline_s / min(v)
                                            for k, v in variants.items()
                                            if isinstance(v, list)}}
    del graphs, model, pool, backend
    torch.cuda.empty_cache()
    return out


def graph_us(fn, reps: int = 10) -> float:
    """Mean microseconds of one replay of `fn` captured in a CUDA graph (after a warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    sync()
    return 1e3 * e0.elapsed_time(e1) / reps


def matmul_parts(model) -> dict:
    """Each of a layer's four matmuls at M = 1 over every layer's weight (so it streams from
    HBM, not L2), in one graph: the gemv kernel at the shipped tiling (qkv and gate_up with
    their add + RMSNorm prologue, gate_up with SiLU*mul, as in the step) against cuBLAS on
    the same column-major weights (bare), in us a layer and TB/s of weight bytes."""
    from eaglekv.kernels import fused
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        ws = [getattr(layer, name) for layer in model.layers]
        K = ws[0].shape[0]
        x, r = (torch.randn(1, K, device=ws[0].device, dtype=ws[0].dtype) for _ in range(2))
        nw = torch.ones(K, device=ws[0].device, dtype=ws[0].dtype)
        nbytes = ws[0].numel() * ws[0].element_size()
        silu = name == "gate_up"

        def kernel():
            for w in ws:
                if name in ("qkv", "gate_up"):
                    fused._triton_impl().gemv_triton(x, r, nw, 1e-5, w, silu, fused._check_gemv)
                else:
                    fused.gemv(x, w)

        def cublas():
            for w in ws:
                x @ w
        row = {}
        for path, fn in (("gemv", kernel), ("cublas", cublas)):
            try:
                us = graph_us(fn) / len(ws)
                row[f"{path}_us"], row[f"{path}_TBps"] = us, nbytes / us / 1e6
            except Exception as e:                     # noqa: BLE001 - costs this cell only
                row[f"{path}_error"] = repr(e)
        out[name] = row
    return out


def replay_rig(mc, batch: int, kv_len: int, dtype=torch.bfloat16):
    """A KV pool and a Triton backend for `batch` requests of up to `kv_len` tokens each,
    request i's table row mapping its positions to slots of its own (none to the padding
    page): graphs replayed over it outside an engine. -> (pool, backend, rows)."""
    from eaglekv.attention.triton_backend import TritonAttentionBackend
    from eaglekv.memory import KVPool, ReqToTokenPool
    r2t = ReqToTokenPool(batch, kv_len, device="cuda")
    pool = KVPool(batch * kv_len, 1, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, "cuda")
    rows = [r2t.alloc() for _ in range(batch)]
    for i, row in enumerate(rows):      # slot 0 is the padding page's
        r2t.req_to_token[row, :kv_len] = torch.arange(
            1 + i * kv_len, 1 + (i + 1) * kv_len, device="cuda", dtype=torch.int32)
    return pool, TritonAttentionBackend(pool, r2t), rows


def checks_replay_row(model, batches=(1, 64), context: int = 256, k: int = 8,
                      rounds: int = 15, N: int = 6) -> dict:
    """What the index checks cost a replayed step, device side: for each batch, the decode
    graph captured as shipped (checked) and under `guard.unchecked()`, and the same for a
    verify of N tokens, replayed in alternation (`rounds` times a chain of k decode steps, or
    k verifies, each), every block timed by CUDA events. The alternation takes the drift of
    the GPU's clock out of the ratio that end-to-end tokens/s (2-9% between repeats) cannot
    show: -> per batch and graph, the median step of each and the median of the per-round
    checked / unchecked ratios with their spread."""
    from eaglekv.cuda_graph import DecodeGraphs, VerifyGraphs
    from eaglekv.kernels import guard
    mc = model.cfg
    out = {"context": context, "chain_steps": k, "rounds": rounds, "verify_tokens": N}
    for B in batches:
        pool, backend, rows = replay_rig(mc, B, context + k + N + 8, model.dtype)
        graphs = {}
        for checked in (True, False):
            with contextlib.ExitStack() as stack:
                if not checked:
                    stack.enter_context(guard.unchecked())
                graphs[checked] = (DecodeGraphs(model, backend, B, context + k + N + 8,
                                                progress=False),
                                   VerifyGraphs(model, backend, B, N, progress=False))
        # every request at `context`: its first context slots hold whatever the pool holds
        pos = [context] * B
        slots = (np.arange(k)[:, None] + context + 1
                 + np.arange(B)[None, :] * (context + k + N + 8))
        vpos = (torch.arange(N, device="cuda") + context).repeat(B)
        vslots = (vpos + 1 + torch.arange(B, device="cuda").repeat_interleave(N)
                  * (context + k + N + 8))
        vmask = torch.ones(N, N, dtype=torch.bool, device="cuda").tril().expand(B, N, N)
        vargs = (torch.full((B * N,), 7, device="cuda"), vpos,
                 torch.tensor(rows, device="cuda"), torch.full((B,), context, device="cuda"),
                 vslots, vmask)

        def block(checked: bool, verify: bool) -> float:
            dg, vg = graphs[checked]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            if verify:
                for _ in range(k):
                    vg.run(*vargs)
            else:
                dg.replay_chain([7] * B, pos, rows, slots)
            e1.record()
            sync()
            return e0.elapsed_time(e1) / 1e3 / k

        row = {}
        with torch.inference_mode():
            for verify in (False, True):
                for c in (True, False, True, False):                      # warm-up
                    block(c, verify)
                t = {True: [], False: []}
                for _ in range(rounds):
                    for c in (True, False):
                        t[c].append(block(c, verify))
                ratios = sorted(a / b for a, b in zip(t[True], t[False]))
                row["verify" if verify else "decode"] = {
                    "checked_ms": 1e3 * statistics.median(t[True]),
                    "unchecked_ms": 1e3 * statistics.median(t[False]),
                    "checked_vs_unchecked": statistics.median(ratios),
                    "ratio_p10_p90": [ratios[len(ratios) // 10],
                                      ratios[(9 * len(ratios)) // 10]]}
        out[B] = row
        del graphs, pool, backend
        torch.cuda.empty_cache()
    return out


def floor_or_error(path: str) -> dict:
    """`floor_rows`, or {"error": ...} where the floor script failed: it runs after the modes,
    whose minutes of figures are then still written (a floor that raised lost a whole table's
    JSON on an H100, 2026-12-07)."""
    try:
        return floor_rows(path)
    except Exception as e:                       # noqa: BLE001 (any failure of the script)
        print(f"bench: the floor failed ({type(e).__name__}: {e}); the modes' figures are kept",
              file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def floor_rows(path: str) -> dict:
    """The floor of issue 13's table, in this process: `graph_floor.py` (../shared/tools: one
    batch-1 decode step of a Llama-shaped model in plain PyTorch ops over a static KV cache,
    eager, in one CUDA graph, and torch.compile'd then captured; it runs on import and prints a
    line `<shape> {json}` per shape). Returns {shape: its figures}."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(path, run_name="graph_floor")
    rows = {}
    for line in buf.getvalue().splitlines():
        name, _, figures = line.partition(" ")
        if figures.startswith("{"):
            rows[name] = json.loads(figures)
    if not rows:
        raise RuntimeError(f"{path} printed no '<shape> {{json}}' line:\n{buf.getvalue()[-500:]}")
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in result["modes"].items():
        bs = sorted(int(b) for b in m["rows"])
        ax.plot(bs, [m["rows"][b]["tokens_per_s"] for b in bs], marker="o", label=mode)
    if "hf_transformers" in result:
        ax.scatter([1], [result["hf_transformers"]["tokens_per_s"]], color="k", marker="x",
                   label="HF transformers (batch 1)", zorder=3)
    floor = result.get("floor", {}).get("smollm2_shape", {}).get("compiled_graph_tok_s")
    if floor:
        ax.scatter([1], [floor], color="r", marker="*", s=80, zorder=3,
                   label="floor: torch.compile + one CUDA graph (batch 1)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s (total)")
    ax.set_title(f"eaglekv on {result['device']}, {result['model_short']} {result['dtype']}, "
                 f"{result['date'][:10]}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def decode_rate(phases: list[dict], batch: int, new_tokens: int,
                waves: int = 1) -> float | None:
    """Tokens a second of the decode steps alone (the median over the runs): the B x (n - 1)
    tokens after each request's first, over the decode steps' wall. The prefill (an eager
    forward, 10-60 ms a run at batch 1 on an H100 and the noisiest part of a run) is left out,
    as the compiled-graph floor leaves it out. None for waves > 1 (later waves' prefills are
    among the decode steps) or a run without decode steps."""
    if waves != 1 or not phases or any(p.get("decode_ms", 0) <= 0 for p in phases):
        return None
    return statistics.median(batch * (new_tokens - 1) / (p["decode_ms"] / 1e3) for p in phases)


def full_batch_rate(phases: list[dict]) -> float | None:
    """Tokens a second of the decode steps that began with the whole batch decoding (the
    median over the runs; `timed_generate`'s `full_batch_*`): the batch's rate before it
    drains to its slowest request. None where a run had no such step."""
    if not phases or any(p.get("full_batch_ms", 0) <= 0 for p in phases):
        return None
    return statistics.median(p["full_batch_tokens"] / (p["full_batch_ms"] / 1e3)
                             for p in phases)


def table(result: dict, key: str = "tokens_per_s") -> str:
    """Markdown: `key` (tokens/s, or `decode_tokens_per_s`: the decode steps alone) per mode and
    batch size (x plain in brackets); a cell with a Triton compile (or cache load) inside one
    of its timed runs is marked ` (jit)` (the runs' figures and `triton_jit_details` say
    which)."""
    modes = result["modes"]
    bs = sorted({int(b) for m in modes.values() for b in m["rows"]})
    head = {"tokens_per_s": "tok/s", "decode_tokens_per_s": "decode tok/s (prefill excluded)",
            "full_batch_tokens_per_s": "full-batch tok/s (steps with every request decoding)"
            }.get(key, key)
    lines = [f"| {head} | " + " | ".join(f"batch {b}" for b in bs) + " |",
             "|---" * (len(bs) + 1) + "|"]
    for name, m in modes.items():
        cells = []
        lib = split_mode(name)[1]
        base = "plain" + (f"@{lib}" if lib else "")
        plain = modes.get(base, {}).get("rows", {})
        for b in bs:
            r = m["rows"].get(b)
            if r is None or key not in r:
                cells.append("")
                continue
            x = (f" ({r[key] / plain[b][key]:.2f}x)"
                 if name != base and b in plain and key in plain[b] else "")
            jit = " (jit)" if any(r.get("triton_jit_loads") or []) else ""
            cells.append(f"{r[key]:.1f}{x}{jit}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    floor = result.get("floor", {}).get("smollm2_shape", {}).get("compiled_graph_tok_s")
    if floor and key != "full_batch_tokens_per_s":      # (the floor: batch 1, decode only)
        lines.append("| floor: torch.compile + one CUDA graph (same process) | "
                     + " | ".join([f"{floor:.1f}"] + [""] * (len(bs) - 1)) + " |")
    return "\n".join(lines)


def _profile_ratio(result: dict, m: str, u: str, B, key: str) -> float | None:
    """checked / unchecked of a step-profile figure (None where a row was not profiled)."""
    a = result["modes"][m]["rows"][B].get("step_profile", {}).get(key)
    b = result["modes"][u]["rows"][B].get("step_profile", {}).get(key)
    return a / b if a and b else None


def compare(result: dict) -> None:
    """Ratios into `result`: each mode against plain decoding with the same CPU library
    (`speedup_vs_plain`), adaptive against plain and the best fixed shape (`adaptive_vs`, per
    library: `adaptive@numpy` -> key `@numpy`), and each mode run with two libraries
    (`cpu_blas_vs`: mode@a / mode@b tokens/s, for every pair present)."""
    modes = result["modes"]
    libs = sorted({split_mode(m)[1] or "" for m in modes})
    for lib in libs:
        at = f"@{lib}" if lib else ""
        if "plain" + at not in modes:
            continue
        plain = modes["plain" + at]["rows"]
        result.setdefault("speedup_vs_plain", {}).update({
            mode: {B: m["rows"][B]["tokens_per_s"] / plain[B]["tokens_per_s"]
                   for B in m["rows"] if B in plain}
            for mode, m in modes.items() if mode != "plain" + at
            and (split_mode(mode)[1] or "") == lib})
        key = "decode_tokens_per_s"                    # the decode steps alone
        result.setdefault("speedup_vs_plain_decode", {}).update({
            mode: {B: m["rows"][B][key] / plain[B][key] for B in m["rows"]
                   if B in plain and key in m["rows"][B] and key in plain[B]}
            for mode, m in modes.items() if mode != "plain" + at
            and (split_mode(mode)[1] or "") == lib})
        fixed = [m for m in modes if m.startswith("eagle") and (split_mode(m)[1] or "") == lib
                 and not split_mode(m)[0].endswith(VARIANTS)]
        for name in ADAPTIVE_MODES:            # issue 15: vs plain and the best fixed
            if name + at not in modes:
                continue
            ad = modes[name + at]["rows"]
            # the same head's fixed shapes: the ones this adaptive mode chooses among
            head = [f for f in fixed if f.startswith("eagle3") == ("eagle3" in name)
                    and f.endswith("_random_draft") == name.endswith("_random_draft")]

            def best(among, B):
                return max([modes[f]["rows"][B]["tokens_per_s"] for f in among
                            if B in modes[f]["rows"]] + [plain[B]["tokens_per_s"]])
            vs = {B: {"plain": ad[B]["tokens_per_s"] / plain[B]["tokens_per_s"],
                      "best_fixed": ad[B]["tokens_per_s"] / best(fixed, B),
                      "best_fixed_same_head": ad[B]["tokens_per_s"] / best(head, B)}
                  for B in ad if B in plain}
            if at:
                result.setdefault(f"{name}_vs", {})[at] = vs
            else:
                result[f"{name}_vs"] = vs
    by_name: dict[str, dict[str, dict]] = {}
    for m in modes:
        name, lib = split_mode(m)
        if lib:
            by_name.setdefault(name, {})[lib] = modes[m]["rows"]
    for name, rows in by_name.items():
        for a in rows:
            for b in rows:
                if a != b:
                    result.setdefault("cpu_blas_vs", {})[f"{name}: {a} / {b}"] = {
                        B: rows[a][B]["tokens_per_s"] / rows[b][B]["tokens_per_s"]
                        for B in rows[a] if B in rows[b]}


def checks_vs_unchecked(result: dict) -> None:
    """Issue 13: the same step with and without its index checks, as shipped
    (`checked_vs_unchecked`, mode / mode_unchecked) and checked in every layer
    (`layerchecks_vs_unchecked`, mode_layerchecks / mode_unchecked)."""
    modes = result["modes"]
    for key, suffix in (("checked_vs_unchecked", ""), ("layerchecks_vs_unchecked",
                                                       "_layerchecks")):
        pairs = {m.removesuffix("_unchecked") + suffix: m for m in modes
                 if m.endswith("_unchecked") and m.removesuffix("_unchecked") + suffix in modes}
        if pairs:
            result[key] = {
                m: {B: {"tokens_per_s": modes[m]["rows"][B]["tokens_per_s"]
                        / modes[u]["rows"][B]["tokens_per_s"],
                        "step_wall": _profile_ratio(result, m, u, B, "host_wall_ms_per_step"),
                        "step_device": _profile_ratio(result, m, u, B, "device_ms_per_step")}
                    for B in modes[m]["rows"] if B in modes[u]["rows"]}
                for m, u in pairs.items()}


def chained_vs_1step(result: dict) -> None:
    """Multi-step decode and the speculative chains against one step a sync
    (`chained_vs_1step`, mode / mode_1step), and the Triton matrix-vector kernel against
    cuBLAS and the separate glue kernels (`gemv_vs_cublas`: mode_gemv / mode, or
    mode / mode_cublas now that the kernel is the default), and the verify's split-K
    extend against the unsplit kernel (`split_vs_nosplit`: mode / mode_xs1), and the decode's
    merge in its own launch against a separate kernel (`fused_merge_vs_separate`: mode_fmerge
    / mode), and PDL against none (`pdl_vs_none`: mode_pdl / mode, or mode / mode_nopdl now
    that it is the default): tokens/s."""
    modes = result["modes"]
    for key, suffix, gemv in (("chained_vs_1step", "_1step", False),
                              ("gemv_vs_cublas", "_gemv", True),
                              ("gemv_vs_cublas", "_cublas", False),
                              ("split_vs_nosplit", "_xs1", False),
                              ("fused_merge_vs_separate", "_fmerge", True),
                              ("pdl_vs_none", "_pdl", True),
                              ("pdl_vs_none", "_nopdl", False),
                              ("chain64_vs_default", "_k64", True),
                              ("prefill_graph_vs_eager", "_pg", True),
                              ("prefill_graph_vs_eager", "_nopg", False),
                              ("tile_cap_vs_none", "_gt1k", True),
                              ("extend_pdl_vs_none", "_xpdl", True),
                              ("rope_in_gemv_vs_separate", "_grope", True),
                              ("rope_in_gemv_vs_separate", "_nogrope", False),
                              ("decode_one_split_vs_shipped", "_sp1", True),
                              ("decode_four_splits_vs_shipped", "_sp4", True),
                              ("merge_in_o_proj_vs_separate", "_omerge", True),
                              ("decode_eight_splits_vs_shipped", "_sp8", True),
                              ("chain_graph_vs_replays", "_cg", True),
                              ("decode_prefetch_vs_none", "_dpf", True),
                              ("gemv_k_tile_2048_vs_1024", "_bk2k", True),
                              ("mlp_one_launch_vs_two", "_fmlp", True),
                              ("merge_and_o_one_launch_vs_two", "_mo", True),
                              ("fused_mlp_and_merge_o_vs_off", "_nofuse", False),
                              ("fused_mlp_and_merge_o_vs_off", "_fuse", True),
                              ("one_row_2d_vs_3d", "_r2d", True),
                              ("greedy_pick_split_vs_one_program", "_gp1", False)):
        pairs = {m.removesuffix(suffix): m for m in modes
                 if m.endswith(suffix) and m.removesuffix(suffix) in modes}
        if pairs:
            result.setdefault(key, {}).update({
                m: {B: {"tokens_per_s": (modes[v]["rows"][B]["tokens_per_s"]
                                         / modes[m]["rows"][B]["tokens_per_s"]) ** (
                                             1 if gemv else -1)}
                    for B in modes[m]["rows"] if B in modes[v]["rows"]}
                for m, v in pairs.items()})


def main(args) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",")]
    unknown = [m for m in modes if split_mode(m)[0] not in MODES]
    if unknown:
        raise ConfigError(f"bench: unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    if getattr(args, "prompts", None) is not None:      # a bad file fails before any engine
        from eaglekv.training.eval_draft import load_prompts
        load_prompts(args.prompts)
    floor = getattr(args, "floor", None)
    if floor and not os.path.isfile(floor):   # not after the modes' minutes (H100, 2026-12-07)
        raise ConfigError(f"bench: --floor {floor!r} is not a file (../shared/tools/"
                          f"graph_floor.py, copied into the tree or a carried folder)")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu", "torch": torch.__version__,
              "model": args.model, "model_short": os.path.basename(str(args.model)),
              "dtype": args.dtype, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "waves": getattr(args, "waves", 1),
              "prompts_file": getattr(args, "prompts", None),
              "command": args.command_line,
              # the switches that change what runs (e.g. EAGLEKV_GEMV): a figure is read
              # with them
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("EAGLEKV_")
                      and k != "EAGLEKV_CACHE"},
              "modes": {}}
    if args.llama8b and args.device.startswith("cuda"):
        # first, on a device nothing else has used yet: inside the whole bench it ran 76.9-77.7%
        # of its roofline after the modes (2026-12-06 01:29, H100) where a process of its own
        # ran 82-85% (16:10); `--llama8b-after` measures both in one process
        result["llama8b"] = {**llama8b_row(), "measured": "before the modes"}
    t = time.perf_counter()
    result["modes"] = run_modes(args, modes, batches)
    result["seconds"] = time.perf_counter() - t
    for mode, m in result["modes"].items():
        print(json.dumps({mode: {B: r["tokens_per_s"] for B, r in m["rows"].items()}}),
              flush=True)
    compare(result)
    checks_vs_unchecked(result)
    chained_vs_1step(result)
    if not args.no_hf:
        from eaglekv.model.loader import load_checkpoint
        ids = load_checkpoint(args.model).tokenizer.encode(PROMPT)
        result["hf_transformers"] = hf_row(args, ids)
    if getattr(args, "checks_replay", False) and args.device.startswith("cuda"):
        from eaglekv.model import LlamaForCausalLM
        from eaglekv.model.loader import load_checkpoint
        ckpt = load_checkpoint(args.model, dtype=getattr(torch, args.dtype))
        model = LlamaForCausalLM.from_fused(ckpt.config, ckpt.state_dict, "cuda",
                                            max_positions=1024)
        try:     # new on 2026-12-05 (night), not yet run on a GPU: a failure costs this row
            result["checks_replay"] = checks_replay_row(model)
        except Exception as e:                          # noqa: BLE001
            result["checks_replay"] = {"error": repr(e)}
        del model, ckpt
    if args.llama8b and getattr(args, "llama8b_after", False) and args.device.startswith("cuda"):
        result["llama8b_after_modes"] = {**llama8b_row(), "measured": "after the modes"}
    if getattr(args, "floor", None) and args.device.startswith("cuda"):
        result["floor"] = floor_or_error(args.floor)
        f = result["floor"].get("smollm2_shape", {}).get("compiled_graph_tok_s")
        if f and "plain" in result["modes"] and 1 in result["modes"]["plain"]["rows"]:
            row1 = result["modes"]["plain"]["rows"][1]
            result["plain_batch_1_vs_floor"] = row1["tokens_per_s"] / f
            if "decode_tokens_per_s" in row1:     # like for like: the floor is decode only
                result["plain_batch_1_decode_vs_floor"] = row1["decode_tokens_per_s"] / f
    text = json.dumps(result, indent=2)
    print(text)
    print(table(result))
    if any("decode_tokens_per_s" in r for m in result["modes"].values()
           for r in m["rows"].values()):
        print(table(result, "decode_tokens_per_s"))
    if any("full_batch_tokens_per_s" in r and int(b) > 1 for m in result["modes"].values()
           for b, r in m["rows"].items()):
        print(table(result, "full_batch_tokens_per_s"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        kind = "gpu" if args.device.startswith("cuda") else "cpu"
        stem = os.path.join(args.out, f"{kind}_bench_{args.dtype}")
        with open(stem + ".json", "w") as f:
            f.write(text + "\n")
        plot(result, stem + ".png")
