#!/usr/bin/env bash
# Build .gpu/ (git-ignored through .git/info/exclude) to carry to a GPU machine that reaches no
# package index: the wheels its image lacks (zarr and what it needs, for the calibration check)
# and the SmolLM2 tokenizer (the corpus is tokenized with it; no GGUF file travels).
#   bash bench/gpu_prepare.sh          # then run bench/gpu_check.sh there with carry [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer
# the device image's Python is 3.12 (library/device/KINDS.md); pins = what the CPU venv runs
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
$PY -c "from oscar.pipeline.models import load_tokenizer; load_tokenizer('smollm2-135m').save_pretrained('.gpu/tokenizer')"
du -sh .gpu
