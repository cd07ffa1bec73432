#!/usr/bin/env bash
# The GPU routine, on a lent CUDA machine (no network): build the pinned llama.cpp with
# CUDA (shared libs for pymtp + llama-server from one build), then the stages asked for.
#
#   bash benchmarks/device_cuda.sh STAGE...        (logs and results under $OUT)
#
# Stages:
#   build    build only (skipped when build/llama-cuda already holds it, or when a pack from
#            an earlier build is there: .carry/llama-cuda-bin.tar.xz, or its parts, below)
#   knobs    benchmarks/identity_knobs.py on every model: batch variance + identity per knob
#   opvar    benchmarks/op_variance.py on every model: the first graph nodes a batch changes
#   pytest   pytest with $PYTEST_ARGS only
#   tests    the whole test suite (no -x), on the GPU, in JOBS parallel slices
#   chisq    the three chi-square files, one process each (502 s on an H200, session 70), for
#            a call of their own after `CHISQ=apart ... tests`, which leaves them out
#   bench    pymtp bench $BENCH_ARGS --against-llama-server on each trained model
#   matrix   the identity matrix: pymtp bench -k 1..4 --against-llama-server per model
#   sampling issue #9 at temperature 0.7: pad the models to 248k (pad_vocab.py), then
#            sampling_cost.py, round_profile.py and pymtp bench --against-llama-server with
#            llama-server's filters and Qwen's, on each model and its padded twin
#   greedy   issue #9: greedy's argmax on the host (--sampling chain) and in the graph (backend),
#            no-spec and k=3, per model and its 248k twin, with round_profile.py's Python share
#   paths    issue #9: bench at T=0.7 with --sampling chain, backend and auto (PATHS_SAMPLING narrows
#            them), per model and its 248k twin (PATHS_VOCAB=248k: the twins only); SRC=DIR runs
#            an older pymtp copy (paths-old.txt)
#   load     issue #10: load_server.py --table (CLIENTS=12 clients x REQUESTS=6, --parallel 8)
#            per model: six requests a client make a pass of ~2.5 s on an H200, where two
#            (the issue's) took under one and ranked nothing finer than ~10% (session 40);
#            LOAD_ARGS="--draft-max 3 --draft-max auto" adds its options,
#            LOAD_TIMEOUT (s, default 280) bounds each model's table (--repeat needs more),
#            SRC=DIR serves an older pymtp copy (load-old-*.txt), PYMTP_ARGS="--cache-ram 0" adds
#            options to every pymtp server, TRACE=1 traces every round
#            (benchmarks/round_trace: where the servers' time goes, by depth and prompt rows)
#   shape    benchmarks/shape_switch.py per trained model, with CUDA graphs and without
#   window   benchmarks/host_window.py per trained model: host work a decode hides
#   depth    benchmarks/depth_trace.py per trained model, greedy and at T=0.7 (DEPTH_ARGS adds
#            its options: "--batch 8" for batched rounds)
#   sized    benchmarks/sized_model.py /tmp/models/sized.gguf $SIZED_ARGS (a synthetic model
#            as large as a real one), then its 248k twin (pad_vocab.py); after tests and matrix,
#            which would take it in
#   profile  benchmarks/round_profile.py $PROFILE_ARGS ("a ; b": one run per setting) per model
#            (MODELS=, e.g. the sized twin); SRC=DIR profiles an older pymtp copy (profile-old.txt)
#   py       python3 $PY_ARGS (a script of the checkout, with this environment; PY_TIMEOUT s)
#   pack     leave the built binaries in $OUT/llama-cuda-bin.tar.xz for a later machine
#
# PYMTP_PATCHES=1 builds with vendor/llama.cpp/patches/ applied (into build/llama-cuda-patched);
# GGML_CUDA_BATCH_INVARIANT=1 then switches the patched kernels on for every stage, and
# TAG=-inv keeps that run's matrix files apart.
#
# CCCL=1 builds against the CCCL headers of .carry/cccl-include.tar.xz (into build/llama-cuda-cccl;
# build_llama_server.sh's CCCL_INCLUDE says why). Made where there is a network:
#   pip download --no-deps cuda-cccl -d /tmp/w && unzip -q /tmp/w/cuda_cccl-*.whl -d /tmp/w/x \
#     && tar cJf .carry/cccl-include.tar.xz -C /tmp/w/x/cuda/cccl/headers include
#
# Expects in the checkout: .carry/llama-trim.tgz (trim_sdist.sh: the source to build, and with
# a packed build the Python bindings), .whl/ (wheels the device image lacks: carry_wheels.sh),
# optionally .carry/*.gguf.xz models.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$(pwd)
# the chi-square files: thousands of draws a test, slow on a GPU (the `chisq` stage)
chisq=(tests/test_stochastic.py tests/test_stochastic_adjusted.py tests/test_stochastic_prediction.py)
b=build/llama-cuda
[ "${PYMTP_PATCHES:-0}" = 1 ] && b=build/llama-cuda-patched
if [ "${CCCL:-0}" = 1 ]; then
  b=build/llama-cuda-cccl
  mkdir -p /tmp/cccl && tar xJf .carry/cccl-include.tar.xz -C /tmp/cccl
  export CCCL_INCLUDE=/tmp/cccl/include
fi
bin=$b/build-cuda/bin
# wheels once per machine: a later call on the same warm machine may leave .whl behind
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
elif [ ! -d /tmp/site ]; then
  echo "no .whl/ carried and no /tmp/site from an earlier call"; exit 1
fi
if [ ! -x "$b/bin/llama-server-cuda" ] && [ -f .carry/llama-cuda-bin.tar.xz ]; then
  mkdir -p "$b" && tar xJf .carry/llama-cuda-bin.tar.xz -C "$b"
fi
# A pack too big to carry beside the tree and .whl (45 MB) comes in parts,
# .pack/llama-cuda-bin.tar.xz.partN, over calls to one warm machine: an earlier call only
# copies its parts (`mkdir -p /tmp/pack && cp .pack/*.part* /tmp/pack/`), the call that
# brings the last one runs this script. PACK_PARTS: how many there are (default 3).
if ls .pack/llama-cuda-bin.tar.xz.part* > /dev/null 2>&1; then
  mkdir -p /tmp/pack && cp .pack/llama-cuda-bin.tar.xz.part* /tmp/pack/
fi
if [ ! -x "$b/bin/llama-server-cuda" ] \
    && [ "$(ls /tmp/pack/llama-cuda-bin.tar.xz.part* 2> /dev/null | wc -l)" -ge "${PACK_PARTS:-3}" ]; then
  mkdir -p "$b" && cat $(ls /tmp/pack/llama-cuda-bin.tar.xz.part* | sort) | tar xJf - -C "$b"
fi
# a pack holds the binaries only: the Python bindings pymtp loads them with are the sdist's
if [ -x "$b/bin/llama-server-cuda" ] && [ ! -d "$b/src/llama_cpp" ] && [ -f .carry/llama-trim.tgz ]; then
  mkdir -p "$b/src" && tar xzf .carry/llama-trim.tgz -C "$b/src" --strip-components=1
fi
if [ ! -x "$b/bin/llama-server-cuda" ]; then
  t0=$(date +%s)
  bash benchmarks/build_llama_server.sh "$b" cuda .carry/llama-trim.tgz > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$root:$root/tools:$root/$b/src:/tmp/site"
export LLAMA_CPP_LIB_PATH="$root/$bin"
export LD_LIBRARY_PATH="$LLAMA_CPP_LIB_PATH:${LD_LIBRARY_PATH:-}"
# A process that imports numpy before llama.cpp's CUDA libraries crashed in
# llama_model_load (libstdc++ code resolved through libggml-cuda); pymtp imports llama_cpp
# first, and preloading the system libstdc++ keeps other entry points (pytest) safe.
export LD_PRELOAD="$(ldconfig -p | awk '/libstdc\+\+\.so\.6 /{print $NF; exit}')"
export PYMTP_LLAMA_SERVER="$root/$b/bin/llama-server-cuda"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
mkdir -p /tmp/models
for f in .carry/*.gguf.xz; do [ -f "$f" ] && xz -dc "$f" > "/tmp/models/$(basename "$f" .xz)"; done
# models split across calls (over the carry limit) arrive as .carry/NAME.gguf.xz.partN
if ls .carry/*.xz.part* > /dev/null 2>&1; then mkdir -p /tmp/parts && cp .carry/*.xz.part* /tmp/parts/; fi
for whole in $(ls /tmp/parts/*.xz.part* 2>/dev/null | sed 's/\.part[0-9]*$//' | sort -u); do
  n=$(ls "$whole".part* | wc -l)
  if [ "$n" -ge "${PARTS:-99}" ] && [ ! -f "/tmp/models/$(basename "$whole" .xz)" ]; then
    cat $(ls "$whole".part* | sort) | xz -dc > "/tmp/models/$(basename "$whole" .xz)" && echo "joined $(basename "$whole") from $n parts"
  fi
done
[ -f /tmp/models/fixture-moe.gguf ] || python3 - <<'PY'
from pymtp.testing.fixtures import fixture_path
for kind in ("dense", "moe"):
    p = fixture_path(kind, cache_dir="/tmp/models")
    p.rename(f"/tmp/models/fixture-{kind}.gguf")
PY
models=(pymtp/data/qwen35-tiny-mtp-q8_0.gguf /tmp/models/*.gguf)
# MODELS="a.gguf b.gguf" narrows the list (a later call on a warm machine)
[ -n "${MODELS:-}" ] && read -ra models <<< "$MODELS"
prompts=benchmarks/prompts_heldout.jsonl

# Each trained model, then its twin padded to 248k (pad_vocab.py, made once per machine),
# one path a line: the pairs issue #9's stages compare.
trained_and_padded() {
  local m p
  for m in "${models[@]}"; do
    case "$m" in *fixture*|*-248k.gguf) continue ;; esac
    p="/tmp/models/$(basename "$m" .gguf)-248k.gguf"
    [ -f "$p" ] || python3 benchmarks/pad_vocab.py -q "$m" "$p" >&2 || return 1
    printf '%s\n%s\n' "$m" "$p"
  done
}

# pymtp bench's llama-server options for a --sampling path: only the host ("chain") runs
# alternate with llama-server, on every GPU layer
against_for() {
  against=()
  [ "$1" = chain ] && against=(--against-llama-server "$PYMTP_LLAMA_SERVER" --llama-server-args "-ngl all")
}

for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    build) ;;
    knobs)
      for m in "${models[@]}"; do
        timeout "${KNOBS_TIMEOUT:-120}" python3 benchmarks/identity_knobs.py "$m" --prompts "$prompts" \
          --limit "${LIMIT:-16}" -n 128 --json "$OUT/knobs-$(basename "$m" .gguf).json" 2>&1 | tee -a "$OUT/knobs.txt"
      done ;;
    opvar)
      for m in "${models[@]}"; do
        for fa in auto off; do
          timeout 120 python3 benchmarks/op_variance.py "$m" --fa "$fa" --rows 2 --rows 4 --rows 5 2>&1 | tee -a "$OUT/opvar.txt"
        done
      done ;;
    tests)
      # The suite outgrew one 600 s call run serially: JOBS processes (default 4) share the
      # GPU, each with the slice of whole test files that tests/conftest.py deals it.
      # SLICES="2 5" runs only those (a later call finishing what an earlier one could not).
      # CHISQ=apart leaves the chi-square files to the `chisq` stage's call: dealt one to a
      # slice of six, their slices outran 575 s twice (session 69); without them 332 s
      jobs=${JOBS:-4}
      slices=${SLICES:-$(seq 0 $((jobs - 1)))}
      ta=()
      [ "${CHISQ:-}" = apart ] && for f in "${chisq[@]}"; do ta+=("--ignore=$f"); done
      for i in $slices; do
        # --durations: which files make a slice slow (slice 5 of 6 has run 250-320 s alone),
        # for weighing the deal in tests/conftest.py
        # PYMTP_TEST_TIMES: each test's seconds as it ends, kept when the call cuts the slice
        PYMTP_TEST_SLICE="$i/$jobs" PYMTP_TEST_TIMES="$OUT/times-$i.txt" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" --durations=15 \
          ${ta[@]+"${ta[@]}"} tests > "$OUT/tests-$i.log" 2>&1 &
      done
      wait
      for i in $slices; do
        grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests-$i.log" | cut -c1-200
        tail -1 "$OUT/tests-$i.log"
      done ;;
    chisq)
      # ~50-130 s a test on an H200 (thousands of draws, a decode each); three processes
      # share the GPU at about the throughput of one, so one call holds all three files
      for f in "${chisq[@]}"; do
        name=$(basename "$f" .py)
        PYMTP_TEST_TIMES="$OUT/times-$name.txt" python3 -m pytest -q -p no:cacheprovider \
          -o addopts="-ra" "$f" > "$OUT/$name.log" 2>&1 &
      done
      wait
      for f in "${chisq[@]}"; do echo "$f: $(tail -1 "$OUT/$(basename "$f" .py).log")"; done ;;
    pytest)
      # PYTEST_ARGS="-v tests/test_x.py" runs just those (finding which test a slice hung on)
      read -ra pa <<< "${PYTEST_ARGS:-tests}"
      PYMTP_TEST_TIMES="$OUT/times-pytest.txt" python3 -m pytest -p no:cacheprovider -o addopts="-ra" \
        "${pa[@]}" > "$OUT/pytest.log" 2>&1
      tail -5 "$OUT/pytest.log" ;;
    bench)
      # BENCH_ARGS="-k 2 -k auto ; -k 3 --temperature 0.7": pymtp bench against llama-server
      # per model and per ';'-separated setting; SRC=DIR runs the pymtp package found in
      # DIR instead (an older copy, for a same-machine A/B), NO_LLAMA=1 leaves llama-server out
      IFS=';' read -ra sets <<< "${BENCH_ARGS:-}"
      [ ${#sets[@]} -eq 0 ] && sets=("")
      against=(--against-llama-server "$PYMTP_LLAMA_SERVER" --llama-server-args "-ngl all")
      [ "${NO_LLAMA:-0}" = 1 ] && against=()
      for set in "${sets[@]}"; do
        read -ra ba <<< "$set"
        for m in "${models[@]}"; do
          case "$m" in *fixture*|*-248k.gguf) continue ;; esac
          case "$m" in /*) ;; *) m="$root/$m" ;; esac
          # from SRC's folder: `python -m` puts the working directory first on sys.path
          (cd "$root/${SRC:-.}" && python3 -m pymtp.cli bench "$m" --prompts "$root/$prompts" \
            --limit "${LIMIT:-12}" -n 128 ${ba[@]+"${ba[@]}"} ${against[@]+"${against[@]}"}) \
            2>> "$OUT/bench.log" | tee -a "$OUT/bench${SRC:+-old}.txt" | tail -12
        done
      done ;;
    window)
      # how much host work a decode hides: benchmarks/host_window.py per trained model
      for m in "${models[@]}"; do
        case "$m" in *fixture*|*-248k.gguf) continue ;; esac
        timeout 120 python3 benchmarks/host_window.py "$m" --json "$OUT/window-$(basename "$m" .gguf).json" \
          2>> "$OUT/window.log"
      done ;;
    matrix)
      for m in "${models[@]}"; do
        python3 -m pymtp.cli bench "$m" --prompts "$prompts" --limit "${LIMIT:-24}" -n 128 \
          -k 1 -k 2 -k 3 -k 4 --against-llama-server "$PYMTP_LLAMA_SERVER" \
          --llama-server-args "-ngl all ${LLAMA_SERVER_ARGS:-}" --json > "$OUT/matrix${TAG:-}-$(basename "$m" .gguf).json" \
          2>> "$OUT/matrix.log"
        python3 - "$OUT/matrix${TAG:-}-$(basename "$m" .gguf).json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d.get("rows") or d.get("results") or []
print(d.get("model", "?").rsplit("/", 1)[-1], " ".join(
    f"{r.get('system', '')}:{r.get('setting', r.get('label', ''))}={r.get('identical_to_nospec', '')}" for r in rows))
PY
      done ;;
    sampling)
      list=$(trained_and_padded) || exit 1
      read -ra pairs <<< "$(echo $list)"        # model, twin, model, twin, ...
      for ((i = 0; i + 1 < ${#pairs[@]}; i += 2)); do
        m=${pairs[i]} p=${pairs[i + 1]}
        n=$(basename "$m" .gguf)
        timeout 150 python3 benchmarks/sampling_cost.py --small "$m" --padded "$p" --threads 8 --json \
          > "$OUT/sampling-cost-$n.json" 2>> "$OUT/sampling.log"; tail -c 2000 "$OUT/sampling-cost-$n.json" | tail -5
        for mm in "$m" "$p"; do
          nn=$(basename "$mm" .gguf)
          for f in "0.7 40 0.95 0.05 llama" "0.7 20 0.8 0 qwen"; do
            read -r temp tk tp mp tag <<< "$f"
            timeout 150 python3 benchmarks/round_profile.py "$mm" -k 3 --temperature "$temp" --top-k "$tk" \
              --top-p "$tp" --min-p "$mp" --limit 4 --json "$OUT/profile-$nn-$tag.json" 2>> "$OUT/sampling.log" | tail -4
            timeout 200 python3 -m pymtp.cli bench "$mm" --prompts "$prompts" --limit "${LIMIT:-8}" -n 128 \
              -k 1 -k 2 -k 3 --temperature "$temp" --top-k "$tk" --top-p "$tp" --min-p "$mp" \
              --against-llama-server "$PYMTP_LLAMA_SERVER" --llama-server-args "-ngl all" --json \
              > "$OUT/bench-$nn-$tag.json" 2>> "$OUT/sampling.log"
            python3 - "$OUT/bench-$nn-$tag.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit("/", 1)[-1], " ".join(f"{r['system']}:{r['setting']}={r['median_tok_s']}" for r in d["results"]))
PY
          done
        done
      done ;;
    greedy)
      # issue #9: greedy's argmax on the host over copied logits (--sampling chain) or in the
      # graph (backend), per trained model and its 248k twin, no-spec and k=3; llama-server
      # runs beside the host runs; round_profile.py gives the k=3 round's Python share
      pairs=$(trained_and_padded) || exit 1
      for mm in $pairs; do
        nn=$(basename "$mm" .gguf)
        for path in chain backend; do
          against_for "$path"
          echo "== $nn greedy --sampling $path"
          timeout 200 python3 -m pymtp.cli bench "$mm" --prompts "$prompts" --limit "${LIMIT:-8}" -n 128 \
            -k 3 --sampling "$path" ${against[@]+"${against[@]}"} 2>> "$OUT/greedy.log" \
            | tee -a "$OUT/greedy.txt" | grep -E "^\| (pymtp|llama-server|no-spec|mtp) "
          timeout 150 python3 benchmarks/round_profile.py "$mm" -k 3 --sampling "$path" --limit 4 \
            --json "$OUT/profile-greedy-$nn-$path.json" 2>> "$OUT/greedy.log" | tee -a "$OUT/greedy.txt" | tail -3
        done
      done ;;
    paths)
      # issue #9: where temperature 0.7 builds its distributions (--sampling chain / backend),
      # per trained model and its 248k twin, llama-server's filters and Qwen's; llama-server
      # runs beside the chain runs
      # (SRC=DIR: the pymtp package found in DIR, into paths-old.txt, as load's SRC)
      old=""
      [ -n "${SRC:-}" ] && [ "$SRC" != . ] && old=-old
      pairs=$(trained_and_padded) || exit 1
      for mm in $pairs; do
        case "$mm" in /*) ;; *) mm="$root/$mm" ;; esac
        # PATHS_VOCAB=248k: the padded twins only
        case "${PATHS_VOCAB:-}:$mm" in 248k:*-248k.gguf|:*) ;; *) continue ;; esac
        for f in "40 0.95 0.05 llama" "20 0.8 0 qwen"; do
          read -r tk tp mp tag <<< "$f"
          for path in ${PATHS_SAMPLING:-chain backend auto}; do
            against_for "$path"
            echo "== $(basename "$mm" .gguf) $tag --sampling $path${old}"
            (cd "$root/${SRC:-.}" && timeout 200 python3 -m pymtp.cli bench "$mm" --prompts "$root/$prompts" \
              --limit "${LIMIT:-8}" -n 128 ${PATHS_K:--k 3} --temperature 0.7 --top-k "$tk" --top-p "$tp" \
              --min-p "$mp" --sampling "$path" ${against[@]+"${against[@]}"}) \
              2>> "$OUT/paths.log" | tee -a "$OUT/paths$old.txt" | grep -E "^\| (pymtp|llama-server|no-spec|mtp) "
          done
        done
      done ;;
    load)
      # SRC=DIR serves the pymtp package found in DIR (an older copy, for a same-machine A/B;
      # load_server.py --pymtp-src: LOAD_ARGS="--pymtp-src DIR --pymtp-src ." puts both trees'
      # rows in the same passes). TRACE=1 traces every round of
      # the pymtp servers (benchmarks/round_trace) into $OUT/trace-MODEL and summarises it.
      old=""       # SRC=. is this tree: its files are not "old"
      [ -n "${SRC:-}" ] && [ "$SRC" != . ] && old=-old
      for m in "${models[@]}"; do
        case "$m" in *fixture*|*-248k.gguf) continue ;; esac
        case "$m" in /*) ;; *) m="$root/$m" ;; esac
        n=$(basename "$m" .gguf)
        trace=()
        if [ "${TRACE:-0}" = 1 ]; then
          mkdir -p "$OUT/trace-$n"
          trace=(env ROUND_TRACE_DIR="$OUT/trace-$n" PYTHONPATH="$root/benchmarks/round_trace:$PYTHONPATH")
        fi
        src=()
        [ -n "$old" ] && src=(--pymtp-src "$root/$SRC")
        (${trace[@]+"${trace[@]}"} timeout "${LOAD_TIMEOUT:-280}" python3 "$root/benchmarks/load_server.py" \
          --table "$m" --llama-server "$PYMTP_LLAMA_SERVER" --threads 8 --parallel "${PARALLEL:-8}" ${src[@]+"${src[@]}"} \
          --clients "${CLIENTS:-12}" --requests "${REQUESTS:-6}" --max-tokens 128 \
          ${PYMTP_ARGS:+"--pymtp-args=$PYMTP_ARGS"} ${LOAD_ARGS:-}) 2>&1 | tee -a "$OUT/load$old-$n.txt" | tail -25
        if [ "${TRACE:-0}" = 1 ]; then
          python3 benchmarks/round_trace/report.py "$OUT/trace-$n" --slots "${PARALLEL:-8}" | tee "$OUT/trace-$n.txt"
        fi
      done ;;
    shape)
      # what a change of decode shape costs, with CUDA graphs and without (shape_switch.py)
      for m in "${models[@]}"; do
        case "$m" in *fixture*|*-248k.gguf) continue ;; esac
        n=$(basename "$m" .gguf)
        timeout 120 python3 benchmarks/shape_switch.py "$m" --json "$OUT/shape-$n.json" 2>> "$OUT/shape.log"
        GGML_CUDA_DISABLE_GRAPHS=1 timeout 120 python3 benchmarks/shape_switch.py "$m" \
          --json "$OUT/shape-$n-nographs.json" 2>> "$OUT/shape.log"
      done ;;
    depth)
      # what auto chose and why, greedy and at Qwen's T=0.7 (depth_trace.py)
      for m in "${models[@]}"; do
        case "$m" in *fixture*|*-248k.gguf) continue ;; esac
        timeout 100 python3 benchmarks/depth_trace.py "$m" ${DEPTH_ARGS:-} 2>> "$OUT/depth.log" | tee -a "$OUT/depth.txt"
        timeout 100 python3 benchmarks/depth_trace.py "$m" ${DEPTH_ARGS:-} --temperature 0.7 --top-k 20 --top-p 0.8 \
          --min-p 0 2>> "$OUT/depth.log" | tee -a "$OUT/depth.txt"
      done ;;
    sized)
      [ -f /tmp/models/sized.gguf ] || python3 benchmarks/sized_model.py /tmp/models/sized.gguf ${SIZED_ARGS:-} \
        2>&1 | tee -a "$OUT/sized.txt"
      [ -f /tmp/models/sized-248k.gguf ] || python3 benchmarks/pad_vocab.py -q /tmp/models/sized.gguf \
        /tmp/models/sized-248k.gguf 2>&1 | tee -a "$OUT/sized.txt" ;;
    profile)
      old=""
      [ -n "${SRC:-}" ] && [ "$SRC" != . ] && old=-old
      IFS=';' read -ra settings <<< "${PROFILE_ARGS:?PROFILE_ARGS: round_profile.py options, ';' between runs}"
      for m in "${models[@]}"; do
        for setting in "${settings[@]}"; do
          echo "== $m $setting" | tee -a "$OUT/profile$old.txt"
          # shellcheck disable=SC2086
          (cd "$root/${SRC:-.}" && PYTHONPATH="$root/${SRC:-.}:$PYTHONPATH" timeout "${PROFILE_TIMEOUT:-200}" \
            python3 "$root/benchmarks/round_profile.py" \
            "$([[ $m = /* ]] && echo "$m" || echo "$root/$m")" $setting) 2>&1 | tee -a "$OUT/profile$old.txt" | tail -8
        done
      done ;;
    py)
      # any script of the checkout, in this environment: PY_ARGS="script.py args"
      timeout "${PY_TIMEOUT:-300}" python3 ${PY_ARGS:?PY_ARGS names the script} 2>&1 | tee -a "$OUT/py.txt" ;;
    pack)
      (cd "$b" && tar cf - bin/llama-server-cuda build-cuda/bin/*.so* | xz -T0 -3 > "$OUT/llama-cuda-bin.tar.xz")
      ls -l "$OUT/llama-cuda-bin.tar.xz" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "stage $stage: $(( $(date +%s) - t0 )) s"
done
