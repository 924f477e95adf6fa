#!/usr/bin/env bash
# Every GPU check of this repository in one run, for a GPU machine lent for a few minutes:
#   OUT=DIR bash jobs/operations/gpu_check.sh
# 1. the GPU tests (tests/device: parity with CPU, bf16 agreement, CUDA-graph decode = eager tokens),
# 2. the GPU protocol (python -m flashx_batch.bench.gpu_protocol: Llama-3.2-1B-shaped bf16 model,
#    ours vs transformers on W1, decode step times with and without CUDA graphs), its budget cut to
#    5 minutes so that the whole script ends within 9 (a device call may run 10),
# 3. segment-sparse KV at a fixed KV budget (python -m flashx_batch.bench.kv_sparse on cuda, bf16:
#    the bundled model, 32 static rows' worth of arena, rows admitted and output tok/s against static),
# 4. tensor parallelism over NCCL (TP = 2 tokens = one GPU's; part of 1, reported on its own line):
#    skipped, with that said in DIR/tensor_parallel.txt, on a machine with one GPU.
# Needs torch with CUDA, transformers, safetensors, tokenizers, pytest (no Ray, Hydra or network: the
# runtime and these checks do not import them). Writes DIR/device_tests.txt, DIR/gpu_protocol.log,
# DIR/gpu_protocol.json, DIR/kv_sparse/kv_sparse.json, DIR/kv_sparse.log, DIR/gpu.txt and DIR/summary.json
# (the headline figures, `python -m flashx_batch.bench.gpu_summary`; W1 stripes vs extents among them); the exit
# status is the first failure's (0: all passed). PARTS="tests kv_sparse" runs only those parts (default:
# tests protocol kv_sparse), for a rerun inside the same few minutes.
set -u
OUT=${OUT:-results/gpu}
PARTS=${PARTS:-tests protocol kv_sparse}
tests=0 protocol=0 sparse=0
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if [[ " $PARTS " == *" tests "* ]]; then
    timeout 120 $PY -m pytest -q -s -rA -p no:cacheprovider tests/device > "$OUT/device_tests.txt" 2>&1
    tests=$?
    grep -E "agreement" "$OUT/device_tests.txt"
    tail -n 5 "$OUT/device_tests.txt"
fi
if [[ " $PARTS " == *" protocol "* ]]; then
    timeout 360 $PY -m flashx_batch.bench.gpu_protocol --out "$OUT" --budget-s 300 > "$OUT/gpu_protocol.log" 2>&1
    protocol=$?
    grep -E "INFO flashx_batch.bench.gpu_protocol|ERROR|Traceback" "$OUT/gpu_protocol.log" | tail -n 20
fi
if [[ " $PARTS " == *" kv_sparse "* ]]; then
    timeout 90 $PY -m flashx_batch.bench.kv_sparse --out "$OUT/kv_sparse" --backend cuda --dtype bfloat16 \
        --static-rows 32 --repeats 3 > "$OUT/kv_sparse.log" 2>&1
    sparse=$?
    grep -E "INFO flashx_batch.bench.kv_sparse|ERROR|Traceback|SystemExit" "$OUT/kv_sparse.log" | tail -n 5
fi
grep -E "test_tensor_parallel_over_two_gpus" "$OUT/device_tests.txt" > "$OUT/tensor_parallel.txt" 2>&1 || true
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
    echo "tensor parallel: skipped, $gpus GPU(s) here; TP = 2 needs 2" | tee -a "$OUT/tensor_parallel.txt"
else
    echo "tensor parallel: TP = 2 over $gpus GPUs ran in the device tests (see device_tests.txt)" \
        | tee -a "$OUT/tensor_parallel.txt"
fi
$PY -m flashx_batch.bench.gpu_summary "$OUT" > /dev/null 2>&1 || echo "summary: failed (see the parts above)"
[ -f "$OUT/summary.json" ] && cat "$OUT/summary.json"
echo "device tests: exit $tests; protocol: exit $protocol; kv_sparse: exit $sparse"
[ "$tests" -ne 0 ] && exit "$tests"
[ "$protocol" -ne 0 ] && exit "$protocol"
exit "$sparse"
