"""Why segment-sparse trails evict-only at 25 % KV saved on the kv_tasks main sizes: ablations of the
surprisal protection, scored on the kv_tasks copy / MQAR examples.

    python jobs/experiments/kv_protection_study.py --task mqar --saved 0.25 --seeds 0,1 [--variant] [--out FILE]

Every policy evicts the same number of 4-token groups as `segment_sparse` (`kv_tasks.segment_sparse_settings`
with the balanced preset's evict share 1.0); they differ only in which:

- `segment_sparse`, `evict_only`: as in `flashx_batch.quality.kv_tasks`.
- `boost=K`: a protected group (mean surprisal >= the engine's bar) counts as K times as attended.
- `cap=C`: at most C x the eligible groups are protected, the most surprising.
- `bar=M`: the protection bar at M x ln(vocab) per token instead of 0.75.
- `safe_tail=X`: the least attended groups holding X of the eligible groups' window attention are
  evicted whatever their surprisal; the rest of the budget as segment_sparse.
A trailing `/plain` orders by each group's own attention (no neighbour rule).

Also prints how the groups' mean surprisal is spread (random-token groups vs the held-out filler), and
per policy the prompt tokens of the random span / pairs that were evicted. Research only: nothing here
is used by the engine. `--variant` runs the other sizes of docs/benchmarks.md (seed given by --seeds).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from flashx_batch import Engine
from flashx_batch.quality import kv_tasks as K
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime import kv_merge as M
from flashx_batch.runtime.kv_merge import apply_plan
from flashx_batch.runtime.options import bundled_model_dir

VARIANT = dict(samples=24, copy_span=48, copy_prefix=6, filler=256, mqar_pairs=48, mqar_queries=24)


def plan_for(policy: str, n: int, saved: float, scores: torch.Tensor, surprisal: torch.Tensor, bar_nats: float,
             vocab: int, seed: int) -> tuple[M.MergePlan | None, bool]:
    if policy in K.POLICIES:
        return K.policy_plan(policy, n, saved, scores, seed, 4, 32, surprisal, bar_nats, None)
    kind, _, rest = policy.partition("=")
    value, _, plain = rest.partition("/")
    value = float(value)
    settings = K.segment_sparse_settings(n, saved, 4, 32, 1.0)
    need = sum(M.compression_counts(n, settings))
    groups = M.eligible_groups(n, settings)
    own = M.group_sums(scores, groups)
    attention = own if plain else torch.maximum(own, torch.cat((own[:1], own[:-1])))
    surprise = M.group_sums(surprisal, groups)
    protected = surprise >= M.GROUP * bar_nats
    by_attention = torch.argsort(attention, stable=True).tolist()
    if kind == "boost":
        order = torch.argsort(attention * torch.where(protected, value, 1.0), stable=True).tolist()
    else:
        head: list[int] = []
        if kind == "cap":
            keep = sorted((i for i in range(len(groups)) if protected[i]), key=lambda i: -float(surprise[i]))
            protected = torch.zeros(len(groups), dtype=torch.bool)
            protected[keep[: int(value * len(groups))]] = True
        elif kind == "bar":
            protected = surprise >= M.GROUP * value * math.log(vocab)
        elif kind == "safe_tail":
            total, mass = float(own.sum()), 0.0
            for i in by_attention:
                if len(head) >= need or mass + float(own[i]) > value * total:
                    break
                mass += float(own[i])
                head.append(i)
        else:
            raise SystemExit(f"unknown policy {policy!r}")
        taken = set(head)
        rest_ = [i for i in by_attention if i not in taken]
        order = head + [i for i in rest_ if not protected[i]] + sorted(
            (i for i in rest_ if protected[i]), key=lambda i: (float(surprise[i]), i))
    evict = sorted(groups[i] for i in order[:need])
    return M.plan_groups(n, [], evict=evict), False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("copy", "mqar"), default="mqar")
    parser.add_argument("--saved", type=float, default=0.25)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--variant", action="store_true")
    parser.add_argument("--policies", default="static,segment_sparse,evict_only,boost=1.3,boost=2,cap=0.5,"
                                              "bar=1.0,bar=1.3,safe_tail=0.1,safe_tail=0.15")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON with every figure printed")
    args = parser.parse_args()
    size = dict(K.FULL, **(VARIANT if args.variant else {}))
    engine = Engine.from_pretrained(bundled_model_dir(), backend="cpu", dtype="float32", max_batch_size=1,
                                    max_input_len=1024, max_output_len=1, kv_observe_window=32,
                                    num_threads=args.threads)
    tok = engine.tokenizer
    vocab = tok.vocab_size() if callable(tok.vocab_size) else tok.vocab_size
    avoid = {i for i in (0, 1, 2, tok.eos_token_id) if i is not None}
    filler = token_windows(tok, size["filler"], size["samples"])
    runner, policies = engine.runner, args.policies.split(",")
    result: dict = {"task": args.task, "saved": args.saved, "sizes": size, "seeds": {}, "spread": {}}
    spread: dict[str, list[float]] = {"random": [], "filler": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        if args.task == "mqar":
            examples = K.mqar_examples(filler, tok.encode("\nRECALL:", False), vocab, avoid, size["samples"],
                                       size["mqar_pairs"], size["mqar_queries"], seed)
            span = 2 * size["mqar_pairs"]
        else:
            examples = K.copy_examples(filler, tok.encode("\nCOPY:", False), vocab, avoid, size["samples"],
                                       size["copy_span"], size["copy_prefix"], seed)
            span = size["copy_span"]
        totals = {p: [0.0, 0] for p in policies}
        for index, ex in enumerate(examples):
            n = len(ex.context)
            _, scores = runner.passes.extend(ex.context, 0, 0, 0, observe=32)
            surprisal = runner.prompt_surprisal(ex.context)
            means = surprisal[: n // 4 * 4].view(-1, 4).mean(-1).tolist()
            for g, value in enumerate(means[1:-8], start=1):  # clear of the first token and the window
                if 4 * g + 3 < span:
                    spread["random"].append(value)
                elif 4 * g >= span:
                    spread["filler"].append(value)
            for policy in policies:
                plan, rerotate = plan_for(policy, n, args.saved, scores, surprisal, engine.merge.protect_nats,
                                          vocab, seed * 100003 + index)
                runner.passes.extend(ex.context, 0, 0, 0)
                used = n if plan is None else apply_plan(engine.runner.arena, 0, n, 0, plan,
                                                         rotary=runner.model.rotary if rerotate else None)
                score, _, _ = K._score(engine, args.task, ex, used, n)
                totals[policy][0] += score
                totals[policy][1] += 0 if plan is None else int((plan.target[:span] < 0).sum())
        result["seeds"][seed] = {p: {"score": s / len(examples), "span_tokens_evicted": e}
                                 for p, (s, e) in totals.items()}
        for p, r in result["seeds"][seed].items():
            print(f"seed {seed} {p:>16}: score {r['score']:.3f}, span tokens evicted {r['span_tokens_evicted']}")
    for name, values in spread.items():
        t = torch.tensor(values)
        result["spread"][name] = {"quantiles_05_50_95": [round(float(t.quantile(q)), 2) for q in (0.05, 0.5, 0.95)],
                                  "share_at_or_above_bar": float((t >= engine.merge.protect_nats).float().mean())}
        print(name, "mean surprisal per token (q05 / q50 / q95):", result["spread"][name]["quantiles_05_50_95"],
              f"share at or above the bar ({engine.merge.protect_nats:.2f} nats): "
              f"{result['spread'][name]['share_at_or_above_bar']:.2f}")
    averages = {p: sum(r[p]["score"] for r in result["seeds"].values()) / len(result["seeds"]) for p in policies}
    result["average"] = averages
    print("average over seeds:", {p: round(v, 4) for p, v in averages.items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
