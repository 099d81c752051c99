#!/usr/bin/env bash
# The GPU machine (python 3.12, no package registry) has no fastapi, uvicorn, starlette,
# pydantic or prometheus-client, which `eaglekv serve` and so bench/soak_gpu.py need. This
# downloads their cp312 manylinux wheels here (pydantic-core is the one compiled wheel) and
# unpacks them under .carry/pylib_server (git-ignored, 13 MiB), to be carried with a call.
# With the full tree (53 MiB) that passes the 64 MiB a call sends, so the soak call goes out
# slimmed (bench/gpu_tree.sh slim) and carries the EAGLE head it serves with:
#   bench/gpu_server_pylib.sh; bench/gpu_tree.sh slim      # after staging the model
#   carry [".carry/pylib", ".carry/pylib_server",
#          ".carry/slimmed/eaglekv/drafts/smollm2-135m-instruct-eagle/model.safetensors"]
#   cp .carry/slimmed/eaglekv/drafts/smollm2-135m-instruct-eagle/model.safetensors \
#      eaglekv/drafts/smollm2-135m-instruct-eagle/ &&
#   PYTHONPATH=.:.carry/pylib:.carry/pylib_server python3 bench/soak_gpu.py \
#       --model /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --out $OUT
#   bench/gpu_tree.sh restore
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PIP=${PIP:-.venv/bin/pip}
dest=.carry/pylib_server
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PIP" download -q -d "$tmp" --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  fastapi uvicorn prometheus-client
rm -rf "$dest" && mkdir -p "$dest"
for w in "$tmp"/*.whl; do
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$dest"
done
grep -qxF '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
echo "unpacked $(ls "$tmp" | wc -l) wheels into $dest ($(du -sm "$dest" | cut -f1) MiB)"
