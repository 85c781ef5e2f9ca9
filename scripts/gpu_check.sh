#!/usr/bin/env bash
# One build-test-benchmark call on a GPU machine that cannot reach a package index (the device
# tool's H200): install wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh downloads them) into
# /tmp/wheels, expose this repository's distributions without pip (scripts/dev_site.py), run the
# GPU tests, then the synthetic Whisper benchmarks beside transformers. With a second source tree
# in $BASELINE (e.g. `git archive <commit> oasr-* benchmarks scripts | tar -x -C .gpu_baseline`),
# the same benchmarks also run on it in the same call, for before/after ratios.
#
#   OUT=/tmp/out BASELINE=.gpu_baseline scripts/gpu_check.sh [tests|bench|families|all]
#   FAMILIES="icefall nemo" scripts/gpu_check.sh families   # some of the family benchmarks
#   PENDING="icefall qwen" scripts/gpu_check.sh pending     # checks written without a GPU
# ``pending`` runs scripts/gpu_pending/<name>.sh: the GPU tests and benchmarks of work done in a
# session without device time (each <= 120 s, writing under $OUT/<name>/, expected results in
# its comments). Once a check has run and its result is in docs/benchmarks.md, delete its file.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
OUT=${OUT:-/tmp/oasr-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
for dir in .whl .whl-lm; do  # whichever of scripts/fetch_gpu_wheels.sh's folders were carried
    if ls "$dir"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-deps --upgrade --target /tmp/wheels "$dir"/*.whl 2>&1 | grep -v WARNING
    fi
done
site_for() {  # PYTHONPATH exposing the distributions of source tree $1
    "$PY" "$1/scripts/dev_site.py" "/tmp/site-$(basename "$1")"
}
HERE_PATH="/tmp/wheels:$(site_for "$PWD"):$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
    PYTHONPATH="$HERE_PATH" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors -o addopts="--import-mode=importlib" \
        tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi

bench() {  # $1: label, $2: source tree; the three synthetic workloads of docs/benchmarks.md
    local label=$1 tree=$2 path
    path="/tmp/wheels:$(site_for "$tree"):$tree"
    for spec in "large-v3 64 128" "large-v3 1 4" "large-v3-turbo 64 128"; do
        set -- $spec
        (cd "$tree" && PYTHONPATH="$path" "$PY" -m benchmarks.asrbench --workload synthetic --shape "$1" \
            --device cuda --dtype float16 --batch-size "$2" --requests "$3" --tokens 100 \
            --json "$OUT/${label}_$1_b$2.json" 2>&1 | tail -6)
    done
}
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
    bench after "$PWD"
    if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE" ]; then
        bench before "$(cd "$BASELINE" && pwd)"
    fi
fi

family_bench() {  # one family's benchmark beside its reference, JSON into $OUT
    local name=$1
    shift
    echo "== benchmarks.${name}bench $*"
    PYTHONPATH="$HERE_PATH" timeout 420 "$PY" -m "benchmarks.${name}bench" "$@" 2>&1 | tail -40
}
if [ "$WHAT" = families ] || [ "$WHAT" = all ]; then
    for f in ${FAMILIES:-icefall nemo funasr qwen}; do
        case $f in
            icefall) family_bench icefall --device cuda --json "$OUT/icefallbench.json" ;;
            nemo) family_bench nemo --device cuda --json "$OUT/nemobench.json" ;;
            funasr) family_bench funasr --device cuda --batch 64 --repeats 3 > "$OUT/funasrbench.log"
                    tail -5 "$OUT/funasrbench.log" ;;
            qwen) family_bench qwen --json "$OUT/qwenbench.json" ;;
        esac
    done
fi

if [ "$WHAT" = pending ]; then
    export PYTHONPATH="$HERE_PATH" OUT
    for f in scripts/gpu_pending/*.sh; do
        [ -e "$f" ] || { echo "no pending checks (scripts/gpu_pending/ is empty)"; break; }
        name=$(basename "$f" .sh)
        case " ${PENDING:-$name} " in *" $name "*) ;; *) continue ;; esac
        mkdir -p "$OUT/$name"
        echo "== pending check $name"
        timeout 150 bash -x "$f" > "$OUT/$name/log.txt" 2>&1
        echo "rc=$?"; tail -30 "$OUT/$name/log.txt"
    done
fi
