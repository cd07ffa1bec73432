#!/usr/bin/env bash
# Apply pymtp's patches to the pinned llama.cpp source.
#
#   vendor/llama.cpp/patches/apply.sh DIR
#
# DIR is an unpacked llama-cpp-python 0.3.36 sdist (it holds vendor/llama.cpp) or the
# llama.cpp tree itself. Each patch is applied once: one already in the tree is skipped,
# one that does not fit stops the script before anything is changed by it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:?usage: apply.sh DIR (an unpacked llama-cpp-python sdist or a llama.cpp tree)}
[ -d "$dir/vendor/llama.cpp" ] && dir="$dir/vendor/llama.cpp"
[ -d "$dir/ggml/src" ] || { echo "apply.sh: $dir is not a llama.cpp tree (no ggml/src)"; exit 2; }
for p in "$here"/*.patch; do
  name=$(basename "$p")
  if patch -d "$dir" -p1 -R --dry-run -s -f < "$p" > /dev/null 2>&1; then
    echo "$name: already applied"
  elif patch -d "$dir" -p1 --dry-run -s -f < "$p" > /dev/null 2>&1; then
    patch -d "$dir" -p1 -s -f < "$p"
    echo "$name: applied"
  else
    echo "$name: does not apply to $dir (is it llama-cpp-python 0.3.36's llama.cpp?)"; exit 1
  fi
done
