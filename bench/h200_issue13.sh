#!/usr/bin/env bash
# Issue 13 on the H200 (run from the tree root on the GPU machine, after the first half of the
# model was copied: see ../shared/tools/stage-smollm2):
#   bench/h200_issue13.sh bench   # assemble SmolLM2, `eaglekv bench --device cuda`, the floor
#   bench/h200_issue13.sh checks  # what the index checks cost (kernels, then checked vs unchecked)
#   bench/h200_issue13.sh chains  # speculative chains (and multi-step plain) vs one step a sync
#   bench/h200_issue13.sh gemv    # the gemv kernel: shipped split vs every matmul vs none, S5's
#                                 # verify in it (gemv8), checked vs unchecked (the kernel rewrites)
#   bench/h200_issue13.sh next    # the next run's modes (see the case below)
#   bench/h200_issue13.sh diag    # pg alone and adaptive's step trace (see the case below)
#   bench/h200_issue13.sh tiles   # the decode kernel's tile (bench/decode_tiles.py)
#   bench/h200_issue13.sh adaptive  # adaptive against its fixed shapes and plain
#   bench/h200_issue13.sh dot     # the gemv's tensor-core tile (5-16 rows): tilings, then engine
#   bench/h200_issue13.sh vdec    # a chain's verify via the decode kernel; adaptive with S7
#   bench/h200_issue13.sh ccost   # adaptive's cost cells as chains run vs as before; with S7
#   bench/h200_issue13.sh table   # issue 13's whole table as shipped, one process (~7 min):
#                                 # plain, the EAGLE-3 chains S3/S5/S7 and tree S4K2N8, the
#                                 # adaptive default, batch 1-64, HF, the 8B row, the floor
#   bench/h200_issue13.sh omerge  # the merge in the o projection, the parts, the 8B variants
#   bench/h200_issue13.sh rnd     # no staging: the same on a random SmolLM2-shaped model
#   bench/h200_issue13.sh fused   # no staging: the GPU suite with the opt-in fusions on, then
#                                 # plain against them (rnd), the one-row gemv form, explore_mlp
#   bench/h200_issue13.sh draft   # no staging: the draft's layer in the gemv layout and chains
#                                 # of twice the steps (random model), then their GPU tests
#   bench/h200_issue13.sh draftreal  # the same on the real model and head (staged): since
#                                 # 2026-12-07 the new defaults (8-row verify, draft gemv)
#                                 # against the old, plain at batch 1 / 2 / 4 / 8 / 64
#   bench/h200_issue13.sh plainreal  # no head needed: the 8B row, plain vs `plain_nog8` at
#                                 # batch 1-64, HF, the floor (the call carrying part b)
#   bench/h200_issue13.sh waves   # staged as draftreal: the fixed shapes and the adaptive default
#                                 # with B in flight, B x 4 in all (no drain to one straggler)
#   bench/h200_issue13.sh packs   # staged as draftreal: the prefill graphs packing a step's
#                                 # prefills (the default) against one request a replay
#                                 # (`_nopack`), waves
#   bench/h200_issue13.sh packsrnd  # no staging: the same on the random model, after the
#                                 # CUDA-graph tests
#   bench/h200_issue13.sh gate    # the adaptive default (S7 behind a gate) vs before it: held-out
#                                 # prompts at batch 1 and 4, the bench prompt at 1-64
#   bench/h200_issue13.sh tests [PATHS]     # the GPU tests (pytest -m gpu), log under $OUT
#                                 # (the whole suite takes ~7 min on an H100: split it, e.g.
#                                 # tests/kernels, then tests/speculative tests/engine ...)
#   bench/h200_issue13.sh memcheck [PATHS]  # the same under compute-sanitizer memcheck
# bench env: MODES, BATCHES (1,4,16,64), NEW_TOKENS, REPEATS (2; `adaptive`: 5), WAVES (1: one batch; K: B in flight, B x K
# in all), WSR (--waiting-served-ratio, 0: admit at once), FLOOR=0 to skip the floor (~140 s),
# LLAMA8B=" " to skip the 8B row (it runs before the modes; LLAMA8B_AFTER=1: again after them), PROMPTS=FILE for eval-draft-style prompts (request i takes prompt i), CHECKS_REPLAY=1 to replay the graphs checked and unchecked
# in alternation (`--checks-replay`). The modes need the shipped heads in the tree (eagle_* and
# adaptive the EAGLE-1/2 head, eagle3_* and adaptive_eagle3* the EAGLE-3 one): a slimmed
# tree carries them (.carry/slimmed/eaglekv/drafts/*) and copies them back first.
set -uo pipefail
export PYTHONPATH=.:.carry/pylib
M=/root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -f "$M" ] && [ -f .carry/smollm2/b/part.ab ]; then
  cat /root/smollm2/part.aa .carry/smollm2/b/part.ab > "$M"
  test "$(md5sum < "$M" | cut -d' ' -f1)" = "$(cat .carry/smollm2/b/md5)" || { echo "bad md5"; exit 1; }
fi
case "${1:-bench}" in
  bench)
    floor=()     # the floor runs inside the bench's process, after the modes (~140 s)
    [ "${FLOOR:-1}" = 1 ] && floor=(--floor .carry/graph_floor.py)
    timeout "${BENCH_TIMEOUT:-560}" python3 -m eaglekv.cli bench --device cuda --dtype bfloat16 \
      --model "$M" --new-tokens "${NEW_TOKENS:-256}" --repeats "${REPEATS:-2}" ${LLAMA8B:---llama8b} \
      ${LLAMA8B_AFTER:+--llama8b-after} ${floor[@]+"${floor[@]}"} ${CHECKS_REPLAY:+--checks-replay} ${PROMPTS:+--prompts "$PROMPTS"} \
      --batches "${BATCHES:-1,4,16,64}" --waves "${WAVES:-1}" \
      --waiting-served-ratio "${WSR:-0}" \
      --modes "${MODES:-plain,eagle_chain_S3K1N4,eagle_chain_S5K1N6,eagle_tree_S4K2N8,adaptive}" \
      --out "$OUT" 2>&1 | tail -c 20000 > "$OUT/bench.log"
    tail -6 "$OUT/bench.log"
    ;;
  checks)
    # what the index checks cost: the attention kernels' check variants pipelined and not
    # (bench/attention_checks.py, ~1 min), then the engine checked and unchecked
    # ("g": the check once a forward, then the layers unchecked, as shipped since 2026-12-05),
    # then the engine as shipped, checked in every layer (the way before) and unchecked
    python3 bench/attention_checks.py --variants "${VARIANTS:-0,1,g}" \
      --out "$OUT/attention_checks_h200.json" 2>&1 | tail -6
    MODES=${MODES:-plain,plain_unchecked,plain_layerchecks,eagle_chain_S5K1N6,eagle_chain_S5K1N6_unchecked,eagle_chain_S5K1N6_layerchecks} \
      BATCHES=${BATCHES:-1,64} LLAMA8B=${LLAMA8B:-" "} FLOOR=0 "$0" bench
    ;;
  chains)
    # the speculative chains (one sync for up to ceil(32 / (S + 1)) whole-step replays) and
    # multi-step plain decoding against one step a sync, in one process
    MODES=${MODES:-plain,plain_1step,eagle_chain_S5K1N6,eagle_chain_S5K1N6_1step,eagle3_chain_S5K1N6,eagle3_chain_S5K1N6_1step,eagle3_tree_S6K4N16,eagle3_tree_S6K4N16_1step,adaptive,adaptive_1step} \
      LLAMA8B=${LLAMA8B:-" "} FLOOR=0 "$0" bench
    ;;
  gemv)
    MODES=${MODES:-plain,plain_gemv,plain_cublas,eagle_chain_S5K1N6,eagle_chain_S5K1N6_gemv8,eagle_chain_S5K1N6_cublas,plain_unchecked} \
      BATCHES=${BATCHES:-1,2,4,16,64} LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  next)
    # the run planned after 2026-12-06 (one process, 12 modes and the 8B row): the RoPE
    # epilogue now on by default against off (nogrope), the prefill graphs (pg) alone, the
    # one-program greedy pick (gp1), S5 / S3 / EAGLE-3 and adaptive (both heads). The EAGLE-3
    # modes need its head in the tree (.carry/slimmed/eaglekv/drafts/*-eagle3, 28 MiB: a call of
    # its own)
    MODES=${MODES:-plain,plain_nogrope,plain_pg,plain_gp1,eagle_chain_S5K1N6,eagle_chain_S5K1N6_pg,eagle_chain_S3K1N4,eagle3_chain_S5K1N6,eagle3_tree_S6K4N16,adaptive,adaptive_pg,adaptive_eagle3_trees} \
      FLOOR=${FLOOR:-0} "$0" bench
    ;;
  diag)
    # 2026-12-06 (ninth session): the prefill graphs alone (pg) for plain, S5 and adaptive, and
    # adaptive's step trace (its rows' phases: choice, tokens and ms a step); no 8B row
    MODES=${MODES:-plain,plain_pg,eagle_chain_S5K1N6,eagle_chain_S5K1N6_pg,eagle_chain_S3K1N4,adaptive,adaptive_pg} \
      LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  adaptive)
    # issue 15 after the chained settings (2026-12-06): adaptive against every fixed shape of
    # its set and plain, prefill graphs on (the default since); no 8B row
    # five rounds (the median; on an H100 on 2026-12-06 one of two rounds ran every chain of
    # a batch-64 run ~1 ms slower, 7% of the run, and the median of two is their mean)
    MODES=${MODES:-plain,eagle_chain_S5K1N6,eagle_chain_S3K1N4,eagle_tree_S4K2N8,adaptive} \
      REPEATS=${REPEATS:-5} LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  dot)
    # 2026-12-06 (twelfth session): the gemv kernel's tensor-core tile for 5-16 rows. First its
    # tilings against cuBLAS (+ glue) at M = 6 and 16 (bench/explore_h200.py --parts gemvdot),
    # the tiling with the least summed time at M = 6 (S5's verify at batch 1) taken for the
    # engine runs (EAGLEKV_GEMV_DOT_CONFIG, unless set), then the engine with and without it
    if [ -z "${EAGLEKV_GEMV_DOT_CONFIG:-}" ]; then
      timeout "${SWEEP_TIMEOUT:-200}" python3 bench/explore_h200.py "$OUT" --parts gemvdot 2>&1 | tail -8
      EAGLEKV_GEMV_DOT_CONFIG=$(python3 - "$OUT/explore_h200.json" <<'PY'
import collections, json, sys
rows = json.load(open(sys.argv[1]))["gemvdot"]
tot = collections.Counter()
for r in rows:
    if r["M"] == 6:
        for c in r["configs"]:
            tot[(c["block_n"], c["block_k"], c["num_warps"])] += c["us"]
n = max(tot.values(), default=0) and sum(1 for r in rows if r["M"] == 6)
full = {k: v for k, v in tot.items()
        if sum(1 for r in rows if r["M"] == 6 for c in r["configs"]
               if (c["block_n"], c["block_k"], c["num_warps"]) == k) == n}
print(",".join(map(str, min(full, key=full.get))) if full else "16,128,4")
PY
)
      export EAGLEKV_GEMV_DOT_CONFIG
    fi
    echo "EAGLEKV_GEMV_DOT_CONFIG=$EAGLEKV_GEMV_DOT_CONFIG"
    MODES=${MODES:-plain,plain_dot,eagle_chain_S5K1N6,eagle_chain_S5K1N6_dot,eagle_chain_S5K1N6_dot_xpdl,eagle_tree_S4K2N8,eagle_tree_S4K2N8_dot} \
      BATCHES=${BATCHES:-1,4,16} LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  tiles)
    python3 bench/decode_tiles.py --out "$OUT/decode_tiles.json" 2>&1 | tail -8
    ;;
  next2)
    # second half (16 modes): sp4, gt1k, gp1 and pg for S5 and adaptive, PDL against none,
    # the checks (end to end and the checked / unchecked replays), the other fixed shapes
    # adaptive is compared with, EAGLE-3; no 8B row
    MODES=${MODES:-plain,plain_sp4,plain_gt1k,eagle_chain_S5K1N6_gemv8_gt1k,eagle_chain_S5K1N6_gp1,adaptive_pg,plain_nopdl,plain_unchecked,eagle_chain_S5K1N6,eagle_chain_S5K1N6_nopdl,eagle_chain_S5K1N6_unchecked,eagle_chain_S3K1N4,eagle3_chain_S5K1N6,eagle3_tree_S6K4N16,adaptive,adaptive_eagle3_trees} \
      CHECKS_REPLAY=${CHECKS_REPLAY-1} LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  vdec)
    # 2026-12-06 (thirteenth session, not yet run): a chain's verify through the decode kernel
    # (triton_backend.CHAIN_VERIFY_DECODE_MAX_TOKENS) against the extend kernel, and the
    # device's adaptive candidates with the 7-step chain added, in one process (needs both
    # heads' weights in eaglekv/drafts/); first its GPU tests (graph faults incl. the _vdec
    # configurations, the lossless checks)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/reliability/test_fault_graphs.py \
      tests/speculative/test_spec_gpu.py -k "vdec or decode_kernel or chains_equal" 2>&1 \
      | tail -c 20000 > "$OUT/gpu_tests_vdec.log"; tail -3 "$OUT/gpu_tests_vdec.log"
    MODES=${MODES:-plain,eagle_chain_S5K1N6,eagle_chain_S5K1N6_vdec,eagle3_chain_S5K1N6,eagle3_chain_S5K1N6_vdec,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_vdec,adaptive,adaptive_gpu_s7,adaptive_eagle3_gpu_s7} \
      REPEATS=${REPEATS:-3} LLAMA8B=${LLAMA8B:-" "} FLOOR=${FLOOR:-0} "$0" bench
    ;;
  table)
    # (carry .carry/graph_floor.py with the last staging call, or set FLOOR=0: the bench refuses
    # a missing floor file before the modes since 2026-12-07)
    # 2026-12-06 (fifteenth session, not yet run): the issue's must-show table in one call for
    # when an H200 is lent (stage the model and the EAGLE-3 head first, as for `ccost`)
    # (the adaptive default since the sixteenth session has the gated S7 chain;
    # adaptive_eagle3_base is the default before it)
    # (2026-12-06, seventeenth session: the 8B row runs first in the process now, before the
    # modes' engines; adaptive_eagle3_base left out for time, the `gate` phase compares it)
    MODES=${MODES:-plain,eagle3_chain_S3K1N4,eagle3_chain_S5K1N6,eagle3_chain_S7K1N8,eagle3_tree_S4K2N8,adaptive_eagle3} \
      BATCHES=${BATCHES:-1,4,16,64} REPEATS=${REPEATS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-570} \
      "$0" bench
    ;;
  omerge)
    # 2026-12-07 (nineteenth session, not yet run): the table's speculative modes with their
    # parts measured again, the split-K merge in the o projection (plain, at most 8 splits,
    # 8 warps; the adaptive default with it), the 8B row (before the modes) with its cuBLAS
    # and tiling variants, then the registers and stack of every kernel the process compiled
    MODES=${MODES:-plain,plain_omerge,plain_omerge_sp8,plain_omerge_om8w,eagle3_chain_S3K1N4,eagle3_chain_S7K1N8,eagle3_tree_S4K2N8,adaptive_eagle3,adaptive_eagle3_omerge} \
      BATCHES=${BATCHES:-1,4,64} REPEATS=${REPEATS:-2} FLOOR=${FLOOR:-0} \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-570} "$0" bench
    bash bench/triton_cache_regs.sh > "$OUT/cache_regs.txt" 2>&1
    ;;
  rnd)
    # 2026-12-07 (twentieth session): no staging needed. Copies the model's first half if it
    # was carried (.carry/smollm2/a, for a later call), then times the merge in the o
    # projection on a random SmolLM2-shaped model (plain decode's time does not depend on the
    # weights' values: EOS is ignored), with the chain graph, the decode prefetch, chains of 64
    # and K tiles of 2048; the parts of a speculative step (draft, verify, accept, extend) with
    # a random EAGLE-3 head (fixed shapes in the step graph: accept 1 changes no part's
    # kernels); the 8B variants; the cubins' registers
    if [ -f .carry/smollm2/a/part.aa ]; then mkdir -p /root/smollm2 && cp .carry/smollm2/a/part.aa /root/smollm2/; fi
    if [ -n "${EXPLORE_MLP:-}" ]; then     # the fused MLP's parts first (~30 s)
      timeout 120 python3 bench/explore_mlp.py --out "$OUT/explore_mlp.json" 2>&1 | tail -14
    fi
    python3 -c "import sys; sys.path.insert(0, 'bench'); from profile_step import make_model; make_model('/root/rnd')"
    mkdir -p "$OUT/omerge" "$OUT/l8b"
    timeout "${BENCH_TIMEOUT:-330}" python3 -m eaglekv.cli bench --device cuda --dtype bfloat16 \
      --model /root/rnd --draft random --new-tokens 256 --repeats "${REPEATS:-3}" --no-hf --table \
      --batches "${BATCHES:-1,4,64}" \
      --modes "${MODES:-plain,plain_omerge,plain_k64,plain_cg,plain_dpf,plain_bk2k,plain_omerge_dpf,plain_omerge_k64_cg,plain_omerge_k64_cg_dpf,plain_omerge_sp8_k64_cg_dpf,plain_omerge_k64_cg_dpf_bk2k,eagle3_chain_S3K1N4,eagle3_chain_S7K1N8}" \
      --out "$OUT/omerge" 2>&1 | tail -c 20000 > "$OUT/omerge/bench.log"
    tail -4 "$OUT/omerge/bench.log"
    # TESTS_FILES: the test files (default below); TESTS_K="": every test in them
    timeout "${TESTS_TIMEOUT:-100}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      ${TESTS_FILES:-tests/engine/test_cuda_graph.py tests/engine/test_triton_backend.py tests/kernels/test_attention_triton.py tests/kernels/test_fused_mlp.py} \
      -k "${TESTS_K-chain_graph or chain-graph or merge_in_the_o or prefetch or fused_mlp or next_layer or accumulates}" \
      > "$OUT/gpu_tests_rnd.log" 2>&1
    tail -2 "$OUT/gpu_tests_rnd.log"
    [ -n "${SKIP_8B:-}" ] || EAGLEKV_BENCH_8B_VARIANTS=${VARIANTS_8B:-bare_cublas,all_cublas,bare_cublas_block_k2048_grope} \
      timeout "${L8B_TIMEOUT:-160}" python3 -m eaglekv.cli bench --device cuda --dtype bfloat16 \
      --model /root/rnd --new-tokens 64 --repeats 1 --no-hf --table --batches 1 --modes plain \
      --llama8b --out "$OUT/l8b" 2>&1 | tail -c 20000 > "$OUT/l8b/bench.log"
    tail -4 "$OUT/l8b/bench.log"
    bash bench/triton_cache_regs.sh > "$OUT/cache_regs.txt" 2>&1
    ;;
  fused)
    # 2026-12-07 (twenty-first session, for the next loan; no staging): the GPU suite's graph,
    # speculative and fault files with the two opt-in fusions on (the MLP in one launch, merge
    # + o in one: 5 spec tests failed with them on an H100 before make_predictable's stale
    # copy of down was fixed), then plain vs them on the random model (`rnd`), with the
    # one-row gemv form and the fused MLP's parts
    EAGLEKV_FUSE_MLP=1 EAGLEKV_MERGE_O=1 PYTHONPATH=.:.carry/pylib timeout "${TESTS_TIMEOUT:-300}" \
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/speculative/test_spec_gpu.py \
      tests/engine/test_cuda_graph.py tests/reliability/test_fault_graphs.py \
      tests/engine/test_triton_backend.py tests/kernels/test_fused_mlp.py \
      > "$OUT/gpu_tests_fused_on.log" 2>&1
    tail -3 "$OUT/gpu_tests_fused_on.log"
    EXPLORE_MLP=1 MODES=${MODES:-plain,plain_fuse,plain_fuse_r2d,plain_r2d,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_fuse,eagle3_chain_S7K1N8_fuse_mo8} \
      BATCHES=${BATCHES:-1,4,16,64} TESTS_TIMEOUT=1 SKIP_8B=${SKIP_8B:-1} "$0" rnd
    ;;
  draft)
    # 2026-12-07 (twenty-second session, for the next loan; no staging, ~9 min): the
    # speculative step's levers built without a GPU. First the verify window's kernels alone
    # (~3 min): the MLP at 8 rows (fused in row groups, the unfused gemvs in row groups,
    # cuBLAS + glue), each SmolLM2 matmul at 6 / 8 rows in row groups against cuBLAS (+ glue);
    # then on the random model (`rnd`): the draft's layer in the gemv layout (`_dgemv`),
    # chains of twice the steps (`_sx2`), the MLP and merge + o to 8 rows (`_mlp8_mo8`), the
    # qkv in row groups (`_g8`), all three (`_g8_mlp8_mo8`, a verify layer in four launches),
    # and with `_dgemv`; then their GPU tests
    timeout 90 python3 bench/explore_mlp.py --rows 8 --out "$OUT/explore_mlp8.json" 2>&1 | tail -14
    timeout 120 python3 bench/explore_h200.py "$OUT/explore" --parts gemvgroups 2>&1 | tail -12
    MODES=${MODES:-plain,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_dgemv,eagle3_chain_S7K1N8_sx2,eagle3_chain_S7K1N8_mlp8_mo8,eagle3_chain_S7K1N8_g8,eagle3_chain_S7K1N8_g8_mlp8_mo8,eagle3_chain_S7K1N8_g8_mlp8_mo8_dgemv,eagle3_chain_S3K1N4,eagle3_chain_S3K1N4_dgemv} \
      BATCHES=${BATCHES:-1,4,64} REPEATS=${REPEATS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-250} \
      TESTS_TIMEOUT=${TESTS_TIMEOUT:-90} SKIP_8B=${SKIP_8B:-1} \
      TESTS_FILES="tests/engine/test_triton_backend.py tests/speculative/test_graph_buffers.py tests/kernels/test_fused_mlp.py tests/kernels/test_gemv_rope.py tests/kernels/test_fused_triton.py" \
      TESTS_K="draft_layer or chain_x or fused_mlp or row_groups" "$0" rnd
    ;;
  draftreal)
    # the same on the real model and the shipped EAGLE-3 head (stage both first, as `table`).
    # 2026-12-07 (twenty-third session): the 8-row verify and the draft's gemv layer are the
    # default since (timed on the random model only): the modes compare the new defaults with
    # the old (`_nog8_mlp1_mo4_nodgemv`), plain at batch 2 and 8 too (5-8 rows take the row
    # groups now; `plain_nog8` as before)
    MODES=${MODES:-plain,plain_nog8,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_nog8_mlp1_mo4_nodgemv,eagle3_chain_S5K1N6,eagle3_chain_S5K1N6_nog8_mlp1_mo4_nodgemv,eagle3_chain_S3K1N4,eagle3_chain_S3K1N4_nodgemv,adaptive_eagle3,adaptive_eagle3_nog8_mlp1_mo4_nodgemv} \
      BATCHES=${BATCHES:-1,2,4,8,64} REPEATS=${REPEATS:-2} FLOOR=0 LLAMA8B=" " \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-560} "$0" bench
    ;;
  plainreal)
    # 2026-12-07 (twenty-third session, for the next loan): what needs the model but not a
    # head, for the call that carries the model's second half (.carry/smollm2/b and
    # .carry/graph_floor.py): the 8B row first, then plain as shipped against the row groups
    # off (`plain_nog8`: 5-8 rows to cuBLAS as before 2026-12-07) at batch 1-64, HF, the floor
    MODES=${MODES:-plain,plain_nog8} BATCHES=${BATCHES:-1,2,4,8,16,64} REPEATS=${REPEATS:-2} \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-500} "$0" bench
    ;;
  waves)
    # 2026-12-07 (twenty-fourth session, for the next loan; stage the model and the EAGLE-3
    # head as `draftreal`): from batch 8 on, the one-batch bench drains to its slowest request
    # and S3 beat S7 (17497 vs 13935 tok/s at b8, H100) while the adaptive default ran S7 / S5
    # (13585). With B requests in flight and B x WAVES in all (a finished one's place refilled
    # at once, as a server's) the drain is one wave's tail of WAVES: does the default's choice
    # hold there, and does S3 still win?
    MODES=${MODES:-plain,eagle3_chain_S3K1N4,eagle3_chain_S5K1N6,eagle3_chain_S7K1N8,adaptive_eagle3} \
      BATCHES=${BATCHES:-4,8,16} WAVES=${WAVES:-4} REPEATS=${REPEATS:-2} FLOOR=0 LLAMA8B=" " \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-540} "$0" bench
    ;;
  packs)
    # 2026-12-07 (twenty-seventh session, not yet run on the real model): the prefill graphs
    # packing a step's prefills (up to 16 requests a replay, up to 4 replays; the default
    # since 2026-12-08) against one request a replay and a step of several prefills eager
    # (`_nopack`), with refilled batches as `waves` (each wave's admissions prefill together);
    # plain needs the model only, the EAGLE-3 modes the head too (MODES=... per call)
    # (since 2026-12-08 packing is the default: the `_nopack` modes are the old way)
    MODES=${MODES:-plain,plain_nopack,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_nopack,adaptive_eagle3,adaptive_eagle3_nopack} \
      BATCHES=${BATCHES:-4,8,16} WAVES=${WAVES:-4} REPEATS=${REPEATS:-2} FLOOR=0 LLAMA8B=" " \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-400} "$0" bench
    ;;
  packsrnd)
    # the same without staging, on the random SmolLM2-shaped model (12-token prompts, EOS
    # ignored: plain's time does not depend on the weights) and a random EAGLE-3 head; first
    # the CUDA-graph tests (the packed prefills among them)
    timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      ${TESTS_FILES:-tests/engine/test_cuda_graph.py} > "$OUT/gpu_tests_packs.log" 2>&1
    tail -2 "$OUT/gpu_tests_packs.log"
    python3 -c "import sys; sys.path.insert(0, 'bench'); from profile_step import make_model; make_model('/root/rnd')"
    mkdir -p "$OUT/packs"
    timeout "${BENCH_TIMEOUT:-300}" python3 -m eaglekv.cli bench --device cuda --dtype bfloat16 \
      --model /root/rnd --draft random --new-tokens 256 --repeats "${REPEATS:-2}" --no-hf --table \
      --batches "${BATCHES:-4,16,64}" --waves "${WAVES:-4}" --waiting-served-ratio 0 \
      --modes "${MODES:-plain,plain_nopack,eagle3_chain_S7K1N8,eagle3_chain_S7K1N8_nopack}" \
      --out "$OUT/packs" 2>&1 | tail -c 20000 > "$OUT/packs/bench.log"
    tail -8 "$OUT/packs/bench.log"
    ;;
  gate)
    # 2026-12-06 (sixteenth session): the adaptive default with the 7-step chain behind its
    # gate (config.ADAPTIVE_GATED_SHAPES) against the default before it (adaptive_eagle3_base),
    # as `ccost`: the held-out prompts (where ungated S7 lost), then the bench prompt at every
    # batch (where the fixed S7 wins)
    base="$OUT"
    mkdir -p "$base/heldout" "$base/bench"
    OUT="$base/heldout" MODES=${MODES_HELDOUT:-plain,eagle3_chain_S3K1N4,eagle3_chain_S5K1N6,adaptive_eagle3,adaptive_eagle3_base} \
      PROMPTS=bench/data/heldout_prompts_smollm2.json NEW_TOKENS=128 BATCHES=1,4 REPEATS=3 \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} LLAMA8B=" " FLOOR=0 "$0" bench
    OUT="$base/bench" MODES=${MODES_BENCH:-plain,eagle3_chain_S5K1N6,eagle3_chain_S7K1N8,adaptive_eagle3,adaptive_eagle3_base} \
      BATCHES=1,4,16,64 REPEATS=2 BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} LLAMA8B=" " FLOOR=0 "$0" bench
    ;;
  ccost)
    # 2026-12-06 (fourteenth session; run 15:25 in the fifteenth): adaptive's cost cells as chains
    # run (adaptive_worker.CHAINED_COSTS, on by default since) against the policy as it was
    # (the `_rawcost` modes), and with S7 among the candidates: the held-out prompts (where the
    # old one ran S5 at 1.10x plain beside the fixed S3's 1.30x), then the bench prompt at every
    # batch (needs the EAGLE-3 head's weights in eaglekv/drafts/)
    base="$OUT"
    mkdir -p "$base/heldout" "$base/bench"
    OUT="$base/heldout" MODES=${MODES_HELDOUT:-plain,eagle3_chain_S3K1N4,eagle3_chain_S5K1N6,adaptive_eagle3,adaptive_eagle3_rawcost,adaptive_eagle3_gpu_s7} \
      PROMPTS=bench/data/heldout_prompts_smollm2.json NEW_TOKENS=128 BATCHES=1,4 REPEATS=3 \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} LLAMA8B=" " FLOOR=0 "$0" bench
    OUT="$base/bench" MODES=${MODES_BENCH:-plain,eagle3_chain_S5K1N6,eagle3_chain_S7K1N8,adaptive_eagle3,adaptive_eagle3_rawcost,adaptive_eagle3_gpu_s7} \
      BATCHES=1,4,16,64 REPEATS=2 BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} LLAMA8B=" " FLOOR=0 "$0" bench
    ;;
  tests)
    shift
    python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/server "${@:-tests}" 2>&1 \
      | tail -c 30000 > "$OUT/gpu_tests.log"
    tail -30 "$OUT/gpu_tests.log"
    ;;
  memcheck)
    # one file at a time, each its own log and time limit (MEMCHECK_TIMEOUT, 400 s): a call
    # cut by its limit still brings back every file finished before (on 2026-12-07 one call
    # over three files was cut after 51 tests with nothing but the dots to show)
    shift
    args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(tests/engine/test_cuda_graph.py tests/speculative/test_spec_gpu.py)
    for f in "${args[@]}"; do
      log="$OUT/memcheck_$(basename "${f%.py}").log"
      timeout "${MEMCHECK_TIMEOUT:-400}" compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "$f" > "$log" 2>&1
      echo "$f rc=$?"; tail -3 "$log"
    done
    ;;
esac
