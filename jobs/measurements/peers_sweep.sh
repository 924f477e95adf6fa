#!/usr/bin/env bash
# Ours against CTranslate2 and llama.cpp on the bundled model, random 27 M / 134 M Llamas and a random
# Qwen3-MoE, 1 and 2 threads, W1, equal lengths and W3, float32 and int8 (bench.peers), one model after
# another (never two benchmarks at once on a shared machine). Optional extras needed: ctranslate2,
# llama-cpp-python (with sentencepiece for its converter), and LLAMA_CPP_SOURCE (see
# flashx_batch/bench/peer_llama_cpp.py). CTranslate2 has no Qwen3-MoE converter: that run records it
# as skipped and compares with llama.cpp alone.
#   LLAMA_CPP_SOURCE=... bash jobs/measurements/peers_sweep.sh [OUT_ROOT] [SIZES: full|quick for the 134 M and MoE runs]
#       [SUFFIX: appended to each results folder, e.g. _amd]
set -euo pipefail
out=${1:-docs/results}
big=${2:-quick}
tag=${3:-}
py=${PYTHON:-.venv/bin/python}
quick=$([ "$big" = quick ] && echo --quick || true)
run() { echo "== $(date -u +%FT%TZ) $*"; "$py" -m flashx_batch.bench.peers --peers ctranslate2,llama_cpp "$@"; }
run --out "$out/peers$tag" --threads 1,2 --repeats 3
run --out "$out/peers${tag}_27m" --shape llama-27m --threads 1,2 --repeats 3
run --out "$out/peers${tag}_134m" --shape llama-134m --threads 1,2 --repeats 3 $quick
run --out "$out/peers${tag}_moe" --shape qwen3-moe --threads 1,2 --repeats 3 $quick
echo "== $(date -u +%FT%TZ) done"
