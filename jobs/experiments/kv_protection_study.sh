#!/usr/bin/env bash
# The protection ablations of docs/benchmarks.md ("Segment-sparse KV"): main sizes and the variant sizes.
set -euo pipefail
out=${OUT:-docs/results/kv_protection}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
$py jobs/experiments/kv_protection_study.py --task mqar --saved 0.25 --seeds 0,1 --out "$out/mqar_25.json"
$py jobs/experiments/kv_protection_study.py --task mqar --saved 0.5 --seeds 0,1 --out "$out/mqar_50.json"
$py jobs/experiments/kv_protection_study.py --task copy --saved 0.25 --seeds 0 --out "$out/copy_25.json"
$py jobs/experiments/kv_protection_study.py --task copy --saved 0.5 --seeds 0 --out "$out/copy_50.json"
$py jobs/experiments/kv_protection_study.py --task mqar --saved 0.25 --seeds 1 --variant --out "$out/variant_mqar_25.json"
$py jobs/experiments/kv_protection_study.py --task copy --saved 0.25 --seeds 1 --variant --out "$out/variant_copy_25.json"
