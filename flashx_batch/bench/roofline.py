"""This machine's roofline, measured in the same run, and the floor a workload cannot beat on it.

Called by the harness (at start and end of a run) and the GPU protocol. Two probes:
memory bandwidth = bytes read + written by a large tensor copy; compute = FLOP/s of a square
float32 matmul (torch's, or oneDNN's on a packed weight where our CPU linears use it, the faster).
Both take the best of a few tries (the ceiling, not the average of a noisy machine).

`floor_seconds` turns them into the least time a static batcher at batch size B could need for a
workload: the larger of (useful FLOPs ÷ matmul FLOP/s) and (bytes that must move ÷ bandwidth), where
bytes are the weights once per forward pass (prefill once per batch, then one pass per decode step of
the batch's longest row, rows ideally grouped by output length) plus each row's KV read at every
decode step. Attention FLOPs are left out (small next to the weight matmuls at these lengths), so
the floor is a little optimistic — a fraction near 1 is as good as a static batcher at B gets. An
engine that grows its batches past B (ours does, `batch_growth`) streams the weights fewer times and
can pass it on weight-bound decode.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from flashx_batch.backends import device_traits, for_device
from flashx_batch.backends.cpu import onednn_linear, onednn_pack, onednn_packs
from flashx_batch.bench.models import moe_shape
from flashx_batch.bench.workloads import Workload


@dataclass(frozen=True)
class Machine:
    device: str
    threads: int
    mem_bandwidth_gb_s: float
    matmul_gflop_s: float
    matmul_dtype: str
    cpu: str
    torch: str
    python: str

    def as_dict(self) -> dict:
        return asdict(self)


def _best(fn, device: torch.device, repeats: int) -> float:
    sync = for_device(device).synchronize  # queued device work finishes inside the timing
    fn()  # first touch / allocation outside the timing
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large copy (each byte read once and written once)."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), device, repeats)


def measure_matmul(device: torch.device | str = "cpu", n: int = 1024, dtype: torch.dtype = torch.float32,
                   repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs): the faster of torch's matmul and, on a CPU whose
    torch packs weights for oneDNN (`backends.cpu.onednn_packs`, what our linears run), oneDNN's
    linear on a packed weight — the peak is the best this machine offers, not one library's."""
    device = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)  # no allocation inside the timing
    best = _best(lambda: torch.mm(a, b, out=c), device, repeats)
    if device_traits(device).host_kernels and onednn_packs(dtype):
        packed = onednn_pack(b)
        best = min(best, _best(lambda: onednn_linear(a, packed), device, repeats))
    return 2 * n**3 / best


def measure_int8_matmul(n: int = 1024, repeats: int = 5) -> float:
    """Multiply-adds x 2 per second of an n x n x n int8 matmul into int32 (`torch._int_mm`, CPU)."""
    a = torch.randint(-127, 127, (n, n), dtype=torch.int8)
    b = torch.randint(-127, 127, (n, n), dtype=torch.int8)
    return 2 * n**3 / _best(lambda: torch._int_mm(a, b), torch.device("cpu"), repeats)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_machine(device: str = "cpu", matmul_n: int = 1024, matmul_dtype: torch.dtype = torch.float32,
                    nbytes: int = 256 * 2**20) -> Machine:
    """Both probes on `device` with the current torch thread setting."""
    backend = for_device(device)
    return Machine(
        device=(f"cpu ({os.cpu_count()} cores visible)" if backend.host_kernels
                else backend.device_name(torch.device(device).index or 0)),
        threads=torch.get_num_threads(),
        mem_bandwidth_gb_s=measure_bandwidth(device, nbytes) / 1e9,
        matmul_gflop_s=measure_matmul(device, matmul_n, matmul_dtype) / 1e9,
        matmul_dtype=str(matmul_dtype).removeprefix("torch."),
        cpu=_cpu_name(),
        torch=torch.__version__,
        python=platform.python_version(),
    )


def best_of(*probes: Machine) -> Machine:
    """The highest bandwidth and FLOP/s seen: a shared machine only ever measures low, never high."""
    return replace(probes[0], mem_bandwidth_gb_s=max(p.mem_bandwidth_gb_s for p in probes),
                   matmul_gflop_s=max(p.matmul_gflop_s for p in probes))


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model: matmul FLOPs, weight bytes per pass, KV bytes held per token."""

    parameters: int
    flops_per_token: float
    weight_bytes: float
    kv_bytes_per_token: float

    @classmethod
    def from_hf_dir(cls, model_dir: Path, parameters: int, bytes_per_value: int = 4) -> ModelCost:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        embed = cfg["vocab_size"] * cfg["hidden_size"]
        # the input embedding is a lookup, not a matmul; when tied, the same matrix is the LM head
        matmul_params = parameters if cfg.get("tie_word_embeddings") else parameters - embed
        # mixture of experts: a token runs its top_k experts only; a pass over a batch still reads every
        # expert's weights (with top-2 of 8, a batch of 8 rows hits ~7 of them), so the bytes stay all
        moe = moe_shape(model_dir)
        active = matmul_params - (moe["expert_parameters"] - moe["active_expert_parameters"] if moe else 0)
        return cls(parameters, 2.0 * active, float(matmul_params * bytes_per_value),
                   float(2 * layers * kv_heads * head_dim * bytes_per_value))


def floor_seconds(workload: Workload, batch_size: int, cost: ModelCost, machine: Machine) -> dict[str, float]:
    """Least seconds any static batcher at `batch_size` could need for `workload` on `machine`. A prefix
    its rows share (`Workload.shared_prefixes`, W3) is computed once per group: what a prefix cache
    needs, so no engine that caches prefixes runs above the floor."""
    repeated = sum((len(rows) - 1) * length for length, rows in workload.shared_prefixes())
    useful_tokens = workload.input_tokens - repeated + workload.output_tokens - workload.rows
    compute_s = useful_tokens * cost.flops_per_token / (machine.matmul_gflop_s * 1e9)
    outputs = sorted(workload.max_new_tokens, reverse=True)
    batches = [outputs[k : k + batch_size] for k in range(0, len(outputs), batch_size)]
    passes = sum(1 + max(b) - 1 for b in batches)  # one prefill + (longest - 1) decode steps each
    kv_reads = sum(sum(len(p) + t for t in range(n - 1)) for p, n in zip(workload.prompts, workload.max_new_tokens))
    memory_s = (passes * cost.weight_bytes + kv_reads * cost.kv_bytes_per_token) / (machine.mem_bandwidth_gb_s * 1e9)
    return {"compute_s": compute_s, "memory_s": memory_s, "floor_s": max(compute_s, memory_s)}
