#!/usr/bin/env bash
# Download, where there is a network, the Python wheels the lent CUDA machine's image lacks
# (pymtp's runtime and test needs, as this box's index resolves them today) into .whl/, for
# device_cuda.sh. The image's own packages (KINDS.md's list) are dropped: their versions
# serve, and a second copy of numpy or requests beside torch's is a risk for nothing.
#
#   bash benchmarks/carry_wheels.sh [DIR]        (default .whl; ~10 MB)
set -euo pipefail
dir=${1:-.whl}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$tmp" "gguf==0.19.0" fastapi uvicorn openai anthropic jsonschema diskcache typing-extensions 2>&1 \
  | grep -v "is ignored" || true
# in the image already (kept: typing-extensions, anyio, sniffio, which pydantic and starlette
# want newer than the image may hold; truststore, which the clients' httpcore2 imports)
for have in numpy click certifi charset_normalizer idna requests urllib3 pyyaml tqdm h11 attrs; do
  rm -f "$tmp/$have"-[0-9]*.whl
done
mkdir -p "$dir"
cp "$tmp"/*.whl "$dir"/
ls "$dir" | wc -l | xargs echo "wheels in $dir:"
du -sh "$dir"
