"""The evaluation workload: multiple choice on the bundled eval set, our job path against
lm-evaluation-harness's Hugging Face backend (`HFLM`), side by side in one process.

Who calls it: `python -m flashx_batch.bench` (unless `--no-eval`; `--eval-only` runs nothing else).

The items: the first N rows of `assets/data/legal_eval.parquet` (240 in full, 48 with `--quick`), each a
context and 4 choices; every choice is one `loglikelihood` request (context, " " + choice) — the
`target_delimiter` " " our `task=multiple_choice` job uses (its default `data.target_delimiter`). The
bundled set's choices already start with whitespace, so the scored text holds two; both sides score the
same strings, which is what matters here.

- *Ours*: `compose_job(conf=smoke, task=multiple_choice, executor local, ...)` + `runner.run(job)`, as a
  user runs it: plan (reads and encodes every row), one engine, shards scored and committed as Parquet,
  job.json. The scores are read back from `generations/`.
- *lm-eval*: `HFLM(pretrained=<bundled model>, dtype=float32, device=cpu, batch_size=16, max_length=...)`
  and `lm.loglikelihood(requests)`. `logits_cache=False`: lm-eval 0.4.13's one-token-continuation cache
  gave a rolling request another request's score in a batch (tests/unit/test_loglikelihood.py); it
  matters only for one-token continuations, which these are not, and is kept off so that every value
  is the one HFLM gives a request alone.
- Both use `max_length` = our `runtime.max_input_len` (1024: no item is truncated on either side) and
  the same torch thread count.

Timed per repeat (the order alternates; medians): *scoring* — model loaded to every score in memory
(lm-eval: building the requests + `loglikelihood`; ours: the job's wall time less the engine load,
i.e. planning, encoding, scoring, Parquet commit) — and *end to end*, loading included (lm-eval: + the
`HFLM` constructor; ours: + `compose_job` and the engine load). Predictions: the first argmax of each
item's raw log-probabilities (lm-eval's `acc`), and of log-probability / len(choice) (`acc_norm`).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger(__name__)

EVAL_SET = bundled_model_dir().parent.parent / "data" / "legal_eval.parquet"
FULL_ITEMS, QUICK_ITEMS = 240, 48
MAX_LENGTH = 1024  # tokens each side's model reads per request; the longest item needs ~940
DELIMITER = " "  # lm-eval's target_delimiter; our job's data.target_delimiter default
HFLM_BATCH_SIZE = 16
TARGET = 3.0  # lm-eval scoring wall time ÷ ours (a speed-up)


@dataclass(frozen=True)
class EvalSettings:
    items: int
    repeats: int
    threads: int


def load_items(n: int, path: Path = EVAL_SET) -> list[dict[str, Any]]:
    """The first `n` rows of the bundled eval set (id, context, choices, answer, ...)."""
    rows = pq.read_table(path).to_pylist()
    if n > len(rows):
        raise ValueError(f"{path} has {len(rows)} items, fewer than the {n} asked for")
    return rows[:n]


def requests(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Every choice of every item as a loglikelihood request (context, delimiter + choice), item-major."""
    return [(r["context"], DELIMITER + c) for r in items for c in r["choices"]]


def first_argmax(values: list[float]) -> int:
    """numpy's argmax (the first of equal maxima), as lm-eval picks."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ---- the two sides ------------------------------------------------------------------------------
def job_overrides(out_dir: Path, n: int, threads: int, data: Path = EVAL_SET) -> list[str]:
    return ["conf=smoke", "task=multiple_choice", f"data.path={data}", f"data.limit={n}",
            "data.passthrough_columns=[]", "data.passthrough_if_present=[]",
            f"output.dir={out_dir}", "output.report=false",
            f"runtime.max_input_len={MAX_LENGTH}", f"runtime.num_threads={threads}", "runtime.shard_size=256",
            "executor.kind=local", "executor.progress_interval_s=1000"]


def run_ours(n: int, threads: int, scratch: Path) -> dict[str, Any]:
    """One job over the first n items -> times and per-item scores (read back from generations/)."""
    from flashx_batch.config import compose_job
    from flashx_batch.runner import run
    from flashx_batch.runner.worker import ShardWorker

    out = Path(tempfile.mkdtemp(prefix="eval-", dir=scratch))
    loads: list[float] = []
    original = ShardWorker._load

    def timed_load(self) -> None:  # the engine load, taken out of the scoring time
        started = time.perf_counter()
        original(self)
        loads.append(time.perf_counter() - started)

    started = time.perf_counter()
    ShardWorker._load = timed_load
    try:
        job = compose_job(job_overrides(out / "out", n, threads))
        composed = time.perf_counter()
        code = run(job)
    finally:
        ShardWorker._load = original
    ended = time.perf_counter()
    if code != 0:
        raise RuntimeError(f"the multiple_choice job exited {code} ({out / 'out'})")
    table = pq.read_table(out / "out" / "generations",
                          columns=["id", "choice_logprobs", "pred", "pred_norm", "correct"]).to_pylist()
    by_id = {r["id"]: r for r in table}
    return {"scoring_s": ended - composed - sum(loads), "e2e_s": ended - started, "load_s": sum(loads),
            "by_id": by_id}


def load_hflm(threads: int):
    """lm-eval's HF backend on the bundled model, as its docs configure it for CPU."""
    import torch
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(threads)
    return HFLM(pretrained=str(bundled_model_dir()), dtype="float32", device="cpu", batch_size=HFLM_BATCH_SIZE,
                max_length=MAX_LENGTH, logits_cache=False)


def run_lm_eval(items: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """HFLM loaded, then every request scored -> times and per-item log-probabilities."""
    from lm_eval.api.instance import Instance

    started = time.perf_counter()
    lm = load_hflm(threads)
    loaded = time.perf_counter()
    reqs = [Instance("loglikelihood", r, pair, i) for i, (r, pair) in
            enumerate(zip([r for r in items for _ in r["choices"]], requests(items), strict=True))]
    scores = lm.loglikelihood(reqs, disable_tqdm=True)
    ended = time.perf_counter()
    logprobs, o = [], 0
    for r in items:
        logprobs.append([lp for lp, _ in scores[o : o + len(r["choices"])]])
        o += len(r["choices"])
    del lm
    return {"scoring_s": ended - loaded, "e2e_s": ended - started, "load_s": loaded - started, "logprobs": logprobs}


# ---- comparing ------------------------------------------------------------------------------------
def compare(items: list[dict[str, Any]], ours_by_id: dict, ref_logprobs: list[list[float]]) -> dict[str, Any]:
    """Predictions of both sides item by item; a differing item is listed with both sides' margins
    (best minus runner-up) so a near tie shows as one."""
    equal = equal_norm = correct_ours = correct_ref = norm_ours = norm_ref = 0
    max_diff, differing = 0.0, []
    for item, ref in zip(items, ref_logprobs, strict=True):
        got = ours_by_id[item["id"]]
        ours = got["choice_logprobs"]
        lengths = [len(c) for c in item["choices"]]
        ref_pred = first_argmax(ref)
        ref_norm = first_argmax([lp / n for lp, n in zip(ref, lengths, strict=True)])
        max_diff = max(max_diff, max(abs(a - b) for a, b in zip(ours, ref, strict=True)))
        equal += got["pred"] == ref_pred
        equal_norm += got["pred_norm"] == ref_norm
        correct_ours += got["pred"] == item["answer"]
        correct_ref += ref_pred == item["answer"]
        norm_ours += got["pred_norm"] == item["answer"]
        norm_ref += ref_norm == item["answer"]
        if got["pred"] != ref_pred or got["pred_norm"] != ref_norm:
            differing.append({"id": item["id"], "ours": ours, "lm_eval": ref, "pred": [got["pred"], ref_pred],
                              "pred_norm": [got["pred_norm"], ref_norm],
                              "margin_ours": _margin(ours), "margin_lm_eval": _margin(ref)})
    n = len(items)
    return {"items": n, "requests": sum(len(r["choices"]) for r in items),
            "predictions_equal": equal, "predictions_norm_equal": equal_norm,
            "max_abs_logprob_diff": max_diff, "differing": differing,
            "accuracy": {"ours": correct_ours / n, "lm_eval": correct_ref / n},
            "accuracy_norm": {"ours": norm_ours / n, "lm_eval": norm_ref / n}}


def _margin(values: list[float]) -> float:
    top = sorted(values, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


# ---- the workload ---------------------------------------------------------------------------------
def bench_eval(s: EvalSettings, scratch: Path) -> dict[str, Any]:
    """Both sides `s.repeats` times, alternating who goes first -> the results file's `eval` section."""
    items = load_items(s.items)
    ours_runs, ref_runs = [], []
    for turn in range(s.repeats):
        order = ("ours", "lm_eval") if turn % 2 == 0 else ("lm_eval", "ours")
        for side in order:
            if side == "ours":
                ours_runs.append(run_ours(s.items, s.threads, scratch))
            else:
                ref_runs.append(run_lm_eval(items, s.threads))
            log.info("eval repeat %d/%d %s: scoring %.2fs, end to end %.2fs", turn + 1, s.repeats, side,
                     (ours_runs if side == "ours" else ref_runs)[-1]["scoring_s"],
                     (ours_runs if side == "ours" else ref_runs)[-1]["e2e_s"])
    checks = compare(items, ours_runs[-1]["by_id"], ref_runs[-1]["logprobs"])
    stable = all(r["by_id"] == ours_runs[0]["by_id"] for r in ours_runs) and \
        all(r["logprobs"] == ref_runs[0]["logprobs"] for r in ref_runs)
    return summarise(s, ours_runs, ref_runs, checks, stable)


def summarise(s: EvalSettings, ours_runs: list[dict], ref_runs: list[dict], checks: dict, stable: bool
              ) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    pairs = list(zip(ours_runs, ref_runs, strict=True))
    scoring = spread([r["scoring_s"] / o["scoring_s"] for o, r in pairs])
    e2e = spread([r["e2e_s"] / o["e2e_s"] for o, r in pairs])
    return {
        "workload": (f"{checks['items']} multiple-choice items x 4 choices ({checks['requests']} loglikelihood "
                     f"requests, context + '{DELIMITER}' + choice) from {EVAL_SET.name}, bundled model legal-tiny"),
        "items": checks["items"], "requests": checks["requests"], "repeats": s.repeats, "threads": s.threads,
        "max_length": MAX_LENGTH, "lm_eval": {"batch_size": HFLM_BATCH_SIZE, "dtype": "float32", "device": "cpu",
                                              "logits_cache": False},
        "ours_scoring_s": spread([o["scoring_s"] for o in ours_runs]),
        "lm_eval_scoring_s": spread([r["scoring_s"] for r in ref_runs]),
        "ours_e2e_s": spread([o["e2e_s"] for o in ours_runs]),
        "lm_eval_e2e_s": spread([r["e2e_s"] for r in ref_runs]),
        "ours_load_s": spread([o["load_s"] for o in ours_runs]),
        "lm_eval_load_s": spread([r["load_s"] for r in ref_runs]),
        "ratio_scoring": {**scoring, "target": f">= {TARGET}", "met": scoring["median"] >= TARGET},
        "ratio_e2e": e2e,
        "scores_identical_across_repeats": stable,
        **{k: checks[k] for k in ("predictions_equal", "predictions_norm_equal", "max_abs_logprob_diff",
                                  "differing", "accuracy", "accuracy_norm")},
        "timing_note": ("scoring: model loaded -> every score in memory (lm-eval: requests built + loglikelihood; "
                        "ours: runner.run wall less the engine load: plan, encode, score, Parquet commit); "
                        "e2e: + loading (HFLM constructor; compose_job + engine load). Ratios pair repeat i of "
                        "each side (alternating order); medians (min-max)."),
    }


def markdown(e: dict[str, Any]) -> list[str]:
    """results.md's section for the eval workload."""
    def fmt(d: dict, digits: int = 2) -> str:
        return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"

    lines = ["", "## Evaluation: multiple choice, our job vs lm-eval HFLM", "", e["workload"] + ".", "",
             "| side | scoring s | end to end s | load s | accuracy | acc_norm |", "|---|---|---|---|---|---|",
             f"| ours (task=multiple_choice job) | {fmt(e['ours_scoring_s'])} | {fmt(e['ours_e2e_s'])} | "
             f"{fmt(e['ours_load_s'])} | {e['accuracy']['ours']:.3f} | {e['accuracy_norm']['ours']:.3f} |",
             f"| lm-eval HFLM (batch {e['lm_eval']['batch_size']}, logits_cache off) | {fmt(e['lm_eval_scoring_s'])} | "
             f"{fmt(e['lm_eval_e2e_s'])} | {fmt(e['lm_eval_load_s'])} | {e['accuracy']['lm_eval']:.3f} | "
             f"{e['accuracy_norm']['lm_eval']:.3f} |", "",
             f"- lm-eval ÷ ours, scoring: **{fmt(e['ratio_scoring'])}** (target {e['ratio_scoring']['target']}: "
             f"{'met' if e['ratio_scoring']['met'] else '**not met**'}); end to end: {fmt(e['ratio_e2e'])}",
             f"- predictions equal: {e['predictions_equal']}/{e['items']} (acc_norm: "
             f"{e['predictions_norm_equal']}/{e['items']}); largest log-probability difference "
             f"{e['max_abs_logprob_diff']:.2e}",
             f"- {e['repeats']} repeats, {e['threads']} thread(s), max_length {e['max_length']}. {e['timing_note']}"]
    for d in e["differing"]:
        lines.append(f"- item {d['id']} differs: pred {d['pred']}, pred_norm {d['pred_norm']}, margins "
                     f"ours {d['margin_ours']:.2e} / lm-eval {d['margin_lm_eval']:.2e}")
    return lines
