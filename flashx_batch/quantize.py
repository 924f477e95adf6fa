"""`python -m flashx_batch.quantize key=value ...`: plan a per-unit precision map for a model, or write it as
a W8A8 int8 checkpoint.

    python -m flashx_batch.quantize model.path=/models/m calib.path=my_text.jsonl budget.max_ppl_increase=0.05
    python -m flashx_batch.quantize model.path=/models/m output.checkpoint=/models/m-w8a8

Keys (defaults in brackets; `key=value`, Hydra-style dotted names, parsed by OmegaConf against the
dataclasses below, so an unknown key or a badly typed value is an error, exit code 2):
  model.path [bundled legal-tiny]   model.dtype [float32]: the dtype planned, measured and run in
  calib.path [bundled held-out split]: .jsonl with a "text" field per line, or a plain .txt file
  calib.windows [16]  calib.length [256]: calibration windows (tokens each) for the sensitivity scan
  calib.reuse_scan [none]: an earlier precision map of the same weights; re-plan (another budget)
      with its sensitivity scan instead of measuring again
  eval.path [bundled held-out split]  eval.windows [64]  eval.length [256]  eval.bootstrap [2000]  eval.seed [0]
      when calib and eval read the same file, eval's windows start after calib's (disjoint).
  budget.max_ppl_increase [0.05] (relative)  budget.plan_fraction [0.5]  budget.max_upgrades [50]
  budget.objective [resident]: minimise resident bytes, or `streamed` (bytes a decode step reads)
  quant.formats [[int4,int8,bf16]]  quant.group_size [64]
  output.path [results/quant/precision_map.json] (+ a .md summary beside it)
  output.checkpoint [none]: instead of planning, write the model as a compressed-tensors W8A8 checkpoint in
      this new directory (int8 weights per output channel, int8 activations per token at run time; read
      by this runtime's int8 kernels and by vLLM); every node then loads it with model.path=DIR
  runtime.num_threads [all cores]  runtime.batch_size [8]: windows per forward. On a shared CPU pass
      runtime.num_threads=1: OpenMP threads waiting on descheduled siblings made the bundled model's
      run 6x slower (365 s vs 57 s) on a 2-core machine with other jobs running.

Exit codes: 0 the map passed its budget, 1 it did not (written anyway, `result.passed: false`),
2 bad arguments or inputs. Use the map with `runtime.precision_map=PATH`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("flashx_batch.quantize")


@dataclass
class ModelArgs:
    path: str | None = None
    dtype: str = "float32"


@dataclass
class TextArgs:
    path: str | None = None
    windows: int = 16
    length: int = 256


@dataclass
class CalibArgs(TextArgs):
    reuse_scan: str | None = None  # an earlier map of the same weights: re-plan without re-measuring


@dataclass
class EvalArgs(TextArgs):
    windows: int = 64
    bootstrap: int = 2000
    seed: int = 0


@dataclass
class BudgetArgs:
    max_ppl_increase: float = 0.05
    plan_fraction: float = 0.5
    max_upgrades: int = 50
    objective: str = "resident"


@dataclass
class QuantArgs:
    formats: list[str] = field(default_factory=lambda: ["int4", "int8", "bf16"])
    group_size: int = 64


@dataclass
class OutputArgs:
    path: str = "results/quant/precision_map.json"
    checkpoint: str | None = None  # write a W8A8 compressed-tensors checkpoint here instead of planning


@dataclass
class RuntimeArgs:
    num_threads: int | None = None
    batch_size: int = 8


@dataclass
class QuantizeArgs:
    model: ModelArgs = field(default_factory=ModelArgs)
    calib: CalibArgs = field(default_factory=CalibArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    budget: BudgetArgs = field(default_factory=BudgetArgs)
    quant: QuantArgs = field(default_factory=QuantArgs)
    output: OutputArgs = field(default_factory=OutputArgs)
    runtime: RuntimeArgs = field(default_factory=RuntimeArgs)


def parse_args(argv: list[str]) -> QuantizeArgs:
    """`key=value` overrides onto the `QuantizeArgs` defaults; raises ConfigError on any mistake."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from flashx_batch.errors import ConfigError

    bad = [a for a in argv if "=" not in a]
    if bad:
        raise ConfigError(f"arguments must be key=value, got {bad}; see `python -m flashx_batch.quantize --help`.")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(QuantizeArgs), OmegaConf.from_dotlist(argv))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad argument: {str(exc).splitlines()[0]}") from exc


def read_windows(tokenizer, path: Path, length: int, count: int, skip: int = 0) -> list[list[int]]:
    """`count` windows of `length` tokens after the first `skip` windows of `path` (.jsonl "text" / .txt)."""
    from flashx_batch.errors import ConfigError
    from flashx_batch.quality.heldout import token_windows

    if not path.is_file():
        raise ConfigError(f"{path}: no such file.")
    if path.suffix == ".jsonl":
        windows = token_windows(tokenizer, length, skip + count, path)
    else:
        stream = tokenizer.encode(path.read_text(errors="replace"))
        windows = [stream[i : i + length] for i in range(0, len(stream) - length + 1, length)][: skip + count]
    windows = windows[skip:]
    if len(windows) < count:
        raise ConfigError(f"{path}: only {len(windows)} windows of {length} tokens after skipping {skip}; "
                          f"{count} were asked for. Lower the window count or length, or give more text.")
    return windows


def run(args: QuantizeArgs) -> int:
    """Load, tokenize, plan, write; the exit code (0 passed, 1 budget not met)."""
    import torch

    from flashx_batch.models.loader import load_model
    from flashx_batch.quality.heldout import HELDOUT
    from flashx_batch.quant import load_precision_map
    from flashx_batch.quant.pipeline import PlanSettings, build_precision_map, reusable_scan, summary_markdown
    from flashx_batch.runtime.options import bundled_model_dir
    from flashx_batch.runtime.tokenizer import Tokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if args.model.dtype not in dtypes:
        from flashx_batch.errors import ConfigError

        raise ConfigError(f"model.dtype={args.model.dtype!r} is not one of {', '.join(dtypes)}.")
    torch.set_num_threads(args.runtime.num_threads or len(os.sched_getaffinity(0)))
    model_dir = Path(args.model.path) if args.model.path else bundled_model_dir()
    if args.output.checkpoint:
        from flashx_batch.quant.w8a8_export import write_w8a8

        counts = write_w8a8(model_dir, Path(args.output.checkpoint))
        log.info("wrote %s: %d linears as W8A8 int8, %d tensors as they were", args.output.checkpoint,
                 counts["quantized_linears"], counts["other_tensors"])
        return 0
    settings = PlanSettings(args.budget.max_ppl_increase, args.budget.plan_fraction, args.budget.max_upgrades,
                            args.budget.objective, list(args.quant.formats), args.quant.group_size,
                            args.runtime.batch_size, args.eval.bootstrap, args.eval.seed)
    tokenizer = Tokenizer(model_dir)
    calib_path = Path(args.calib.path) if args.calib.path else HELDOUT
    eval_path = Path(args.eval.path) if args.eval.path else HELDOUT
    calib = read_windows(tokenizer, calib_path, args.calib.length, args.calib.windows)
    same_file = calib_path.resolve() == eval_path.resolve()
    skip = args.calib.windows if same_file and args.calib.length == args.eval.length else 0
    if same_file and not skip:
        raise ValueError("calib and eval read the same file: give them the same length so their windows are disjoint")
    held_out = read_windows(tokenizer, eval_path, args.eval.length, args.eval.windows, skip=skip)
    if same_file:
        log.warning("calibration and validation both come from %s (disjoint windows: validation skips the first "
                    "%d); pass calib.path=YOUR_TEXT to plan on your own data", calib_path, skip)
    model = load_model(model_dir, dtypes[args.model.dtype], torch.device("cpu"),
                       max(args.calib.length, args.eval.length))
    provenance = {"calibration_source": str(calib_path), "validation_source": str(eval_path),
                  "validation_skips_windows": skip}
    scan = None
    if args.calib.reuse_scan:
        scan = reusable_scan(load_precision_map(args.calib.reuse_scan), model, model_dir, settings)
        provenance["sensitivity_reused_from"] = args.calib.reuse_scan
    pmap = build_precision_map(model, model_dir, calib, held_out, settings, provenance, sensitivity=scan)
    out = Path(args.output.path)
    pmap.save(out)
    summary = summary_markdown(pmap)
    out.with_suffix(".md").write_text(summary)
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    print(summary)
    if not pmap.data["result"]["passed"]:
        log.error("the map does not meet budget.max_ppl_increase=%s at the 95 %% upper bound even after %d upgrades; "
                  "raise budget.max_upgrades or the budget, or add formats", settings.max_ppl_increase,
                  len(pmap.data["result"]["upgrades"]))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from flashx_batch.errors import FlashxError

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return run(parse_args(argv))
    except (FlashxError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    except json.JSONDecodeError as exc:
        log.error("unreadable input: %s", exc)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
