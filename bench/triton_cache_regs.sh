#!/usr/bin/env bash
# Registers and stack (spills) of every kernel in Triton's cache, as compiled on this machine:
# run on the GPU machine after a bench (`bench/triton_cache_regs.sh > $OUT/cache_regs.txt`).
# Why: compiled offline here (Triton 3.9, its ptxas 13.4, sm_90a) `_gemv_kernel` at one row x
# 8 x 1024 reports REG:32 STACK:4320 (the PTX's `.reqntid 128`; without it 255 registers and
# 6.4 KB of spills), which would make the decode's matmuls spill; whether the device's own
# builds do is what this prints. Output: kernel name, REG, STACK, one line per cubin.
set -uo pipefail
CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
DUMP=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
find "$CACHE" -name '*.cubin' | while read -r f; do
  "$DUMP" --dump-resource-usage "$f" 2>/dev/null \
    | awk -v f="$(basename "$f" .cubin)" '/Function/ {fn=$2} /REG:/ {print f, fn, $1, $2}'
done | sort | uniq -c | sort -k2
