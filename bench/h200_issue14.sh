#!/usr/bin/env bash
# Issue 14 on the H200, phases in order, several per call (the machine keeps /root while warm):
#   bench/h200_issue14.sh gen          # the target writes prompts and answers them -> $R/sg
#                                      # (GEN_DIR=/root/sg2 SEED=2: a second store beside it)
#   bench/h200_issue14.sh train        # EAGLE-3 + TTT on $R/sg (DATA_DIR=/root/sg,/root/sg2:
#                                      # several stores; resumes $R/ckpt.pt; INIT_FROM=
#                                      # eaglekv/drafts/smollm2-135m-instruct-eagle3 goes on
#                                      # from the shipped head)
#                                      # (WIDTH=3072: a wider MLP grown from INIT_FROM's
#                                      # function; AUX_LAYERS=1,14,28: other target layers;
#                                      # TOPK_WEIGHT=1: HASS's top-10 distillation term)
#   bench/h200_issue14.sh eval         # eval-draft of $R/head3 on the held-out prompts, b1
# Stage the model first (part a in one call, part b carried in the next; h200_issue13.sh).
# A machine kept /root across calls only sometimes (2026-12-04: lost between a 430 s gen call
# and the next): gen returns its shards under $OUT/sg, so a later call can carry them in
# (DATA_DIR=.carry/sg) after the model is staged again. bench/data/selfgen_smollm2_v2/ holds
# the shipped head's data (9.5 MB): with a model part (47 MB) only ~17 MB of tree fits in a
# call, so for the staging calls `bench/gpu_tree.sh slim` moves the draft heads, bench/results
# and that folder under .carry/slimmed (tree 4 MB); carry the folder with part a
# (carry [".carry/smollm2/a", ".carry/slimmed/bench/data/selfgen_smollm2_v2"], command
# `cp -r .carry/slimmed/bench/data/selfgen_smollm2_v2 /root/sg && cp .carry/smollm2/a/part.aa
# /root/smollm2/`), then part b (a short call: the model is assembled), then a third call
# that trains, carrying the shipped head (28 MB, .carry/slimmed/eaglekv/drafts/...-eagle3 with
# its config.json copied beside it) for INIT_FROM; short calls keep the machine warm, a long one
# may not. `bench/gpu_tree.sh restore` after.
# Two stores (2026-12-06, the v5 head; both kept: bench/data/selfgen_smollm2_v2 and _v3, each
# ~9.5 MB, slimmed with the rest): call 1 carries part a + _v2 (`cp -r
# .carry/slimmed/bench/data/selfgen_smollm2_v2 /root/sg`), call 2 part b + .carry/pylib + a copy
# of _v3 as .carry/sg2 (`bench/h200_issue14.sh` alone assembles the model; then `cp -r
# .carry/sg2 /root/sg2`), call 3 the shipped head + .carry/pylib: `INIT_FROM=... DATA_DIR=
# /root/sg,/root/sg2 MAX_TOKENS=24576 bench/h200_issue14.sh train` with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. The features of both (9.4M tokens) are 43 GB
# on the GPU; a third store goes to host memory by itself (`--features-on auto`).
# Three stores (2026-12-06 11:1x, the v6 head; _v4 the third, 6.7 MB): part a + _v2 -> /root/sg;
# part b + .carry/pylib + a copy of _v3 as .carry/sg2 (-> /root/sg2), then in the same call
# `GEN_DIR=/root/sg3 SEED=3 GEN_BUDGET=330 ... gen` made the third (or carry _v4 in a short
# call); the drafts + pylib (copy the EAGLE-3 head to /root/drafts/ for INIT_FROM); then
# DATA_DIR=/root/sg,/root/sg2,/root/sg3 TRAIN_TOTAL=440 DEADLINE=530: 58 GB of features in host
# memory, 145 s for the feature pass, 3.0 steps/s. `eval` reads $R/sg/heldout_prompts.json:
# copy bench/data/heldout_prompts_smollm2.json there first.
set -uo pipefail
export PYTHONPATH=.:.carry/pylib
M=${MODEL:-/root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
DEV=${DEV:-cuda}
R=${ROOT_DIR:-/root}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "$DEV" = cuda ] && [ ! -f "$M" ] && [ -f .carry/smollm2/b/part.ab ]; then
  mkdir -p "$(dirname "$M")"; cat /root/smollm2/part.aa .carry/smollm2/b/part.ab > "$M"
  test "$(md5sum < "$M" | cut -d' ' -f1)" = "$(cat .carry/smollm2/b/md5)" || { echo "bad md5"; exit 1; }
fi
for phase in "$@"; do
  echo "== $phase $(date -u +%T)"
  case "$phase" in
    gen)
      G=${GEN_DIR:-$R/sg}
      python3 -m eaglekv.cli train-draft gen-data --model "$M" --out "$G" --device "$DEV" \
        --budget "${GEN_BUDGET:-280}" --n-prompts "${N_PROMPTS:-40000}" --max-new "${MAX_NEW:-256}" \
        --greedy-frac "${GREEDY_FRAC:-0.5}" --write-frac "${WRITE_FRAC:-0.5}" --seed "${SEED:-0}" \
        --no-progress > "$OUT/gen.log" 2>&1
      echo "rc=$?"; tail -4 "$OUT/gen.log"
      # the shards come back too (uint16 ids, ~10 MB for 3.6M response tokens): the machine may
      # be gone by the next call, and then the training call carries them in (DATA_DIR)
      mkdir -p "$OUT/sg" && cp "$G"/manifest.json "$G"/data-*.safetensors "$OUT/sg/"
      ;;
    train)
      dirs=(); IFS=, read -ra ds <<< "${DATA_DIR:-$R/sg}"
      for d in "${ds[@]}"; do dirs+=(--data-dir "$d"); done
      python3 -m eaglekv.cli train-draft train --algorithm eagle3 --model "$M" "${dirs[@]}" \
        --out $R/head3 --ckpt $R/ckpt.pt ${RESUME:+--resume} --device "$DEV" \
        ${INIT_FROM:+--init-from "$INIT_FROM"} ${WIDTH:+--intermediate-size "$WIDTH"} \
        ${AUX_LAYERS:+--aux-layers "$AUX_LAYERS"} ${TOPK_WEIGHT:+--topk-weight "$TOPK_WEIGHT"} \
        --train-budget "${TRAIN_TOTAL:-480}" --deadline "${DEADLINE:-270}" --lr "${LR:-6e-4}" \
        --warmup 100 --max-tokens "${MAX_TOKENS:-32768}" --draft-vocab "${VOCAB:-16384}" \
        --ttt-steps 7 --eval-every-s 60 --log "$OUT/train_log${RESUME:+_resumed}.json" 2>&1 \
        | tr '\r' '\n' | grep -v "step/s]$" | tail -c 12000 > "$OUT/train${RESUME:+_resumed}.log"
      echo "rc=${PIPESTATUS[0]}"; grep -E "eval|vocab|features|saved" "$OUT/train${RESUME:+_resumed}.log" | tail -6
      # the head (lm_head alone may pass a returned file's 16 MiB) as a split tar
      tar cf - -C $R head3 | split -b 15M - "$OUT/head3.tar.part."
      ;;
    eval)
      python3 -m eaglekv.cli eval-draft --model "$M" --spec eagle3 --draft $R/head3 \
        --prompts $R/sg/heldout_prompts.json --max-prompts "${EVAL_PROMPTS:-40}" \
        --max-new-tokens 128 --device "$DEV" --dtype "${DTYPE:-bfloat16}" \
        --shapes "${SHAPES:-S3K1N4,S5K1N6,tree:S4K2N8,tree:S6K4N16,tree:S7K4N24}" --temperatures "${TEMPS:-0,0.7}" \
        ${ALSO_DRAFT:+--also-draft "$ALSO_DRAFT"} \
        --out "$OUT/eval_draft_eagle3_h200.json" > "$OUT/eval.log" 2>&1
      echo "rc=$?"; tail -12 "$OUT/eval.log"
      ;;
  esac
done
