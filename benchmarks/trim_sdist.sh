#!/usr/bin/env bash
# Make a small tarball of the pinned llama-cpp-python 0.3.36 source (76 MB -> ~6 MB) to
# carry to a machine without network: no models, docs, media, UI sources, tests, git
# history or ggml backends other than CPU and CUDA.
#
#   benchmarks/trim_sdist.sh OUT.tgz
set -euo pipefail
out=$(realpath -m "${1:?usage: trim_sdist.sh OUT.tgz}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp" >/dev/null
mkdir "$tmp/src"
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp/src" --strip-components=1
cd "$tmp/src"
rm -rf .git docs examples tests docker .github
cd vendor/llama.cpp
rm -rf models docs media benches tests skills gguf-py conversion .github .devops
# the UI's CMake files are read even with LLAMA_BUILD_UI=OFF; its sources are not
find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name sources.cmake ! -name '*.in' -exec rm -rf {} +
rm -rf examples/*/
cd ggml/src
for d in ggml-*/; do
  case "$d" in ggml-cpu/|ggml-cuda/) ;; *) rm -rf "$d" ;; esac
done
tar czf "$out" -C "$tmp" src
ls -l "$out"
