"""The CPU's kernel for a decode step's experts: each (token, expert) pair's rows through its expert's weights,
in one compiled call over all pairs.

A decode step at batch 8 with 8 of 128 experts per token has ~64 pairs spread over ~50 experts, one or two
rows each. `torch._grouped_mm` on the CPU walks every expert, empty ones included, with a dispatch per
expert (about a fifth of such a step went to that bookkeeping). Here the pairs, already sorted by expert,
are cut into (expert's run of rows, block of outputs) tasks run in parallel: each weight row is read once
for the run's few dot products over the hidden width, straight from the stacked weights. Sums are
vectorised (reassociated): last-bit differences from a GEMM, as between BLAS kernels.
Compiled with numba on first use (cached on disk where writable); where
numba is missing or fails, None, and the caller's grouped GEMM serves.

`int8_expert_rows` is the same walk over int8 experts (`quant.int8_experts`): rows already rounded to int8
per row, their exact integer dot products, as `torch._int_mm` computes them; the caller scales both alike, so a
row's outputs are the same bits whichever of the two serves it.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from flashx_batch.backends.cpu_decode import compile_kernel, load_numba, parallel_region

log = logging.getLogger(__name__)
OUTPUTS_PER_TASK = 32  # outputs of one pair a task computes: enough tasks to share out, few enough per call
# channels of int8 x int8 products summed in float32 before carrying to int32: 1024 x 127 x 127 < 2^24, so every
# partial sum is an integer float32 holds exactly, whatever order a vectorised loop adds in
EXACT_SPAN = 1024


@functools.cache
def kernel():
    """(numba, the compiled `expert_rows(x, experts, weights, out)`, the compiled int8 walk), or None."""
    numba = load_numba("decode-step experts run as grouped GEMMs")
    if numba is None:
        return None
    prange = numba.prange
    block = OUTPUTS_PER_TASK

    def run_starts(experts):  # pragma: no cover - compiled
        """Where each expert's run of rows starts in `experts` (non-decreasing), then its length."""
        starts = np.empty(len(experts) + 1, np.int64)
        runs = 0
        for p in range(len(experts)):
            if p == 0 or experts[p] != experts[p - 1]:
                starts[runs] = p
                runs += 1
        starts[runs] = len(experts)
        return starts[: runs + 1]

    def task_of(task, blocks, starts, experts):  # pragma: no cover - compiled
        """Task `task`'s rows [begin, end), their expert and its first output: tasks walk each run's output blocks."""
        run = task // blocks
        begin = starts[run]
        return begin, starts[run + 1], experts[begin], (task - run * blocks) * block

    try:
        find_runs = compile_kernel(numba, run_starts)
        task_rows = compile_kernel(numba, task_of)
    except Exception as exc:
        log.warning("the decode-step expert kernels failed to compile (%s): grouped GEMMs serve", exc)
        return None

    def expert_rows(x, experts, weights, out):  # pragma: no cover - compiled
        """x [P, H] float32 sorted by expert, experts [P] int64 (non-decreasing), weights [E, O, H] -> out [P, O].
        A task is one expert's run of rows and a block of outputs: each weight row is read once for the run."""
        pairs, width = x.shape
        outputs = weights.shape[1]
        starts = find_runs(experts)
        blocks = (outputs + block - 1) // block
        for task in prange((len(starts) - 1) * blocks):
            begin, end, expert, first = task_rows(task, blocks, starts, experts)
            for o in range(first, min(outputs, first + block)):
                w = weights[expert, o]
                for p in range(begin, end):
                    row = x[p]
                    acc = np.float32(0.0)
                    for h in range(width):
                        acc += row[h] * w[h]
                    out[p, o] = acc

    span = EXACT_SPAN

    def int8_rows(codes, experts, q, out):  # pragma: no cover - compiled
        """codes [P, K] float32 holding int8 values, sorted by expert, experts [P], q [E, O, K] int8 -> out [P, O]
        int32: each row's exact integer dot products with its expert's rows. Summed in float32 a span of
        `span` channels at a time, where every partial sum is an integer under 2^24 (exact in any order: a
        vectorised float sum runs ~3x faster here than integer multiplies), then carried in int32."""
        pairs, width = codes.shape
        outputs = q.shape[1]
        starts = find_runs(experts)
        blocks = (outputs + block - 1) // block
        for task in prange((len(starts) - 1) * blocks):
            begin, end, expert, first = task_rows(task, blocks, starts, experts)
            for o in range(first, min(outputs, first + block)):
                w = q[expert, o]
                for p in range(begin, end):
                    row = codes[p]
                    acc = np.int32(0)
                    for lo in range(0, width, span):
                        xs, ws = row[lo : lo + span], w[lo : lo + span]  # slices: the loop below vectorises
                        part = np.float32(0.0)
                        for h in range(len(xs)):
                            part += xs[h] * np.float32(ws[h])
                        acc += np.int32(part)
                    out[p, o] = acc

    try:
        compiled = compile_kernel(numba, expert_rows, parallel=True, fastmath=True)
        compiled_int8 = compile_kernel(numba, int8_rows, parallel=True, fastmath=True)
        probe, sums = np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32)
        with parallel_region(numba):
            compiled(np.ones((1, 4), np.float32), np.zeros(1, np.int64), np.ones((1, 2, 4), np.float32), probe)
            compiled_int8(np.full((1, 4), -3.0, np.float32), np.zeros(1, np.int64), np.full((1, 2, 4), 127, np.int8),
                          sums)
        if not np.allclose(probe, 4.0) or not (sums == -1524).all():
            raise RuntimeError(f"the compiled kernels returned {probe.ravel()}, {sums.ravel()} on constant cases")
    except Exception as exc:
        log.warning("the decode-step expert kernels failed to compile (%s): grouped GEMMs serve", exc)
        return None
    return numba, compiled, compiled_int8


def expert_rows(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """x [P, H] float32 rows (host memory), `experts` [P] each row's expert, `weights` [E, O, H] float32 ->
    [P, O]; None where the kernel is unavailable or the tensors are not what it takes."""
    ready = kernel()
    if ready is None or x.dtype != torch.float32 or weights.dtype != torch.float32 or not weights.is_contiguous():
        return None
    numba, compiled, _ = ready
    out = torch.empty(x.shape[0], weights.shape[1], dtype=torch.float32)
    with parallel_region(numba):
        compiled(x.contiguous().numpy(), experts.to(torch.int64).numpy(), weights.numpy(), out.numpy())
    return out


def int8_expert_rows(codes: torch.Tensor, experts: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """Rows rounded to int8 (`codes` [P, K]), sorted by `experts` [P], through int8 experts `q` [E, O, K] ->
    the exact int32 dot products [P, O] (the caller scales them); None where the kernel is unavailable."""
    ready = kernel()
    if ready is None or not q.is_contiguous():
        return None
    numba, _, compiled_int8 = ready
    out = torch.empty(codes.shape[0], q.shape[1], dtype=torch.int32)
    with parallel_region(numba):
        compiled_int8(codes.float().numpy(), experts.to(torch.int64).numpy(), q.numpy(), out.numpy())
    return out
