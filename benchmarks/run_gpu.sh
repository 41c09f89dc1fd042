#!/usr/bin/env bash
# Run the GPU tests and the benchmarks of benchmarks/README.md on one CUDA machine.
#
#   bash benchmarks/run_gpu.sh tests  [OUT] [PYTEST ARGS...]   # every GPU test: pytest -m gpu tests/
#   bash benchmarks/run_gpu.sh table  [OUT] [ARGS...]          # kernel table: bench_kernels.py
#   bash benchmarks/run_gpu.sh step   [OUT] [ARGS...]          # training step: bench_distill.py
#   bash benchmarks/run_gpu.sh decode [OUT] [MODEL] [ARGS...]  # decode: bench_generate.py
#   bash benchmarks/run_gpu.sh all    [OUT]                    # the four above, in turn
#
# OUT (default: $OUT, else runs/bench/) receives a log and, for the benchmarks, a JSON file.
# ARGS go to the script unchanged, e.g. `step /tmp/b --shapes smollm2-135m --reps 6`.
# Needs CUDA PyTorch, Triton and transformers already installed; glaswap runs from this
# checkout whether or not it is installed (`pip install --no-deps -e .` also works).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in tests|table|step|decode|all) ;; *) sed -n '2,13p' "$0"; exit 2 ;; esac
shift
out="${OUT:-runs/bench}"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then out="$1"; shift; fi
mkdir -p "$out"

# This checkout first on the path, under the import names an install would give.
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
ln -s "$PWD/glaswap" "$shim/glaswap"
ln -s "$PWD/glaswap_kernels" "$shim/glaswap_kernels"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

tests() { python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/ "$@" 2>&1 | tee "$out/gpu_tests.log"; }
table() { python3 benchmarks/bench_kernels.py --json "$out/kernels.json" "$@" 2>&1 | tee "$out/kernels.log"; }
step() {
  [ $# -gt 0 ] || set -- --shapes llama-3.2-1b
  python3 benchmarks/bench_distill.py --json "$out/distill.json" "$@" 2>&1 | tee "$out/distill.log"
}
decode() { python3 benchmarks/bench_generate.py --out "$out" "$@" 2>&1 | tee "$out/decode.log"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton',
    triton.__version__, 'transformers', t.__version__)"; } | tee "$out/versions.txt"

case "$mode" in
  all)
    failed=""
    for m in tests table step decode; do
      echo "## $m"; "$m" || failed="$failed $m"
    done
    [ -z "$failed" ] || { echo "failed:$failed"; exit 1; } ;;
  *) "$mode" "$@" ;;
esac
