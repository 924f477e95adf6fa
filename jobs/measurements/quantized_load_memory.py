"""Peak host memory while loading pre-quantized checkpoints, as a multiple of their bytes on disk.

Builds a random Llama-shaped bfloat16 checkpoint (`load_memory.build_checkpoint`, sharded), then writes it
in each format, a child process per format reading one tensor at a time: FP8 block-wise 128x128
(`weight_scale_inv`), GPTQ int4 group 128 (v1 zero points, symmetric), AWQ GEMM int4 group 128 (zero
points), compressed-tensors W8A8 (`python -m flashx_batch.quantize output.checkpoint=`) and
compressed-tensors W4A16 group 128 (the library's `pack_to_int32`). Each is then loaded the way the
engine loads it (`load_model(..., quantized_linears=quant.checkpoint_linear.quantized_linear)`, bfloat16:
the checkpoints' float tensors' own dtype) in a fresh process that measures its resident set as
`load_memory.measure` does (VmHWM reset right before the load; torch, the loader and the compressed-tensors
library imported before it: constants of the process, the library's own cost reported beside). The figure
is the peak over that baseline ÷ the checkpoint's safetensors bytes; it includes what torch allocates the
first time a model is materialised and the RoPE table (constants, not per weight: small shapes read high).

    PYTHONPATH=. python jobs/measurements/quantized_load_memory.py --out docs/results/quantized_load_memory

Prints one JSON object (also written to OUT/quantized_load_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_memory  # noqa: E402  (the sibling measurement: its checkpoint builder and /proc readers)

FORMATS = ("fp8_block", "gptq_int4", "awq_int4", "ct_w8a8", "ct_w4a16")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128


def _pack8(values, dim: int):
    """int64 values 0..15 -> int32 words, eight consecutive along `dim` per word, lowest nibble first."""
    import torch

    moved = values.movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, 8)
    words = sum(grouped[..., s] << (4 * s) for s in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _convert(name: str, w, fmt: str, group: int = GROUP) -> dict:
    """One float linear weight [N, K] -> the tensors `fmt` stores for it."""
    import torch

    base = name[: -len("weight")]
    w = w.float()
    out, inp = w.shape
    if fmt == "fp8_block":
        rows, cols = -(-out // 128), -(-inp // 128)
        padded = torch.nn.functional.pad(w, (0, cols * 128 - inp, 0, rows * 128 - out))
        scale = padded.reshape(rows, 128, cols, 128).abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        expanded = scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
        return {name: (w / expanded).to(torch.float8_e4m3fn), name + "_scale_inv": scale}
    groups = w.reshape(out, inp // group, group)
    if fmt == "gptq_int4":  # symmetric: zero point 8; qzeros stored v1 (word minus 0x11111111)
        scale = (groups.abs().amax(2) / 7.5).clamp(min=1e-8).half()  # [N, G]
        q = (torch.round(groups / scale.float()[..., None]) + 8).clamp(0, 15).long().reshape(out, inp)
        zeros = torch.full((inp // group, out), 8, dtype=torch.int64)
        qzeros = (_pack8(zeros, 1).long() - 0x11111111) % 2**32
        qzeros = torch.where(qzeros >= 2**31, qzeros - 2**32, qzeros).to(torch.int32)
        return {base + "qweight": _pack8(q.t(), 0), base + "qzeros": qzeros, base + "scales": scale.t().contiguous()}
    if fmt == "awq_int4":
        low, high = groups.amin(2), groups.amax(2)
        scale = ((high - low) / 15).clamp(min=1e-8).half()
        zero = torch.round(-low / scale.float()).clamp(0, 15).long()  # [N, G]
        q = (torch.round(groups / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long().reshape(out, inp)
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's nibble order within a word

        def awq_pack(values):  # [R, N] -> [R, N / 8]
            grouped = values.reshape(values.shape[0], -1, 8)[..., order]
            return _pack8(grouped.reshape(values.shape[0], -1), 1)

        return {base + "qweight": awq_pack(q.t()), base + "qzeros": awq_pack(zero.t().contiguous()),
                base + "scales": scale.t().contiguous()}
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    scale = (groups.abs().amax(2) / 7.5).clamp(min=1e-8).to(torch.bfloat16)  # ct_w4a16, symmetric
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).reshape(out, inp)
    return {base + "weight_packed": pack_to_int32(q, 4), base + "weight_scale": scale,
            base + "weight_shape": torch.tensor([out, inp])}


def write_format(source: Path, out: Path, fmt: str, group: int = GROUP) -> None:
    """`source` (a float checkpoint) written as `fmt` into `out`, one tensor at a time (int4 in groups of `group`);
    its tokenizer and other files copied."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from flashx_batch.models.loader import weight_files

    if fmt == "ct_w8a8":
        subprocess.run([sys.executable, "-m", "flashx_batch.quantize", f"model.path={source}",
                        f"output.checkpoint={out}"], check=True, capture_output=True)
        return
    out.mkdir(parents=True)
    files = weight_files(source)
    weight_map = {}
    for path in files:
        tensors = {}
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                tensor = fh.get_tensor(name)
                tensors.update(_convert(name, tensor, fmt, group)
                               if name.endswith(tuple(f"{x}.weight" for x in LINEARS)) else {name: tensor})
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, path.name)
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]},
        "gptq_int4": {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False},
        "awq_int4": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
        "ct_w4a16": _ct_w4a16_config(group),
    }[fmt]
    (out / "config.json").write_text(json.dumps(config))
    for other in source.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(other, out / other.name)


def _ct_w4a16_config(group: int) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": group})})
    return json.loads(QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                         ignore=["lm_head"]).model_dump_json())


def measure(model_dir: Path) -> dict:
    import torch

    import flashx_batch.models.loader as loader
    from flashx_batch.quant.checkpoint_linear import quantized_linear

    before_imports = load_memory._status_kib("VmRSS")
    # the compressed-tensors library (and the transformers modules it imports), imported before the baseline like
    # torch and the loader: a constant of the process, not of the weights; its cost is reported on its own
    import compressed_tensors.compressors.pack_quantized.helpers  # noqa: F401
    import compressed_tensors.quantization  # noqa: F401

    baseline = load_memory._status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    started = time.perf_counter()
    model = loader.load_model(model_dir, torch.bfloat16, torch.device("cpu"), 4096,
                              quantized_linears=quantized_linear)
    seconds = time.perf_counter() - started
    peak = load_memory._status_kib("VmHWM")
    seen, resident = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            resident += tensor.numel() * tensor.element_size()
    resident += sum(m.nbytes() - sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n != "bias")
                    for m in model.modules() if type(m).__name__ == "QuantLinear")  # oneDNN-packed weights
    disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    kinds = sorted({f"{type(m).__name__}:{getattr(m, 'kernel', '')}" for m in model.modules()
                    if type(m).__name__ in ("QuantLinear", "DequantizingLinear")})
    return {"compressed_tensors_import_mib": round((baseline - before_imports) / 1024, 1), "disk_bytes": disk,
            "resident_weight_bytes": resident, "load_s": round(seconds, 2),
            "peak_over_baseline_mib": round((peak - baseline) / 1024, 1),
            "peak_over_disk": round((peak - baseline) * 1024 / disk, 3), "modules": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--write", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.write:
        write_format(Path(args.write[0]), Path(args.write[1]), args.write[2])
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                    os.environ.get("PYTHONPATH")]))}

    def child(*argv: str) -> str:
        proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=False)
        if proc.returncode:
            raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
        return proc.stdout

    with tempfile.TemporaryDirectory(prefix="quantized_load_memory_") as tmp:
        source = Path(tmp) / "bf16"
        subprocess.run([sys.executable, load_memory.__file__, "--model-dir", str(source), "--build-only",
                        f"--layers={args.layers}", f"--hidden={args.hidden}", f"--intermediate={args.intermediate}",
                        "--heads=16", "--kv-heads=4", f"--vocab={args.vocab}", "--shards=4"],
                       check=True, capture_output=True, env=env)
        loads = {}
        for fmt in args.formats.split(","):
            child("--write", str(source), str(Path(tmp) / fmt), fmt)
            loads[fmt] = json.loads(child("--measure", str(Path(tmp) / fmt)).strip().splitlines()[-1])
            print(fmt, loads[fmt], file=sys.stderr)
    result = {"shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                        "vocab": args.vocab, "float_dtype": "bfloat16"}, "loads": loads}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantized_load_memory.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
