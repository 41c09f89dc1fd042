#!/usr/bin/env bash
# Run the GPU tests and the benchmarks of benchmarks/README.md on one CUDA machine.
#
#   bash benchmarks/run_gpu.sh tests  [OUT] [PYTEST ARGS...]   # every GPU test: pytest -m gpu tests/
#   bash benchmarks/run_gpu.sh table  [OUT] [ARGS...]          # kernel table: bench_kernels.py
#   bash benchmarks/run_gpu.sh step   [OUT] [ARGS...]          # training step: bench_distill.py
#   bash benchmarks/run_gpu.sh decode [OUT] [MODEL] [ARGS...]  # decode: bench_generate.py
#   bash benchmarks/run_gpu.sh all    [OUT]                    # the four above, in turn
#   bash benchmarks/run_gpu.sh scaling [OUT] [ARGS...]         # bench_scaling.py on 8, 4, 2, 1 GPUs
#                                                              # (default --recipe llama-3.1-8b)
#
# OUT (default: $OUT, else runs/bench/) receives a log and, for the benchmarks, a JSON file.
# ARGS go to the script unchanged, e.g. `step /tmp/b --shapes smollm2-135m --reps 6`.
# Needs CUDA PyTorch, Triton and transformers already installed; glaswap runs from this
# checkout whether or not it is installed (`pip install --no-deps -e .` also works).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in tests|table|step|decode|all|scaling) ;; *) sed -n '2,15p' "$0"; exit 2 ;; esac
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
scaling() {  # every GPU count up to those visible, each step kind, a checkpoint carried from count to count
  [ $# -gt 0 ] || set -- --recipe llama-3.1-8b
  local n; n="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
  [ "$n" -gt 0 ] || { echo "scaling: no CUDA GPU visible"; return 1; }
  rm -rf "$out/scaling.jsonl" "$out/scaling-ckpt"
  for g in 8 4 2 1; do
    [ "$g" -le "$n" ] || continue
    echo "## $g GPUs" | tee -a "$out/scaling.log"
    python3 -m torch.distributed.run --standalone --nproc-per-node "$g" benchmarks/bench_scaling.py --json "$out/scaling.jsonl" \
      --checkpoint "$out/scaling-ckpt" "$@" 2>&1 | tee -a "$out/scaling.log" || echo "($g GPUs failed)"
  done
  python3 benchmarks/bench_scaling.py --summary "$out/scaling.jsonl" | tee "$out/scaling.txt"
}

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
