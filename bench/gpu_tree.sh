#!/usr/bin/env bash
# The working tree a GPU call sends is at most 64 MiB together with what it carries, and a
# model part of SmolLM2 is 47 MiB: for the staging calls the heavy tracked files (the draft
# heads, bench/results, the kept training data) leave the tree for a while.
#   bench/gpu_tree.sh slim      # move them under .carry/slimmed/ (git-ignored); print the size
#   bench/gpu_tree.sh restore   # move them back; fails loudly if anything is missing
#   bench/gpu_tree.sh size      # what a call would send (tree without .git, .venv, .carry)
#   bench/gpu_tree.sh pylib     # .carry/pylib: gguf and yaml for the GPU machine's python, with
#                               # their dist-info (transformers reads gguf's version from it:
#                               # without it, loading a GGUF fails with "Invalid version: 'N/A'");
#                               # and .carry/graph_floor.py (../shared/tools)
# While slimmed, `git status` shows them deleted: restore before committing. The shipped heads
# then travel in a later call (e.g. with .carry/pylib only) or are not needed (a head trained
# on the machine, /root/head3).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
HEAVY=(eaglekv/drafts/smollm2-135m-instruct-eagle3/model.safetensors
       eaglekv/drafts/smollm2-135m-instruct-eagle/model.safetensors
       bench/results bench/data/selfgen_smollm2_v2 bench/data/selfgen_smollm2_v3
       bench/data/selfgen_smollm2_v4)
keep="$root/.carry/slimmed"
grep -qxF '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude

size() {
  du -sm --exclude=.git --exclude=.venv --exclude=.carry --exclude=__pycache__ . | cut -f1
}

case "${1:-size}" in
  slim)
    for p in "${HEAVY[@]}"; do
      if [ -e "$p" ]; then
        mkdir -p "$keep/$(dirname "$p")"
        [ -e "$keep/$p" ] && { echo "gpu_tree: $keep/$p exists: restore first" >&2; exit 1; }
        mv "$p" "$keep/$p"
      fi
    done
    echo "slimmed: the tree is $(size) MiB (restore with: bench/gpu_tree.sh restore)"
    ;;
  restore)
    for p in "${HEAVY[@]}"; do
      if [ -e "$keep/$p" ]; then
        [ -e "$p" ] && { echo "gpu_tree: $p exists and $keep/$p too: compare by hand" >&2; exit 1; }
        mkdir -p "$(dirname "$p")"
        mv "$keep/$p" "$p"
      fi
    done
    missing=$(git ls-files --deleted)
    [ -z "$missing" ] || { echo "gpu_tree: still missing: $missing" >&2; exit 1; }
    echo "restored: the tree is $(size) MiB, no tracked file missing"
    ;;
  size)
    echo "$(size) MiB"
    ;;
  pylib)
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf .carry/pylib && mkdir -p .carry/pylib
    for pkg in gguf yaml; do cp -r "$site/$pkg" .carry/pylib/; done
    cp -r "$site"/gguf-*.dist-info "$site"/[Pp]y[Yy][Aa][Mm][Ll]-*.dist-info .carry/pylib/
    [ -f ../shared/tools/graph_floor.py ] && cp ../shared/tools/graph_floor.py .carry/
    echo "pylib: $(du -sm .carry/pylib | cut -f1) MiB ($(ls .carry/pylib | tr '\n' ' '))"
    ;;
  *)
    echo "usage: bench/gpu_tree.sh slim|restore|size|pylib" >&2; exit 2
    ;;
esac
