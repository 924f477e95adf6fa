"""Teacher-forced measurement of quantized models against the float model, cheaply.

`WindowScorer` runs the float model once over fixed-length token windows and keeps, per chunk of
windows, the reference logits and (for calibration) every layer's input hidden states. Scoring a
unit of layer i then re-runs only layers i..L-1 and the head from the cached input of layer i —
quantizing a unit cannot change anything before its layer — and lm_head re-runs the head only. On
average that is about half a forward pass per (unit, format), with no KV cache, no decoding and no
engine: windows all have the same length, so one causal prefill per chunk covers them.

Called by `quant.planner` (sensitivity scan over calibration windows; validation of whole maps over
held-out windows). Measures with `quant.agreement.Agreement`: ΔNLL and KL(float || quantized) per
predicted token, top-1 agreement, and the per-window ΔNLL the bootstrap resamples.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import torch

from flashx_batch.backends.attention.meta import TeacherForced
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.quant import formats as fm
from flashx_batch.quant.agreement import Agreement
from flashx_batch.quant.units import FormatSwap, Unit, available_formats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    """One quantized configuration against the float model, per predicted token."""

    delta_nll: float  # mean NLL(quantized) - NLL(float), nats
    kl: float  # mean KL(float || quantized)
    top1: float  # share of positions where both argmaxes agree

    @classmethod
    def of(cls, agreement: Agreement) -> Score:
        s = agreement.summary()
        return cls(s["delta_nll"], s["mean_kl"], s["top1_agreement"])

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class WindowScorer:
    """Fixed windows of `T` tokens, run as causal prefills in chunks of `batch_size` rows."""

    def __init__(self, model: DecoderModel, windows: list[list[int]], batch_size: int = 8,
                 cache_layers: bool = True) -> None:
        lengths = {len(w) for w in windows}
        if len(lengths) != 1 or min(lengths) < 2:
            raise ValueError(f"windows must share one length >= 2, got lengths {sorted(lengths)[:5]}")
        self.model = model
        self.length = lengths.pop()
        self.batch_size = batch_size
        self.cache_layers = cache_layers
        device = model.embed.device
        model.build_rotary(self.length)
        cos, sin = model.rotary.lookup(torch.arange(self.length, device=device)[None, :])
        self.meta = TeacherForced(cos, sin)  # teacher-forced windows: no KV cache
        self.attention = model.attention.for_meta(self.meta)  # the layers' attention backend for such passes
        ids = torch.tensor(windows, dtype=torch.long, device=device)  # [N, T]
        self.chunks = list(ids.split(batch_size))
        self.inputs: list[list[torch.Tensor]] = []  # [chunk][layer] hidden entering that layer (L+1: the head)
        self.reference: list[torch.Tensor] = []  # [chunk] float logits [b, T-1, V]
        self._capture()

    @property
    def windows(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def tokens(self) -> int:
        """Predicted positions per evaluation (T - 1 per window)."""
        return self.windows * (self.length - 1)

    @torch.inference_mode()
    def _capture(self) -> None:
        for ids in self.chunks:
            x = torch.nn.functional.embedding(ids, self.model.embed)
            states = [x]
            for layer in self.model.layers:
                x = layer(x, self.meta, self.attention, None)
                states.append(x)
            self.inputs.append(states if self.cache_layers else [])
            self.reference.append(self._head(x))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.model.norm(x[:, :-1]))  # the last position predicts nothing here

    @torch.inference_mode()
    def logits_from(self, chunk: int, layer: int) -> torch.Tensor:
        """Logits [b, T-1, V] of chunk `chunk` re-run from the input of `layer` (num_layers = head only)."""
        if self.cache_layers:
            x = self.inputs[chunk][layer]
        elif layer == 0:
            x = torch.nn.functional.embedding(self.chunks[chunk], self.model.embed)
        else:
            raise ValueError("layer inputs were not cached; build the scorer with cache_layers=True")
        for block in self.model.layers[layer:]:
            x = block(x, self.meta, self.attention, None)
        return self._head(x)

    def compare(self, start_layer: int = 0) -> Agreement:
        """Agreement of the model as it is now (some units swapped) with the captured float model."""
        agreement = Agreement()
        for c, ids in enumerate(self.chunks):
            logits = self.logits_from(c, start_layer)
            for row in range(len(ids)):
                agreement.add(self.reference[c][row], logits[row], ids[row, 1:])
        return agreement


def scan_units(scorer: WindowScorer, units: list[Unit], formats: list[str],
               group_size: int) -> dict[str, dict[str, Score]]:
    """Each unit alone at each format (everything else float): unit name -> format -> Score.

    The model's own float format, and any format that represents a unit's weight exactly (bf16 for a
    checkpoint stored in bf16, loaded as fp32), are scored as exactly zero without running them."""
    model = scorer.model
    native = fm.format_of_dtype(model.embed.dtype)
    head_layer = model.config.num_layers
    results: dict[str, dict[str, Score]] = {}
    started = time.perf_counter()
    for n, unit in enumerate(units):
        results[unit.name] = {native: Score(0.0, 0.0, 1.0)}
        for fmt in available_formats(unit, formats, group_size):
            if fmt == native:
                continue
            if _lossless(model, unit, fmt):
                results[unit.name][fmt] = Score(0.0, 0.0, 1.0)
                continue
            with FormatSwap(model, {unit.name: fmt}, group_size, units, simulate=True):
                score = Score.of(scorer.compare(head_layer if unit.layer is None else unit.layer))
            results[unit.name][fmt] = score
        log.info("sensitivity %d/%d %s: %s (%.0fs)", n + 1, len(units), unit.name,
                 ", ".join(f"{f} ΔNLL {s.delta_nll:+.5f} KL {s.kl:.5f}" for f, s in results[unit.name].items()
                           if f != native), time.perf_counter() - started)
    return results


def _lossless(model: DecoderModel, unit: Unit, fmt: str) -> bool:
    """Whether `fmt` holds this unit's weight bit for bit (only float formats can)."""
    if fmt not in fm.FLOAT_FORMATS:
        return False
    weight = model.get_submodule(unit.module).weight[unit.start : unit.stop]
    return bool(torch.equal(weight.to(fm.FLOAT_FORMATS[fmt]).to(weight.dtype), weight))


@dataclass(frozen=True)
class Validation:
    """A whole assignment on held-out windows: relative ΔPPL with a paired bootstrap 95 % interval."""

    delta_ppl: float  # exp(ΔNLL) - 1, relative
    ci95: tuple[float, float]
    delta_nll: float
    kl: float
    top1: float
    windows: int
    tokens: int

    def passes(self, max_ppl_increase: float) -> bool:
        """The budget holds at the upper end of the interval, not just at the point estimate."""
        return self.ci95[1] <= max_ppl_increase

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def bootstrap_ci(per_window_delta: list[float], resamples: int, seed: int) -> tuple[float, float]:
    """95 % percentile interval of exp(mean ΔNLL) - 1, resampling windows (equal lengths) with replacement."""
    deltas = torch.tensor(per_window_delta, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(deltas), (resamples, len(deltas)), generator=generator)
    ratios = deltas[picks].mean(dim=1).exp() - 1.0
    lo, hi = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def validate(scorer: WindowScorer, assignment: dict[str, str], units: list[Unit], group_size: int,
             resamples: int = 2000, seed: int = 0) -> Validation:
    """Score the full `assignment` (unit -> format) on the scorer's windows."""
    with FormatSwap(scorer.model, assignment, group_size, units, simulate=True):
        agreement = scorer.compare(0)
    s = agreement.summary()
    lo, hi = bootstrap_ci(agreement.per_sample_delta, resamples, seed)
    return Validation(math.exp(s["delta_nll"]) - 1.0, (lo, hi), s["delta_nll"], s["mean_kl"], s["top1_agreement"],
                      int(s["samples"]), int(s["positions"]))


def kernel_check(model: DecoderModel, windows: list[list[int]], assignment: dict[str, str], units: list[Unit],
                 group_size: int) -> dict[str, float]:
    """The real kernels against the simulated weights the planner measured, on a few windows.

    Same weight values, different arithmetic (kernel accumulation order, fused scales); this records
    how far apart they land so the map's quality figures can be trusted for the kernels that run."""
    scorer = WindowScorer(model, windows, batch_size=len(windows), cache_layers=False)
    with FormatSwap(model, assignment, group_size, units, simulate=True):
        simulated = scorer.logits_from(0, 0)
    with FormatSwap(model, assignment, group_size, units, simulate=False):
        real = scorer.logits_from(0, 0)
    agreement = Agreement()
    for row in range(len(windows)):
        agreement.add(simulated[row], real[row], scorer.chunks[0][row, 1:])
    s = agreement.summary()
    return {"windows": len(windows), "mean_kl": s["mean_kl"], "top1_agreement": s["top1_agreement"],
            "max_abs_logit_diff": (real - simulated).abs().max().item()}
