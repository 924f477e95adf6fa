#!/usr/bin/env bash
# Ours against CTranslate2 and llama.cpp on the bundled model and random 27 M / 134 M Llamas, 1 and 2
# threads, W1 and equal lengths, float32 and int8 (bench.peers). Optional extras needed: ctranslate2,
# llama-cpp-python, and LLAMA_CPP_SOURCE (see flashx_batch/bench/peer_llama_cpp.py).
#   LLAMA_CPP_SOURCE=... bash jobs/peers_sweep.sh [OUT_ROOT] [SIZES: full|quick for the 134 M run]
set -euo pipefail
out=${1:-docs/results}
big=${2:-quick}
py=${PYTHON:-.venv/bin/python}
run() { echo "== $(date -u +%FT%TZ) $*"; "$py" -m flashx_batch.bench.peers --peers ctranslate2,llama_cpp "$@"; }
run --out "$out/peers" --threads 1,2 --repeats 3
run --out "$out/peers_27m" --shape llama-27m --threads 1,2 --repeats 3
run --out "$out/peers_134m" --shape llama-134m --threads 1,2 --repeats 3 $([ "$big" = quick ] && echo --quick)
echo "== $(date -u +%FT%TZ) done"
