"""Peak host memory of `load_model` on a random sharded bfloat16 checkpoint, as a multiple of the weight bytes.

Builds a Llama-shaped checkpoint of random bfloat16 weights in a child process (a Hugging Face Llama
config.json; shards in Hugging Face naming written one at a time with safetensors, so building holds one
shard in memory; an index), then loads it in a fresh process per target dtype: that process imports torch
and flashx_batch, reads its resident set, resets the kernel's high-water mark (writes 5 to
/proc/self/clear_refs; where that is refused, the peak since start, ru_maxrss, is used and said so),
runs `load_model` on the CPU and reads the peak again. The figure is (peak - baseline) / bytes of the
model's parameters in the target dtype. It is the resident set as the kernel counts it: pages of a
memory-mapped file count while they are mapped; the page cache of files read with plain reads does not.
The figure includes what torch allocates or imports the first time a model is materialised (~36 MiB:
the first meta -> CPU tensor imports sympy) and the model's RoPE table: a constant, not per weight.

    PYTHONPATH=. python jobs/measurements/load_memory.py --out results/load_memory.json            # ~1.16 GB, 4 shards
    PYTHONPATH=. python jobs/measurements/load_memory.py --layers 8 --hidden 1024 --intermediate 2816 --out small.json
    PYTHONPATH=. python jobs/measurements/load_memory.py --dtypes float32 --tensor-parallel 2,4 --out tp.json

With `--tensor-parallel N,...` every rank r of a replica of N loads its own part (`load_model` with a
`TensorShard(r, N)`, in its own process) and the figures are per rank: its weight bytes, their share
of the whole model's times N (1.0 = exactly 1/N), and its peak over baseline.

Prints one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = ("bfloat16", "float32", "float16")  # torch is imported in the children only (the parent stays small)


def build_checkpoint(out: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                     vocab: int, shards: int, seed: int = 0) -> dict:
    """A random bfloat16 Llama checkpoint in `out`: config.json, `shards` safetensors files in the
    Hugging Face naming, model.safetensors.index.json. Returns the tensor count and bytes."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                   p + "mlp.down_proj.weight": (hidden, intermediate)}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    sizes = {k: 2 * _numel(s) for k, s in shapes.items()}
    total = sum(sizes.values())
    # consecutive tensors, a new shard once the current one holds its share (as save_pretrained cuts them)
    groups: list[list[str]] = [[]]
    filled = 0
    for name in shapes:
        if groups[-1] and filled >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(name)
        filled += sizes[name]
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for n, names in enumerate(groups, 1):
        file = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: torch.empty(shapes[k], dtype=torch.bfloat16).normal_(std=0.02, generator=g) for k in names}
        save_file(tensors, out / file, metadata={"format": "pt"})
        del tensors
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"tensors": len(shapes), "checkpoint_bytes": total, "shards": len(groups)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(model_dir: Path, dtype: str, rank: int = 0, ranks: int = 1) -> dict:
    """In this process: load `model_dir` as `dtype` on the CPU (rank `rank` of a tensor-parallel replica
    of `ranks`: its part only) and report the peak resident set over the baseline taken right before
    (after the imports)."""
    import torch

    import flashx_batch.models.loader as loader  # imported before the baseline: not part of the figure
    from flashx_batch.models.parallel import TensorShard

    shard = TensorShard(rank, ranks) if ranks > 1 else None

    baseline = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        method = "VmHWM reset via /proc/self/clear_refs"
    except OSError:
        method = "ru_maxrss (peak since process start; no reset allowed)"
    before_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    model = loader.load_model(model_dir, getattr(torch, dtype), torch.device("cpu"), 4096, shard=shard)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    after = {f: _status_kib(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # unique (ties counted once)
    peak_over = (peak - baseline) * 1024
    return {"dtype": dtype, "rank": rank, "ranks": ranks, "method": method, "load_s": round(seconds, 2),
            "weight_bytes": weight_bytes,
            "baseline_rss_mib": round(baseline / 1024, 1), "peak_rss_mib": round(peak / 1024, 1),
            "peak_over_baseline_mib": round(peak_over / 2**20, 1),
            "peak_ratio": round(peak_over / weight_bytes, 3),
            "after_load_rss_mib": round(after["VmRSS"] / 1024, 1),
            "after_load_rss_anon_mib": round(after["RssAnon"] / 1024, 1),
            "after_load_rss_file_mib": round(after["RssFile"] / 1024, 1),
            "ru_maxrss_before_mib": round(before_maxrss / 1024, 1),
            "ru_maxrss_after_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _child(argv: list[str], env: dict) -> dict:
    """Run this script with `argv` in a fresh process; its last stdout line, parsed."""
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="target dtypes, comma-separated")
    parser.add_argument("--tensor-parallel", default="", help="replica sizes N, comma-separated: each rank's load too")
    parser.add_argument("--model-dir", type=Path, help="reuse (or build into) this directory instead of a temp dir")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    parser.add_argument("--measure", choices=DTYPES, help=argparse.SUPPRESS)  # internal: the child process's mode
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # internal: ditto
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)  # internal: with --measure
    parser.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model_dir, args.measure, args.rank, args.ranks)))
        return
    if args.build_only:
        print(json.dumps(build_checkpoint(args.model_dir, args.layers, args.hidden, args.intermediate, args.heads,
                                          args.kv_heads, args.vocab, args.shards)))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                    os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="load_memory_") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        started = time.perf_counter()
        if (model_dir / "model.safetensors.index.json").is_file():
            index = json.loads((model_dir / "model.safetensors.index.json").read_text())
            built = {"tensors": len(index["weight_map"]), "checkpoint_bytes": index["metadata"]["total_size"],
                     "shards": len(set(index["weight_map"].values())), "reused": True}
        else:  # in a child too: a child inherits its parent's peak (ru_maxrss) across fork and exec
            shape = [f"--{k}={getattr(args, k.replace('-', '_'))}"
                     for k in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "shards")]
            built = _child([*shape, "--model-dir", str(model_dir), "--build-only"], env)
        built["build_s"] = round(time.perf_counter() - started, 2)
        loads = [_child(["--model-dir", str(model_dir), "--measure", dtype], env) for dtype in args.dtypes.split(",")]
        ranks = []
        for n in [int(x) for x in args.tensor_parallel.split(",") if x]:
            for dtype in args.dtypes.split(","):
                whole = next(w["weight_bytes"] for w in loads if w["dtype"] == dtype)
                for r in range(n):
                    argv = ["--model-dir", str(model_dir), "--measure", dtype, f"--rank={r}", f"--ranks={n}"]
                    one = _child(argv, env)
                    ranks.append({**one, "share_x_ranks": round(one["weight_bytes"] * n / whole, 4)})
        config = json.loads((model_dir / "config.json").read_text())
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")}
    result = {"checkpoint": {**built, **shape}, "loads": loads, **({"tensor_parallel": ranks} if ranks else {})}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
