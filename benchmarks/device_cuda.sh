#!/usr/bin/env bash
# One call on a lent CUDA machine (no network): build the pinned llama.cpp with CUDA
# (shared libs for pymtp + llama-server), run the runtime tests on the GPU, then the
# head-to-head benchmark. Expects in the checkout: .carry/llama-trim.tgz (trim_sdist.sh),
# .whl/ (gguf, diskcache wheels), and optionally .carry/models/*.gguf.
#
#   bash benchmarks/device_cuda.sh [bench args...]      (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
root=$(pwd)
b=build/llama-cuda
if [ ! -x "$b/bin/llama-server-cuda" ]; then
  t0=$(date +%s)
  bash benchmarks/build_llama_server.sh "$b" cuda .carry/llama-trim.tgz > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$root:$b/src:/tmp/site"
export LLAMA_CPP_LIB_PATH="$root/$b/build-cuda/bin"
export LD_LIBRARY_PATH="$LLAMA_CPP_LIB_PATH:${LD_LIBRARY_PATH:-}"
# A process that imports numpy before llama.cpp's CUDA libraries crashed in
# llama_model_load (libstdc++ code resolved through libggml-cuda), with this cmake build
# and with the pip-built wheel alike. pymtp now imports llama_cpp first; preloading the
# system libstdc++ also avoids it, and keeps other entry points (pytest) safe.
export LD_PRELOAD="$(ldconfig -p | awk '/libstdc\+\+\.so\.6 /{print $NF; exit}')"
export PYMTP_LLAMA_SERVER="$root/$b/bin/llama-server-cuda"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import pymtp, llama_cpp; print('llama_cpp', llama_cpp.__version__)"
if [ "${PYMTP_DEVICE_TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -x tests/test_engine.py tests/test_stochastic.py -p no:cacheprovider 2>&1 | tail -15
fi
if [ $# -gt 0 ]; then
  python3 -m pymtp.cli bench "$@"
fi
