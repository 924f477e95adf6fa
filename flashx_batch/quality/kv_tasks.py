"""KV-compression benchmark on tasks that can fail: `python -m flashx_batch.quality.kv_tasks --out DIR`.

A research harness. The teacher-forced top-1 / KL of `python -m flashx_batch.quality` measures how
far a compressed cache moves the next-token distribution on ordinary text; a model that cannot
retrieve is barely moved by losing tokens it never looks up. These tasks score what the compressed
cache must still hold:

- `copy`: a span of random vocabulary tokens, held-out licence text as filler, a marker and the
  span's first tokens; score = fraction of the rest of the span reproduced by greedy generation
  (position by position). The cue is in the prompt, so the observation window sees it.
- `mqar` (multi-query associative recall): key-value pairs of random tokens, filler, a marker, then
  the queries (keys of the pairs, shuffled) teacher-forced after the compressed prompt; score =
  fraction of values that are the argmax after their key. The queries come after compression, so
  the policies choose without seeing them (query-agnostic).
- `ppl`: held-out rolling perplexity of a continuation through the compressed cache; reported as
  the ratio to static (lower is better, 1 = no loss).
- `mc`: the bundled multiple-choice set (`assets/data/legal_eval.parquet`, items whose context has
  at least `--mc-min-context` tokens): each choice's log-likelihood through the compressed context;
  score = accuracy (argmax of the summed log-probabilities).

`--split tuning|held_out` runs the families of `quality.kv_families` instead (the tuning split: copy, mqar, ppl;
held-out: a long-cue copy, 3-token-key recall, two-hop recall, a needle span in licence text, mc), and the
report adds each cell's retention (score ÷ static on the same examples) with a paired bootstrap interval.
`fraction:F` cells run candidate dials (kv_merge_fraction F, the balanced evict share) as presets run theirs.

Every task compresses all of its prompt but the last token; that token and everything after it
run through the compressed cache (`runner.passes.extend` after `kv_merge.apply_plan`), so every scored
prediction reads the compressed KV.

Policies, each at `--saved` fractions of the prompt's slots freed (default 25 / 50 / 75 %):
`static` (no compression), `segment_sparse` (the production plan, `kv_merge.choose_compression`:
groups as unpredictable as random vocabulary protected, the rest ordered by observation-window
attention, at the `kv_merge_fraction` whose compressed length is nearest the budget, with the
balanced preset's evict share or `--evict-share`; 75 % may need a fraction above 1, which the
harness allows: the same split of evictions and merges, more slots freed), `attention_only` (the
same plan without the surprisal protection), `merge_only` (the harness's best merge-only scheme,
`ablations.choose_groups(..., "merge")` with sharpened score weights), `evict_only` (SnapKV-like:
the least attended 4-token groups by observation-window attention evicted), `streaming`
(StreamingLLM: sinks + recent window) and `random` (random groups evicted). `preset:balanced` and
`preset:aggressive` run the engine's presets as they are (`runtime.kv_preset`) and report what
they save. Sinks and the observation
window are never compressed, so a policy that cannot free the asked slots (merge-only frees at most
3/4 of the eligible groups' slots) reports the fraction it did free: results carry the measured
`kv_saved` next to the target.

A new entry point rather than a mode of `python -m flashx_batch.quality`, whose sweep picks the
engine's defaults; this one only measures. `--quick` (8 examples per task, 24 for mc, short prompts) takes
about a minute on one core. Writes DIR/kv_tasks.json, DIR/kv_tasks.md and DIR/kv_tasks.png.
`--model DIR` reruns it on another checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import time
from functools import lru_cache
from pathlib import Path

import torch

from flashx_batch import Engine
from flashx_batch.quality import kv_families as fam
from flashx_batch.quality.ablations import choose_groups, plan_score_weighted, plan_streaming
from flashx_batch.quality.heldout import token_windows
from flashx_batch.quality.kv_families import Example, multihop_examples, multikey_examples, needle_examples
from flashx_batch.quality.kv_tasks_report import PRESETS, fixed_dials, markdown, plot, relative_scores, retention
from flashx_batch.runtime.kv_merge import (
    GROUP,
    MergePlan,
    MergeSettings,
    apply_plan,
    choose_compression,
    compressed_length,
    compression_counts,
    eligible_groups,
    plan_groups,
)
from flashx_batch.runtime.options import KV_PRESETS, bundled_model_dir

log = logging.getLogger("flashx_batch.quality.kv_tasks")

TASKS = ("copy", "mqar", "ppl", "mc", "copy_long", "kv_multikey", "multihop", "needle")
DEFAULT_TASKS = ("copy", "mqar", "ppl", "mc")  # without --split
POLICIES = ("static", "segment_sparse", "attention_only", "merge_only", "evict_only", "streaming", "random")
SAVED = (0.25, 0.5, 0.75)
MC_DATA = Path(__file__).resolve().parent.parent / "assets" / "data" / "legal_eval.parquet"


# ---------------------------------------------------------------- tasks

def copy_examples(filler: list[list[int]], marker: list[int], vocab: int, avoid: set[int], count: int,
                  span_len: int, prefix_len: int, seed: int) -> list[Example]:
    """span + filler + marker + span[:prefix_len]; the rest of the span is the answer."""
    out = []
    for i in range(count):
        rng = random.Random(f"copy/{seed}/{i}")
        span = fam.random_tokens(rng, span_len, vocab, avoid)
        prompt = span + filler[i % len(filler)] + marker + span[:prefix_len]
        out.append(Example(prompt[:-1], prompt[-1:], answer=span[prefix_len:]))
    return out


def mqar_examples(filler: list[list[int]], marker: list[int], vocab: int, avoid: set[int], count: int,
                  pairs: int, queries: int, seed: int) -> list[Example]:
    """k1 v1 ... kP vP + filler + marker, then `queries` of the keys (shuffled) each followed by its
    value, teacher-forced; the values are the answer."""
    out = []
    for i in range(count):
        rng = random.Random(f"mqar/{seed}/{i}")
        keys = fam.random_tokens(rng, pairs, vocab, avoid, distinct=True)
        values = fam.random_tokens(rng, pairs, vocab, avoid)
        asked = rng.sample(range(pairs), min(queries, pairs))
        prompt = [t for kv in zip(keys, values) for t in kv] + filler[i % len(filler)] + marker
        feed = [t for j in asked for t in (keys[j], values[j])]
        out.append(Example(prompt[:-1], prompt[-1:], answer=[values[j] for j in asked], feed=feed))
    return out


def ppl_examples(windows: list[list[int]], context_len: int) -> list[Example]:
    """Held-out windows: the first `context_len` tokens are the prompt, the rest is scored."""
    return [Example(w[: context_len - 1], w[context_len - 1 : context_len], answer=w[context_len:],
                    feed=w[context_len:-1]) for w in windows]


def mc_examples(engine: Engine, count: int, min_context: int, path: Path = MC_DATA) -> list[Example]:
    """The first `count` items of the multiple-choice set whose context encodes to >= `min_context` tokens."""
    import pandas as pd

    out = []
    for row in pd.read_parquet(path).itertuples():
        pairs = engine.lm.encode_pairs([(row.context, str(c)) for c in row.choices])
        context = list(pairs[0][0])
        if len(context) < min_context or any(list(p[0]) != context for p in pairs):
            continue
        out.append(Example(context[:-1], context[-1:], choices=[list(p[1]) for p in pairs], label=int(row.answer)))
        if len(out) >= count:
            break
    return out


GENERATED = {"copy", "copy_long", "multihop", "needle"}  # scored on greedy generation after the prompt
RECALLED = {"mqar", "kv_multikey"}  # scored on teacher-forced queries after the prompt


# ---------------------------------------------------------------- scores (pure)

def copy_score(generated: list[int], answer: list[int]) -> float:
    """Fraction of the answer reproduced, position by position."""
    return sum(g == a for g, a in zip(generated, answer)) / len(answer) if answer else 0.0


def recall_score(predicted: list[int], values: list[int]) -> float:
    """Fraction of values that were the prediction after their key."""
    return sum(p == v for p, v in zip(predicted, values)) / len(values) if values else 0.0


def mqar_positions(query_len: int, queries: int) -> list[int]:
    """Indices, among the logits of query + feed, of the predictions after each key (feed = k v k v ...)."""
    return [query_len + 2 * j for j in range(queries)]


# ---------------------------------------------------------------- policies

def keep_slots(length: int, saved: float) -> int:
    return round((1.0 - saved) * length)


@lru_cache(maxsize=4096)
def segment_sparse_settings(length: int, saved: float, sinks: int, window: int,
                            evict_share: float = KV_PRESETS["balanced"][1]) -> MergeSettings:
    """The kv_merge_fraction (steps of 0.001, up to 1.25) whose compressed length is nearest the budget."""
    eligible = len(eligible_groups(length, MergeSettings(sinks=sinks, window=window)))
    target, best = keep_slots(length, saved), None
    for step in range(1251):
        settings = MergeSettings(fraction=step / 1000, sinks=sinks, window=window, evict_share=evict_share)
        if sum(compression_counts(length, settings)) > eligible:
            break
        gap = abs(compressed_length(length, settings) - target)
        if best is None or gap < best[0]:
            best = (gap, settings)
    return best[1]


def policy_plan(policy: str, length: int, saved: float, scores: torch.Tensor | None, seed: int,
                sinks: int, window: int, surprisal: torch.Tensor | None = None, protect_nats: float | None = None,
                evict_share: float | None = None) -> tuple[MergePlan | None, bool]:
    """(plan, merges keys that need re-rotation) freeing about `saved` of a `length`-token prompt's
    slots; `static`: (None, False). Eviction frees GROUP slots per group, a 4:1 merge GROUP - 1."""
    if policy == "static":
        return None, False
    if fixed_dials(policy):  # what the engine runs: a preset's (or a candidate's) dials, whatever they save
        fraction, share = fixed_dials(policy)
        settings = MergeSettings(fraction, sinks=sinks, window=window, evict_share=share, protect_nats=protect_nats)
        merge, evict = choose_compression(scores, length, settings, surprisal)
        return plan_groups(length, merge, evict=evict), bool(merge)
    bounds = MergeSettings(sinks=sinks, window=window)
    eligible = len(eligible_groups(length, bounds))
    free = length - keep_slots(length, saved)
    if policy in ("segment_sparse", "attention_only"):
        share = KV_PRESETS["balanced"][1] if evict_share is None else evict_share
        settings = segment_sparse_settings(length, saved, sinks, window, share)
        if policy == "segment_sparse":
            settings = dataclasses.replace(settings, protect_nats=protect_nats)
        merge, evict = choose_compression(scores, length, settings, surprisal)
        return plan_groups(length, merge, evict=evict), bool(merge)
    if policy == "merge_only":
        count = min(eligible, round(free / (GROUP - 1)))
        groups = choose_groups(scores, length, bounds, "merge", count=count)
        return plan_score_weighted(length, groups, scores), bool(groups)
    if policy in ("evict_only", "random"):
        count = min(eligible, round(free / GROUP))
        how = "evict" if policy == "evict_only" else "random"
        return plan_groups(length, [], evict=choose_groups(scores, length, bounds, how, seed=seed, count=count)), False
    if policy == "streaming":
        return plan_streaming(length, keep_slots(length, saved), sinks), False
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")


# ---------------------------------------------------------------- running

def _score(engine: Engine, task: str, ex: Example, used: int, n: int) -> tuple[float, float, float]:
    """(score, weight, aside) of one example through a cache holding `used` slots for its n-token
    context; ppl: (summed NLL, tokens, 0); mc's aside: the right choice's log-likelihood, which moves
    before the argmax does."""
    runner = engine.runner
    if task in GENERATED:
        logits, _ = runner.passes.extend(ex.query, 0, used, n)
        out = [int(logits[-1].argmax())]
        for i in range(len(ex.answer) - 1):
            logits, _ = runner.passes.extend(out[-1:], 0, used + len(ex.query) + i, n + len(ex.query) + i)
            out.append(int(logits[-1].argmax()))
        return copy_score(out, ex.answer), 1.0, 0.0
    if task in RECALLED or task == "ppl":
        logits, _ = runner.passes.extend(ex.query + ex.feed, 0, used, n, all_logits=True)
        if task == "ppl":
            nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ex.answer), reduction="sum")
            return float(nll), float(len(ex.answer)), 0.0
        at = ex.positions or mqar_positions(len(ex.query), len(ex.answer))
        return recall_score(logits[at].argmax(-1).tolist(), ex.answer), 1.0, 0.0
    if task == "mc":
        sums = []
        for choice in ex.choices:
            logits, _ = runner.passes.extend(ex.query + choice[:-1], 0, used, n, all_logits=True)
            logp = torch.log_softmax(logits.float(), -1)
            sums.append(float(logp[torch.arange(len(choice)), torch.tensor(choice)].sum()))
        return float(max(range(len(sums)), key=sums.__getitem__) == ex.label), 1.0, sums[ex.label]
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def run_task(engine: Engine, task: str, examples: list[Example], cells: list[tuple[str, float]],
             sinks: int, window: int, seed: int, evict_share: float | None = None) -> dict[str, dict[str, float]]:
    """Every (policy, saved) cell on every example: {cell: {score, kv_saved, examples}}."""
    runner, arena = engine.runner, engine.runner.arena
    rotary = runner.model.rotary
    totals = {cell: [0.0, 0.0, 0, 0, 0.0] for cell in cells}  # score sum, weight, slots used, prompt slots, aside
    each: dict[tuple[str, float], list[float]] = {cell: [] for cell in cells}  # per example (ppl: mean NLL)
    for index, ex in enumerate(examples):
        n = len(ex.context)
        _, scores = runner.passes.extend(ex.context, 0, 0, 0, observe=window)
        surprisal = runner.prompt_surprisal(ex.context)  # what the packed prefill computes
        for cell in cells:
            policy, saved = cell
            plan, rerotate = policy_plan(policy, n, saved, scores, seed * 100003 + index, sinks, window, surprisal,
                                         engine.merge.protect_nats, evict_share)
            runner.passes.extend(ex.context, 0, 0, 0)  # fresh prompt KV: the previous plan rewrote it
            used = n if plan is None else apply_plan(arena, 0, n, 0, plan, rotary=rotary if rerotate else None)
            score, weight, aside = _score(engine, task, ex, used, n)
            t = totals[cell]
            t[0], t[1], t[2], t[3], t[4] = t[0] + score, t[1] + weight, t[2] + used, t[3] + n, t[4] + aside
            each[cell].append(score / weight if task == "ppl" else score)
    out = {}
    for (policy, saved), (score, weight, used, slots, aside) in totals.items():
        value = math.exp(score / weight) if task == "ppl" else score / weight
        out[_cell_name(policy, saved)] = {"policy": policy, "target_saved": saved, "score": value,
                                          "kv_saved": 1.0 - used / slots, "examples": len(examples),
                                          "per_example": each[(policy, saved)]}
        if task == "mc":
            out[_cell_name(policy, saved)]["gold_logprob"] = aside / len(examples)
    if task == "ppl":  # report perplexity as a ratio to static
        static = out[_cell_name("static", 0.0)]["score"]
        for r in out.values():
            r["perplexity"], r["score"] = r["score"], r["score"] / static
    return out


def _cell_name(policy: str, saved: float) -> str:
    return policy if policy == "static" or fixed_dials(policy) else f"{policy}@{saved:.2f}"


def cells_for(policies: list[str], saved: list[float]) -> list[tuple[str, float]]:
    """static once, each preset once (it saves what its dials save), every other policy at each target."""
    fixed = [(p, 0.0) for p in policies if p == "static" or fixed_dials(p)]
    return fixed + [(p, s) for p in policies if p != "static" and not fixed_dials(p) for s in saved]


# ---------------------------------------------------------------- entry point

QUICK = {"samples": 8, "copy_span": 32, "copy_prefix": 4, "filler": 192, "mqar_pairs": 32, "mqar_queries": 16,
         "ppl_context": 256, "ppl_cont": 64, "mc_samples": 24}
FULL = {"samples": 32, "copy_span": 64, "copy_prefix": 8, "filler": 384, "mqar_pairs": 64, "mqar_queries": 32,
        "ppl_context": 512, "ppl_cont": 128, "mc_samples": 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the bundled model)")
    parser.add_argument("--split", choices=tuple(fam.SPLITS), default=None,
                        help="the tuning or the held-out families (quality.kv_families); default: --tasks")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"known: {', '.join(TASKS)}")
    parser.add_argument("--policies", default=",".join(POLICIES + PRESETS))
    parser.add_argument("--saved", default=",".join(str(s) for s in SAVED), help="target fractions of KV freed")
    parser.add_argument("--quick", action="store_true", help="8 examples per task (24 for mc), short prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evict-share", type=float, default=None,
                        help="segment_sparse / attention_only cells' kv_evict_share (default: the balanced preset's)")
    parser.add_argument("--sinks", type=int, default=MergeSettings.sinks)
    parser.add_argument("--window", type=int, default=MergeSettings.window, help="observation window (tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine a second OpenMP thread that loses its core "
                             "makes every step wait for it)")
    for key in FULL:
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                            help=f"default {FULL[key]} ({QUICK[key]} with --quick)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    size = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k] for k in FULL}
    tasks = list(fam.SPLITS[args.split]) if args.split else [t for t in args.tasks.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    for name in tasks:
        if name not in TASKS:
            parser.error(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    for name in policies:
        if name not in POLICIES + PRESETS and not fixed_dials(name):
            parser.error(f"unknown policy {name!r}; known: {', '.join(POLICIES + PRESETS)}, fraction:F (0 < F <= 1.25)")
    saved = [float(s) for s in args.saved.split(",")]
    model = args.model or bundled_model_dir()
    key = fam.KEY_TOKENS + 1
    longest = max(size["copy_span"] + size["filler"] + 16, 2 * size["mqar_pairs"] + size["filler"]
                  + 2 * size["mqar_queries"] + 16, size["ppl_context"] + size["ppl_cont"] + 1,
                  3 * size["copy_span"] + size["filler"] // 2 + 16,  # copy_long: span, filler, cue, answer
                  key * (size["mqar_pairs"] // 2 + size["mqar_queries"] // 2) + size["filler"] + 16,
                  4 * fam.CHAINS + size["filler"] + 16, fam.NEEDLE_TOKENS + size["filler"] + 16, 1024)
    engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=1,
                                    max_input_len=longest, max_output_len=1, kv_observe_window=args.window,
                                    num_threads=args.threads)
    tok = engine.tokenizer
    vocab = tok.vocab_size() if callable(tok.vocab_size) else tok.vocab_size
    avoid = {i for i in (0, 1, 2, tok.eos_token_id) if i is not None}
    filler = token_windows(tok, size["filler"], size["samples"])
    examples = {
        "copy": lambda: copy_examples(filler, tok.encode("\nCOPY:", False), vocab, avoid, size["samples"],
                                      size["copy_span"], size["copy_prefix"], args.seed),
        "mqar": lambda: mqar_examples(filler, tok.encode("\nRECALL:", False), vocab, avoid, size["samples"],
                                      size["mqar_pairs"], size["mqar_queries"], args.seed),
        "ppl": lambda: ppl_examples(token_windows(tok, size["ppl_context"] + size["ppl_cont"], size["samples"]),
                                    size["ppl_context"]),
        "mc": lambda: mc_examples(engine, size["mc_samples"], 2 * (args.sinks + args.window)),
        "copy_long": lambda: copy_examples([f[: len(f) // 2] for f in filler], tok.encode("\nCOPY:", False), vocab,
                                           avoid, size["samples"], 2 * size["copy_span"], size["copy_span"],
                                           args.seed + 1),
        "kv_multikey": lambda: multikey_examples(filler, tok.encode("\nRECALL:", False), vocab, avoid,
                                                 size["samples"], size["mqar_pairs"] // 2, size["mqar_queries"] // 2,
                                                 args.seed),
        "multihop": lambda: multihop_examples(filler, tok.encode("\nFOLLOW:", False), vocab, avoid, size["samples"],
                                              args.seed),
        "needle": lambda: needle_examples(filler, tok.encode("\nCOPY:", False), vocab, avoid, size["samples"],
                                          args.seed),
    }
    describe = {
        "copy": f"{size['copy_span']}-token random span, {size['filler']} filler tokens, "
                f"{size['copy_prefix']}-token cue; score = fraction of the rest generated greedily",
        "mqar": f"{size['mqar_pairs']} pairs, {size['filler']} filler tokens, {size['mqar_queries']} queries after "
                "the compressed prompt; score = fraction of values recalled (argmax)",
        "ppl": f"{size['ppl_context']}-token held-out prompts, {size['ppl_cont']} tokens scored; "
               "score = perplexity ÷ static",
        "mc": f"legal_eval.parquet items with >= {2 * (args.sinks + args.window)} context tokens; "
              "score = accuracy (summed log-probabilities)",
        "copy_long": f"{2 * size['copy_span']}-token random span, its first half the cue after {size['filler'] // 2} "
                     "filler tokens; score = fraction of the second half generated greedily",
        "kv_multikey": f"{size['mqar_pairs'] // 2} pairs with {fam.KEY_TOKENS}-token keys, {size['filler']} filler "
                       f"tokens, {size['mqar_queries'] // 2} keys teacher-forced after; score = values recalled",
        "multihop": f"{fam.CHAINS} chains a→b→c as separate pairs around {size['filler']} filler tokens, one asked; "
                    "score = fraction of b, c generated greedily",
        "needle": f"a {fam.NEEDLE_TOKENS}-token random span at a random depth of {size['filler']} licence tokens, its "
                  f"first {fam.NEEDLE_CUE} as the cue; score = fraction of the rest generated greedily",
    }
    cells = cells_for(policies, saved)
    result = {"model": str(model), "model_name": Path(model).name, "seed": args.seed, "quick": args.quick,
              "split": args.split,
              "sizes": size, "sinks": args.sinks, "window": args.window, "saved": saved,
              "command": "python -m flashx_batch.quality.kv_tasks " + " ".join(argv if argv is not None else
                                                                             __import__("sys").argv[1:]),
              "tasks": {}}
    for task in tasks:
        start = time.perf_counter()
        exs = examples[task]()
        measured = run_task(engine, task, exs, cells, args.sinks, args.window, args.seed, args.evict_share)
        mean_len = sum(len(e.context) for e in exs) / max(1, len(exs))
        result["tasks"][task] = {"examples": len(exs), "mean_context_tokens": mean_len, "describe": describe[task],
                                 "seconds": round(time.perf_counter() - start, 1), "cells": measured}
        log.info("%s: %d examples (mean context %.0f tokens) in %.1f s", task, len(exs), mean_len,
                 result["tasks"][task]["seconds"])
    if "static" in policies:
        result["relative"] = relative_scores(result)
        result["retention"] = retention(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_tasks.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "kv_tasks.md").write_text(md)
    plot(result, args.out / "kv_tasks.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
