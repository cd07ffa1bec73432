#!/usr/bin/env bash
# Build llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors (the same
# source pymtp runs on), so both are measured with the same kernels.
#
#   benchmarks/build_llama_server.sh [OUT_DIR] [cpu|cuda] [SDIST.tgz]
#
# cpu:  a native CPU build (what pip builds for pymtp).
# cuda: -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 (H100), shared libraries, so the
#       same build also serves pymtp through LLAMA_CPP_LIB_PATH=OUT_DIR/build-cuda/bin.
# The source is downloaded with pip (not committed), or unpacked from SDIST.tgz (see
# trim_sdist.sh) where there is no network; the binary lands in OUT_DIR/bin.
# PYMTP_PATCHES=1 applies vendor/llama.cpp/patches/ first (batch-invariant CUDA kernels,
# switched on at run time by GGML_CUDA_BATCH_INVARIANT=1; see docs/exactness.md).
# CCCL_INCLUDE=DIR (cuda): compile the CUDA kernels against the CCCL headers in DIR (cub/,
# thrust/, cuda/, nv/; e.g. the cuda-cccl wheel's cuda/cccl/headers/include) before the
# toolkit's own. ggml's in-graph top_k (backend sampling's first filter) is CUB's DeviceTopK
# from CCCL 3.2 on; older CCCL (CUDA 13.0 ships 3.0) sorts the whole row instead.
# It also builds rpc-server (OUT_DIR/bin/rpc-server-BACKEND), the worker of a model split
# across hosts (README, "Several hosts"), with -DGGML_RPC=ON in a build folder of its own,
# so llama-server stays the build the benchmarks measured. PYMTP_RPC_SERVER_BUILD=0 skips it.
set -euo pipefail
out=$(realpath -m "${1:-build/llama-server}")
backend=${2:-cpu}
mkdir -p "$out"
src="$out/src"
if [ ! -d "$src/vendor/llama.cpp" ] && [ -n "${3:-}" ]; then
  mkdir -p "$src"
  tar xzf "$3" -C "$src" --strip-components=1
fi
if [ ! -d "$src/vendor/llama.cpp" ]; then
  tmp=$(mktemp -d)
  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp" >/dev/null
  mkdir -p "$src"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$src" --strip-components=1
  rm -rf "$tmp"
fi
if [ "${PYMTP_PATCHES:-0}" = 1 ]; then
  bash "$(dirname "$0")/../vendor/llama.cpp/patches/apply.sh" "$src"
fi
flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF)
targets=(llama-server)
if [ "$backend" = cuda ]; then
  flags+=(-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON)
  [ -n "${CCCL_INCLUDE:-}" ] && flags+=("-DCMAKE_CUDA_FLAGS=-I$(realpath "$CCCL_INCLUDE")")
  targets+=(llama)
else
  flags+=(-DBUILD_SHARED_LIBS=OFF)
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/vendor/llama.cpp" -B "$out/build-$backend" "${gen[@]}" "${flags[@]}" >/dev/null
cmake --build "$out/build-$backend" --target "${targets[@]}" -j "$(nproc)"
mkdir -p "$out/bin"
cp "$out/build-$backend/bin/llama-server" "$out/bin/llama-server-$backend"
echo "$out/bin/llama-server-$backend"
if [ "${PYMTP_RPC_SERVER_BUILD:-1}" = 1 ]; then
  # the worker needs ggml only; BUILD_SHARED_LIBS=OFF makes one binary to copy to workers
  rpc_flags=("${flags[@]}" -DGGML_RPC=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=OFF)
  cmake -S "$src/vendor/llama.cpp" -B "$out/build-$backend-rpc" "${gen[@]}" "${rpc_flags[@]}" >/dev/null
  cmake --build "$out/build-$backend-rpc" --target ggml-rpc-server -j "$(nproc)"
  cp "$out/build-$backend-rpc/bin/ggml-rpc-server" "$out/bin/rpc-server-$backend"
  echo "$out/bin/rpc-server-$backend"
fi
