"""The throughput harness: ours vs `transformers` on mixed, equal and few-shot workloads, side by side.

    python -m flashx_batch.bench --out DIR [--quick] [--model NAME|PATH ...] [--threads N] [--repeats N]
                                 [--no-memory] [--no-eval | --eval-only]
    python -m flashx_batch.bench --out DIR --peers ctranslate2,llama_cpp [--model PATH] [--threads N] [--quick]

`--peers`: instead of the above, ours against the engines named (`bench.peers`: their own converters,
same precision class, W1 and equal lengths, token agreement at float32) on `--model` (a directory with
tokenizer.json; default the bundled model), writing DIR/peers/peers.json. Peers are optional extras.

Models (`--model`, repeatable; default all three names): `bundled-tiny` (the bundled model),
`llama-27m` (a random ~27 M-parameter Llama), `qwen3-moe` (a random 78 M-parameter Qwen3-MoE, 8
experts, top-2: the mixture-of-experts workload), or a Hugging Face model directory. By name only (not
in the default run): the many-expert shapes `qwen3-moe-16x4`, `qwen3-moe-64x8`, `qwen3-moe-128x8` (random
Qwen3-MoE, 4 layers at hidden 256, experts x top-k; `bench.models.MOE_SHAPES`), on the MoE plan.

Per dense model (and any directory): load every variant, run the correctness gate on a sample of each
workload (also the warm-up), then time every variant on W1, W2, W3, interleaved, `--repeats` times
(rotating who goes first), re-checking the gate on the timed outputs; then sweep the batch size on W1
for the plots. `qwen3-moe` runs the same on W1 only, `transformers_arrival` against `ours_bucketed`,
without the sweep (target: ours ÷ transformers >= 2.5). Then, per model, each of those two variants
runs W1 once more in a fresh process of its own for its peak host RSS (`bench.memory`; `--no-memory`
skips it). Then the evaluation workload (`bench.eval_mc`): multiple choice on the bundled eval set
(240 items x 4 choices; 48 with --quick) through our `task=multiple_choice` job against
lm-evaluation-harness's HF backend, alternating, `--repeats` times (at most 3): same predictions, and
lm-eval's scoring time ÷ ours (target >= 3.0). `--no-eval` skips it; `--eval-only` runs only it. The
machine's bandwidth and matmul FLOP/s are measured at the start and the end of the run.

Writes DIR/results.json, DIR/results.md, DIR/throughput_vs_batch_size.png and
DIR/latency_vs_throughput.png. Exit status: 0 done (targets missed included — see the ratios),
1 the correctness gate failed (DIR/gate_failure.json written, no results), 2 bad arguments / model.

Threads default to 1: on a shared CPU, OpenMP threads that wait for a descheduled sibling make
timings erratic for both sides; pass --threads N on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashx_batch.bench import eval_mc, memory, report
from flashx_batch.bench.gate import GateCheck, GateFailure
from flashx_batch.bench.models import (
    LLAMA_27M,
    MOE_SHAPES,
    QWEN3_MOE_78M,
    moe_shape,
    parameter_count,
    random_llama,
    random_qwen3_moe,
)
from flashx_batch.bench.roofline import Machine, ModelCost, best_of, floor_seconds, measure_machine
from flashx_batch.bench.timing import rotated
from flashx_batch.bench.variants import VariantSet, build_variants
from flashx_batch.bench.workloads import FULL, QUICK, Workload, WorkloadSizes, build_all
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.bench")

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE_MODEL = REPO_ROOT / "build" / "smoke-model"  # same architecture, used until the bundled one has weights
SWEEP_VARIANTS = ("transformers_arrival", "ours_unbucketed", "ours_bucketed")
MEMORY_VARIANTS = ("transformers_arrival", "ours_bucketed")  # peak RSS, each in a process of its own


@dataclass(frozen=True)
class Settings:
    sizes: WorkloadSizes
    batch_size: int
    repeats: int
    sweep_batch_sizes: tuple[int, ...]
    sweep_repeats: int
    gate_rows: int
    sweep_variants: tuple[str, ...]
    threads: int
    seed: int
    quick: bool


QUICK_SETTINGS = dict(sizes=QUICK, batch_size=8, repeats=3, sweep_batch_sizes=(4, 8, 16), sweep_repeats=1,
                      gate_rows=2, sweep_variants=("transformers_arrival", "ours_bucketed"))
FULL_SETTINGS = dict(sizes=FULL, batch_size=8, repeats=5, sweep_batch_sizes=(2, 4, 8, 16, 32), sweep_repeats=3,
                     gate_rows=6, sweep_variants=SWEEP_VARIANTS)


@dataclass(frozen=True)
class ModelPlan:
    """What the harness runs on one model: which workloads and variants, the sweep or not, the targets."""

    workloads: tuple[str, ...] = ("W1", "W2", "W3")
    variants: tuple[str, ...] | None = None  # None: every variant
    sweep: bool = True
    targets: tuple = report.TARGETS


FULL_PLAN = ModelPlan()
# the mixture-of-experts workload: W1 only, the baseline against ours (no sweep), so that adding the
# 78 M model costs the default run minutes, not another full pass over every workload and variant
MOE_PLAN = ModelPlan(workloads=("W1",), variants=("transformers_arrival", "ours_bucketed"), sweep=False,
                     targets=report.MOE_TARGETS)
BUILTIN_MODELS = ("bundled-tiny", "llama-27m", "qwen3-moe")
# the many-expert shapes (`bench.models.MOE_SHAPES`): by name only, not in the default run
MANY_EXPERT_MODELS = tuple(MOE_SHAPES)


@dataclass
class ModelResult:
    runs: dict[str, dict[str, report.VariantRuns]]  # workload -> variant -> repeats
    sweep: list[dict]
    skipped: dict[str, str]
    workloads: dict[str, Workload]
    cost: ModelCost
    gate_checked: dict[str, dict[str, int]] = field(default_factory=dict)
    plan: ModelPlan = FULL_PLAN
    memory: dict[str, dict] = field(default_factory=dict)  # variant -> peak RSS figures (`bench.memory`)

    def set_rooflines(self, machine: Machine) -> None:
        for w, by_variant in self.runs.items():
            for v in by_variant.values():
                v.roofline = floor_seconds(self.workloads[w], v.batch_size, self.cost, machine)


def _bundled() -> Path:
    """The bundled tiny model, or the smoke model of the same architecture while it has no weights."""
    bundled = bundled_model_dir()
    if not (bundled / "config.json").is_file():
        if not (SMOKE_MODEL / "config.json").is_file():
            raise FileNotFoundError(f"{bundled} has no config.json yet and {SMOKE_MODEL} does not exist; "
                                    "pass --model PATH")
        log.info("bundled model %s has no weights yet: using %s (same architecture)", bundled, SMOKE_MODEL)
        bundled = SMOKE_MODEL
    return bundled


def builtin_model(name: str, scratch: Path) -> tuple[Path, ModelPlan]:
    """A named model's directory (random ones saved under `scratch`, seeded) and its plan."""
    if name == "bundled-tiny":
        return _bundled(), FULL_PLAN
    if name == "llama-27m":
        return random_llama(LLAMA_27M, out_dir=scratch / name), FULL_PLAN
    if name == "qwen3-moe":
        return random_qwen3_moe(QWEN3_MOE_78M, out_dir=scratch / name), MOE_PLAN
    if name in MOE_SHAPES:
        return random_qwen3_moe(MOE_SHAPES[name], out_dir=scratch / name), MOE_PLAN
    raise KeyError(name)


def resolve_models(names: list[str] | None, scratch: Path) -> dict[str, tuple[Path, ModelPlan]]:
    """`--model` values (built-in names or directories; default every built-in) -> name: (dir, plan).
    A directory runs the full plan under its own name."""
    out = {}
    for value in names or BUILTIN_MODELS:
        if value in BUILTIN_MODELS or value in MANY_EXPERT_MODELS:
            out[value] = builtin_model(value, scratch)
        else:
            out[Path(value).name] = (Path(value), FULL_PLAN)
    return out


def _round_up(n: int, k: int = 16) -> int:
    return -(-n // k) * k


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _variants(model_dir: Path, hf, batch_size: int, s: Settings, include: tuple[str, ...] | None = None) -> VariantSet:
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    return build_variants(model_dir, hf, batch_size, _round_up(s.sizes.max_prompt_len), s.sizes.max_output_len,
                          s.threads, pad_id, include)


def _timed_rounds(variants: VariantSet, workloads: dict[str, Workload], gates: dict[str, GateCheck],
                  repeats: int) -> dict[str, dict[str, report.VariantRuns]]:
    """Interleaved repeats: each round runs every workload with every variant, order rotating."""
    runs = {w: {v.name: report.VariantRuns(v.name, v.batch_size, v.gated) for v in variants.variants}
            for w in workloads}
    for turn in range(repeats):
        started = time.perf_counter()
        for name, workload in workloads.items():
            for variant in rotated(variants.variants, turn):
                result = variant.run(workload)
                gates[name].after(variant, result)
                runs[name][variant.name].add(result)
        log.info("  repeat %d/%d done in %.1fs", turn + 1, repeats, time.perf_counter() - started)
    return runs


def bench_model(name: str, model_dir: Path, s: Settings, plan: ModelPlan = FULL_PLAN,
                measure_memory: bool = False) -> ModelResult:
    """Gate, time and sweep one model as `plan` says; then, with `measure_memory`, each side's peak RSS
    on W1 in a fresh process. Raises `GateFailure` on a token mismatch."""
    started = time.perf_counter()
    hf = _load_hf(model_dir)
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    workloads = {w: workload for w, workload in build_all(s.sizes, hf.config.vocab_size, s.seed).items()
                 if w in plan.workloads}
    variants = _variants(model_dir, hf, s.batch_size, s, plan.variants)
    gates = {w: GateCheck.prepare(hf, workload, s.gate_rows, pad_id, s.seed) for w, workload in workloads.items()}
    for gate in gates.values():
        gate.before(variants.variants)  # the gate first; it is also every variant's warm-up
    log.info("%s: gate passed on %d sampled rows per workload, %.1fs", name, s.gate_rows, time.perf_counter() - started)
    runs = _timed_rounds(variants, workloads, gates, s.repeats)
    sweep = [report.sweep_point(name, runs["W1"][v]) for v in s.sweep_variants if v in runs.get("W1", {})]
    w1 = {"W1": workloads["W1"]}
    sweep_variants = tuple(v for v in s.sweep_variants if plan.variants is None or v in plan.variants)
    for batch_size in s.sweep_batch_sizes if plan.sweep else ():
        if batch_size == s.batch_size:
            continue
        extra = _variants(model_dir, hf, batch_size, s, sweep_variants)
        gates["W1"].before(extra.variants)
        sweep += [report.sweep_point(name, r) for r in _timed_rounds(extra, w1, gates, s.sweep_repeats)["W1"].values()]
        log.info("%s: sweep B=%d done", name, batch_size)
    checked = {w: dict(g.checked) for w, g in gates.items()}
    peaks = {}
    if measure_memory:
        peaks = memory.measure(model_dir, MEMORY_VARIANTS, s.quick, s.batch_size, _round_up(s.sizes.max_prompt_len),
                               s.sizes.max_output_len, s.threads, s.seed)
    log.info("%s: done in %.1fs", name, time.perf_counter() - started)
    cost = ModelCost.from_hf_dir(model_dir, parameter_count(model_dir))
    return ModelResult(runs, sweep, variants.skipped, workloads, cost, checked, plan, peaks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flashx_batch.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="small workloads, 3 repeats (a few minutes)")
    parser.add_argument("--model", action="append", metavar="NAME|PATH",
                        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}) or a Hugging Face model directory, "
                             "instead of the default (every built-in); repeatable")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-RSS runs (one fresh process per side and model)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-eval", action="store_true",
                       help="skip the evaluation workload (our multiple_choice job vs lm-eval's HF backend)")
    which.add_argument("--eval-only", action="store_true", help="run the evaluation workload only")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for every variant (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="override the interleaved repeat count")
    parser.add_argument("--batch-size", type=int, default=None, help="override the main batch size (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", default=None, metavar="NAME,...",
                        help="compare with these engines instead (bench.peers: ctranslate2, llama_cpp)")
    return parser.parse_args(argv)


def run_peers(args: argparse.Namespace) -> int:
    """`--peers`: the peer comparison (`bench.peers`) with this harness's model, threads and repeats."""
    from flashx_batch.bench import peers

    models = args.model or []
    if len(models) > 1 or any(m in BUILTIN_MODELS for m in models):
        log.error("--peers takes one --model directory (with tokenizer.json), or none for the bundled model")
        return 2
    argv = ["--out", str(args.out / "peers"), "--peers", args.peers, "--threads", str(args.threads)]
    argv += [*(["--model", models[0]] if models else []), *(["--quick"] if args.quick else []),
             *(["--repeats", str(args.repeats)] if args.repeats is not None else []),
             *(["--batch", str(args.batch_size)] if args.batch_size is not None else [])]
    return peers.main(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    base = dict(QUICK_SETTINGS if args.quick else FULL_SETTINGS)
    if args.repeats is not None:
        base["repeats"] = args.repeats
    if args.batch_size is not None:
        base["batch_size"] = args.batch_size
    return Settings(threads=args.threads, seed=args.seed, quick=args.quick, **base)


def eval_settings(s: Settings) -> eval_mc.EvalSettings:
    """The evaluation workload's size: every bundled item (48 with --quick), at most 3 repeats (each
    repeat costs about half a minute of lm-eval on one thread)."""
    return eval_mc.EvalSettings(items=eval_mc.QUICK_ITEMS if s.quick else eval_mc.FULL_ITEMS,
                                repeats=min(s.repeats, 3), threads=s.threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.peers:
        return run_peers(args)
    s = settings_from(args)
    torch.set_num_threads(s.threads)
    scratch = Path(tempfile.mkdtemp(prefix="flashx-bench-"))  # the random built-in models, removed at the end
    try:
        return _run(args, s, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, s: Settings, scratch: Path) -> int:
    try:
        planned = {} if args.eval_only else resolve_models(args.model, scratch)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    models = {name: path for name, (path, _) in planned.items()}
    missing = [str(p) for p in models.values() if not (p / "config.json").is_file()]
    if missing:
        log.error("not a Hugging Face model directory (no config.json): %s", ", ".join(missing))
        return 2
    started = time.perf_counter()
    machine_start = measure_machine("cpu")
    log.info("machine: %.1f GB/s copy bandwidth, %.1f GFLOP/s float32 matmul, %d thread(s)",
             machine_start.mem_bandwidth_gb_s, machine_start.matmul_gflop_s, machine_start.threads)
    results: dict[str, ModelResult] = {}
    try:
        for name, path in models.items():
            log.info("model %s (%s)", name, path)
            results[name] = bench_model(name, path, s, planned[name][1], measure_memory=not args.no_memory)
    except GateFailure as exc:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gate_failure.json").write_text(json.dumps(
            [{"variant": m.variant, "workload": m.workload, "row": m.row, "first_diff": m.first_diff,
              "ours": m.ours, "reference": m.reference} for m in exc.mismatches], indent=2))
        log.error("%s", exc)
        return 1
    evaluation = None
    if not args.no_eval:
        settings = eval_settings(s)
        log.info("eval workload: %d items, %d repeat(s)", settings.items, settings.repeats)
        evaluation = eval_mc.bench_eval(settings, scratch)
        torch.set_num_threads(s.threads)
    machine_end = measure_machine("cpu")
    ceiling = best_of(machine_start, machine_end)
    for r in results.values():
        r.set_rooflines(ceiling)
    doc = _document(results, models, s, machine_start, machine_end, time.perf_counter() - started)
    if evaluation is not None:
        doc["eval"] = evaluation
    sweep = [p for r in results.values() for p in r.sweep]
    for path in report.write(doc, sweep, args.out):
        log.info("wrote %s", path)
    ratio_rows = dict(doc["ratios"])
    if evaluation is not None:
        ratio_rows["eval/lm_eval_over_ours_scoring"] = evaluation["ratio_scoring"]
        log.info("eval: predictions equal %d/%d, accuracy ours %.3f, lm-eval %.3f", evaluation["predictions_equal"],
                 evaluation["items"], evaluation["accuracy"]["ours"], evaluation["accuracy"]["lm_eval"])
    for key, r in ratio_rows.items():
        if "target" in r:
            log.info("%s = %.2f (min %.2f, max %.2f), target %s: %s", key, r["median"], r["min"], r["max"],
                     r["target"], "met" if r["met"] else "NOT met")
    for model, by_variant in doc["memory"].items():
        for variant, m in by_variant.items():
            log.info("%s/%s peak RSS during W1: %s", model, variant,
                     f"{m['run_peak_rss_mib']:.0f} MiB" if "run_peak_rss_mib" in m else m.get("error", m.get("note")))
    return 0


def _document(results: dict[str, ModelResult], models: dict[str, Path], s: Settings, start: Machine, end: Machine,
              wall_s: float) -> dict:
    workloads, ratio_table, skipped = {}, {}, {}
    for name, r in results.items():
        for w, by_variant in r.runs.items():
            workloads[f"{name}/{w}"] = by_variant
        ratio_table.update(report.ratios(name, r.runs, r.plan.targets))
        skipped.update({f"{name}/{k}": v for k, v in r.skipped.items()})
    machine = best_of(start, end).as_dict()
    machine["probes"] = {when: {"mem_bandwidth_gb_s": m.mem_bandwidth_gb_s, "matmul_gflop_s": m.matmul_gflop_s}
                         for when, m in (("start", start), ("end", end))}
    machine["roofline_note"] = ("ceilings are the best of the start and end probes; roofline_fraction = floor_s / "
                                "median wall, floor from roofline.floor_seconds (attention FLOPs left out)")
    descriptions = build_all(s.sizes, 256, s.seed)  # descriptions only depend on the sizes
    checked = {f"{m}/{w}": c for m, r in results.items() for w, c in r.gate_checked.items()}
    run = {
        "quick": s.quick, "repeats": s.repeats, "batch_size": s.batch_size, "threads": s.threads, "seed": s.seed,
        "sweep_batch_sizes": list(s.sweep_batch_sizes), "sweep_repeats": s.sweep_repeats,
        "models": {k: _model_entry(v, results[k].plan) for k, v in models.items()},
        "workloads": {k: w.description for k, w in descriptions.items()},
        "rows": {k: w.rows for k, w in descriptions.items()},
        "skipped": skipped, "wall_s": wall_s,
        "gate": (f"passed: greedy tokens of every gated variant equal transformers (one row at a time, unpadded) on "
                 f"{s.gate_rows} sampled rows per workload, before timing and again on every timed run. "
                 f"Rows compared per variant: {json.dumps(checked)}"),
    }
    memory_doc = {name: r.memory for name, r in results.items() if r.memory}
    return report.results_document(workloads, ratio_table, machine, run, memory_doc)


def _model_entry(model_dir: Path, plan: ModelPlan) -> dict:
    """results.json's run.models entry: where, how many parameters, the experts of an MoE, what ran."""
    entry = {"path": str(model_dir), "parameters": parameter_count(model_dir),
             "architecture": json.loads((model_dir / "config.json").read_text()).get("architectures", ["?"])[0],
             "workloads": list(plan.workloads), "variants": list(plan.variants) if plan.variants else "all"}
    moe = moe_shape(model_dir)
    if moe:
        entry["moe"] = {**moe, "active_parameters": entry["parameters"] - moe["expert_parameters"]
                        + moe["active_expert_parameters"]}
    return entry


if __name__ == "__main__":
    raise SystemExit(main())
