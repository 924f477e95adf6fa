"""The offline quantize step end to end: sensitivity scan -> search -> held-out validation -> map.

`build_precision_map` is what `python -m flashx_batch.quantize` runs once the model is loaded and the
text is tokenized into windows; tests call it directly on tiny random models. `summary_markdown`
renders the table the README shows.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashx_batch.models.decoder import DecoderModel
from flashx_batch.quant import formats as fm
from flashx_batch.quant.linear import QuantLinear, SplitLinear
from flashx_batch.quant.planner import plan
from flashx_batch.quant.precision_map import (
    MAP_FORMAT,
    MAP_VERSION,
    PrecisionMap,
    PrecisionMapError,
    loaded_summary,
    model_identity,
)
from flashx_batch.quant.sensitivity import Score, Validation, WindowScorer, kernel_check, scan_units, validate
from flashx_batch.quant.units import (
    FormatSwap,
    Unit,
    available_formats,
    model_units,
    resident_unit_bytes,
    unit_bytes,
)

log = logging.getLogger(__name__)
OBJECTIVES = ("resident", "streamed")


@dataclass
class PlanSettings:
    """Knobs of one planning run (the `budget.*`, `quant.*` and `eval.*` keys of the CLI)."""

    max_ppl_increase: float = 0.05  # relative: 0.05 = perplexity may rise by 5 %
    plan_fraction: float = 0.5  # share of the budget the search may spend (the rest is margin)
    max_upgrades: int = 50
    objective: str = "resident"  # resident: bytes held in memory; streamed: bytes read per decode step
    formats: list[str] = field(default_factory=lambda: ["int4", "int8", "bf16"])
    group_size: int = 64
    batch_size: int = 8
    bootstrap: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in fm.FORMATS]
        if unknown:
            raise ValueError(f"quant.formats: unknown {unknown}; known: {', '.join(fm.FORMATS)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"budget.objective={self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.group_size not in fm.INT4_GROUP_SIZES:
            raise ValueError(f"quant.group_size={self.group_size} is not one of {fm.INT4_GROUP_SIZES}")
        if not 0 < self.plan_fraction <= 1:
            raise ValueError(f"budget.plan_fraction must be in (0, 1], got {self.plan_fraction}")


def _costs(units: list[Unit], candidates: dict[str, list[str]], settings: PlanSettings, model: DecoderModel
           ) -> dict[str, dict[str, int]]:
    dtype, tied = model.embed.dtype, model.lm_head.weight is model.embed
    if settings.objective == "streamed":
        return {u.name: {f: unit_bytes(u, f, settings.group_size, dtype) for f in candidates[u.name]} for u in units}
    return {u.name: {f: resident_unit_bytes(u, f, settings.group_size, dtype, tied) for f in candidates[u.name]}
            for u in units}


def _unit_kernels(model: DecoderModel, units: list[Unit]) -> dict[str, str]:
    """The kernel each unit runs (read from the swapped-in modules)."""
    out = {}
    for unit in units:
        module = model.get_submodule(unit.module)
        if unit.stack:  # a `SparseMoE`: its quantized stack's kernel, if that stack is quantized
            out[unit.name] = module.quantized[unit.stack].kernel if unit.stack in module.quantized else "native"
        elif isinstance(module, SplitLinear):
            start = 0
            for part in module.parts:
                if start <= unit.start < start + part.out_features:
                    out[unit.name] = part.kernel
                start += part.out_features
        else:
            out[unit.name] = module.kernel if isinstance(module, QuantLinear) else "native"
    return out


def _figures(model: DecoderModel, units: list[Unit], assignment: dict[str, str], settings: PlanSettings,
             validation: Validation | None) -> dict:
    """Bytes and quality of one assignment, in the map's `result` / `references` shape."""
    dtype = model.embed.dtype
    with FormatSwap(model, assignment, settings.group_size, units):
        resident = loaded_summary(model)["weight_bytes"]
    streamed = sum(unit_bytes(u, assignment[u.name], settings.group_size, dtype) for u in units)
    params = sum(u.params for u in units)
    counts: dict[str, int] = {}
    for fmt in assignment.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    out = {"units_per_format": counts, "weight_bytes": resident, "unit_bytes": streamed,
           "average_bits": 8.0 * streamed / params}
    if validation is not None:
        out.update({"delta_ppl": validation.delta_ppl, "delta_ppl_ci95": list(validation.ci95),
                    "delta_nll": validation.delta_nll, "mean_kl": validation.kl, "top1_agreement": validation.top1})
    return out


def reusable_scan(previous: PrecisionMap, model: DecoderModel, model_dir: Path, settings: PlanSettings
                  ) -> dict[str, dict[str, Score]]:
    """The sensitivity scan of an earlier map for the same weights, formats and group size (re-planning
    at another budget without re-measuring); raises PrecisionMapError when it does not apply."""
    previous.check_matches(model, model_dir)
    proto = previous.data["protocol"]
    if (previous.data["model"]["dtype"] != fm.format_of_dtype(model.embed.dtype)
            or proto["group_size"] != settings.group_size or not set(settings.formats) <= set(proto["formats"])):
        raise PrecisionMapError(f"{previous.path}: its scan used dtype {previous.data['model']['dtype']}, group size "
                                f"{proto['group_size']}, formats {proto['formats']}; this run asks for "
                                f"{fm.format_of_dtype(model.embed.dtype)}, {settings.group_size}, {settings.formats}.")
    return {t["unit"]: {f: Score(**v) for f, v in t["sensitivity"].items()
                        if f in settings.formats or f == previous.data["model"]["dtype"]}
            for t in previous.data["tensors"]}


def build_precision_map(model: DecoderModel, model_dir: Path, calib_windows: list[list[int]],
                        eval_windows: list[list[int]], settings: PlanSettings, provenance: dict | None = None,
                        weights_sha256: str | None = None,
                        sensitivity: dict[str, dict[str, Score]] | None = None) -> PrecisionMap:
    """Measure, search and validate; returns the map (not yet saved).

    `provenance` describes where the windows came from (paths, offsets); it lands in `protocol`.
    `sensitivity` (from `reusable_scan`) skips the scan; the calibration windows are then unused."""
    started = time.perf_counter()
    units = model_units(model)
    native = fm.format_of_dtype(model.embed.dtype)
    candidates = {u.name: list(dict.fromkeys([*available_formats(u, settings.formats, settings.group_size), native]))
                  for u in units}
    float_bytes = loaded_summary(model)["weight_bytes"]

    if sensitivity is None:
        calib = WindowScorer(model, calib_windows, settings.batch_size, cache_layers=True)
        log.info("calibration: %d windows x %d tokens; scanning %d units x %s", calib.windows, calib.length,
                 len(units), settings.formats)
        sensitivity = scan_units(calib, units, settings.formats, settings.group_size)
        del calib  # the cached layer inputs are the largest thing held
    scan_s = time.perf_counter() - started

    held_out = WindowScorer(model, eval_windows, settings.batch_size, cache_layers=False)
    check = functools.partial(validate, held_out, units=units, group_size=settings.group_size,
                              resamples=settings.bootstrap, seed=settings.seed)
    result = plan(units, sensitivity, _costs(units, candidates, settings, model), settings.max_ppl_increase,
                  check, settings.plan_fraction, settings.max_upgrades)
    references = {}
    for name, fmt in (("all_int8", "int8"), ("all_int4", "int4")):
        assignment = {u.name: fmt if fmt in available_formats(u, [fmt], settings.group_size) else "int8"
                      for u in units}
        references[name] = _figures(model, units, assignment, settings, check(assignment))
        log.info("reference %s: ΔPPL %+.4f [%+.4f, %+.4f], %d bytes", name, references[name]["delta_ppl"],
                 *references[name]["delta_ppl_ci95"], references[name]["weight_bytes"])
    references["unquantized"] = {"weight_bytes": float_bytes, "format": native}

    with FormatSwap(model, result.assignment, settings.group_size, units):
        kernels = _unit_kernels(model, units)
    dtype = model.embed.dtype
    tensors = [{
        "unit": u.name, "tensor": u.tensor, "rows": [u.start, u.stop], "shape": [u.out_features, u.in_features],
        "format": result.assignment[u.name],
        "group_size": (fm.int4_group_size(u.in_features, settings.group_size)
                       if result.assignment[u.name] == "int4" else None),
        "kernel": kernels[u.name],
        "bytes": unit_bytes(u, result.assignment[u.name], settings.group_size, dtype),
        "sensitivity": {f: s.as_dict() for f, s in sensitivity[u.name].items()},
    } for u in units]
    unit_tensors = {u.tensor for u in units}
    kept = [{"tensor": name, "shape": list(p.shape), "format": native, "bytes": p.numel() * p.element_size(),
             "why": "embeddings, norms and biases keep the model's precision"}
            for name, p in model.named_parameters() if name not in unit_tensors]
    figures = _figures(model, units, result.assignment, settings, result.validation)
    figures["kernels_vs_simulated"] = kernel_check(model, eval_windows[:2], result.assignment, units,
                                                   settings.group_size)
    figures.update({"max_ppl_increase": settings.max_ppl_increase, "passed": result.passed,
                    "searched_units_per_format": _figures(model, units, result.searched, settings, None)[
                        "units_per_format"],
                    "upgrades": result.upgrades, "seconds": time.perf_counter() - started, "scan_seconds": scan_s})
    data = {
        "format": MAP_FORMAT, "version": MAP_VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tool": "python -m flashx_batch.quantize",
        "model": model_identity(model, model_dir, weights_sha256),
        "protocol": {
            **(provenance or {}),
            "calibration_windows": len(calib_windows), "calibration_tokens_per_window": len(calib_windows[0]),
            "validation_windows": held_out.windows, "validation_tokens_per_window": held_out.length,
            "validation_predicted_tokens": held_out.tokens,
            "formats": settings.formats, "group_size": settings.group_size, "objective": settings.objective,
            "sensitivity": "each unit alone at each format, all else float; teacher-forced over the calibration "
                           "windows, re-running only the unit's layer onward from cached layer inputs; "
                           "ΔNLL and KL(float || quantized) per predicted token",
            "search": f"multiple-choice knapsack (DP): min {settings.objective} bytes s.t. sum of max(ΔNLL, KL) <= "
                      f"{settings.plan_fraction} x ln(1 + max_ppl_increase)",
            "quantization_in_measurements": "simulated: each format's exact weight values, dequantized, float "
                                            "matmul; real kernels compared in result.kernels_vs_simulated",
            "validation": "whole map on held-out windows disjoint from calibration; relative ΔPPL = exp(ΔNLL) - 1; "
                          "paired bootstrap over windows, 95 % percentile interval; upgrade the unit with the "
                          "highest max(ΔNLL, KL) one step while the upper bound exceeds the budget",
            "bootstrap": {"resamples": settings.bootstrap, "seed": settings.seed, "level": 0.95},
            "settings": asdict(settings),
        },
        "tensors": tensors, "kept": kept, "result": figures, "references": references,
    }
    log.info("planned %s: ΔPPL %+.4f [%+.4f, %+.4f] (budget %.3f, %s), %d bytes vs all-int8 %d, %.0fs",
             figures["units_per_format"], figures["delta_ppl"], *figures["delta_ppl_ci95"], settings.max_ppl_increase,
             "passed" if result.passed else "FAILED", figures["weight_bytes"], references["all_int8"]["weight_bytes"],
             figures["seconds"])
    return PrecisionMap(data)


def summary_markdown(pmap: PrecisionMap) -> str:
    """The README table: units per format, ΔPPL with CI, KL, top-1, bytes, average bits."""
    d = pmap.data
    res, refs = d["result"], d["references"]
    proto = d["protocol"]
    lines = [
        f"Precision map for `{d['model']['path']}` ({d['model']['dtype']}, weights sha256 "
        f"`{d['model']['weights_sha256'][:12]}`), budget ΔPPL ≤ {res['max_ppl_increase']:.1%} at the 95 % upper "
        f"bound — **{'passed' if res['passed'] else 'NOT passed'}**. Validation: {proto['validation_windows']} "
        f"held-out windows x {proto['validation_tokens_per_window']} tokens "
        f"({proto['validation_predicted_tokens']} predicted tokens); bootstrap {proto['bootstrap']['resamples']}.",
        "",
        "| configuration | units per format | ΔPPL (95 % CI) | mean KL | top-1 | weight bytes | unit bytes "
        "| avg bits |",
        "|---|---|---|---|---|---|---|---|",
        f"| unquantized | all {refs['unquantized']['format']} | 0 | 0 | 1 | {refs['unquantized']['weight_bytes']:,} "
        "| | |",
    ]
    for name, r in (("all-int8", refs["all_int8"]), ("all-int4", refs["all_int4"]), ("**planned**", res)):
        counts = ", ".join(f"{f} {n}" for f, n in sorted(r["units_per_format"].items()))
        lo, hi = r["delta_ppl_ci95"]
        lines.append(f"| {name} | {counts} | {r['delta_ppl']:+.2%} ({lo:+.2%}, {hi:+.2%}) | {r['mean_kl']:.4f} | "
                     f"{r['top1_agreement']:.4f} | {r['weight_bytes']:,} | {r['unit_bytes']:,} | "
                     f"{r['average_bits']:.2f} |")
    kc = res.get("kernels_vs_simulated")
    if kc:
        lines += ["", f"Kernels that run vs the simulated weights measured above ({kc['windows']} windows): mean KL "
                      f"{kc['mean_kl']:.2e}, top-1 {kc['top1_agreement']:.4f}, "
                      f"max |Δlogit| {kc['max_abs_logit_diff']:.2e}."]
    if res["upgrades"]:
        lines += ["", "Upgrades after validation: " + "; ".join(
            f"{u['unit']} {u['from']}→{u['to']}" for u in res["upgrades"])]
    return "\n".join(lines) + "\n"
