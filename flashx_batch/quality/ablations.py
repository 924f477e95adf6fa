"""Research ablations of segment-sparse KV, run only by `python -m flashx_batch.quality`.

The engine compresses with `flashx_batch.runtime.kv_merge` (the least attended groups evicted, the
next merged 4:1 with equal weights, keys merged before RoPE, log-count bias). The harness compares
that against the alternatives built here: merging alone (groups ranked by sum - max, merged with
sharpened score weights), score-weighted merges of segment_sparse's groups, merges of rotated keys,
merges without the log-count bias, eviction only, random groups and StreamingLLM (sinks + recent
window). Their measurements are in docs/benchmarks.md ("Segment-sparse KV").

Every plan here is a `MergePlan` that `kv_merge.apply_plan` writes like a production one; the no-bias
ablation zeroes the written slots' bias afterwards (`kv_quality.policy_quality`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashx_batch.models.layers import RotaryTable
from flashx_batch.runtime.kv_merge import (
    GROUP,
    MergePlan,
    MergeSettings,
    choose_compression,
    compressed_length,
    compression_counts,
    eligible_groups,
    least_attended,
    merge_count,
    plan_groups,
)

POLICIES = ("segment_sparse", "merge_only", "merge_score_weighted", "merge_unsharpened", "merge_post_rope",
            "merge_no_bias", "evict", "evict_same_ratio", "random", "streaming")

# merged-slot weights ∝ score ** SHARPNESS in a score-weighted merge: the best merge-only scheme the
# harness found (`merge_only`); segment_sparse merges with equal weights
SHARPNESS = 5.0


@dataclass
class ScoreWeightedPlan(MergePlan):
    """A plan whose merged slots lean to their most attended tokens. `mass`: per slot, its tokens'
    attention ÷ the most attended one's (1 for an unmerged slot)."""

    mass: list[float]

    def log_counts(self) -> torch.Tensor:
        """log(effective count) instead of log(count): 4 equally attended tokens weigh as 4 (exact for
        duplicates), one dominant token as about 1."""
        return torch.tensor([math.log(c) for c in self.mass], dtype=torch.float32)


def choose_groups(scores: torch.Tensor | None, length: int, settings: MergeSettings, policy: str,
                  seed: int = 0, count: int | None = None, ranked: bool = False) -> list[int]:
    """The `count` groups (default: the fraction's) whose compression loses the least attention,
    or random ones.

    What a group loses depends on what happens to it. Evicted (`policy="evict"`), all its tokens'
    pooled attention is gone: rank by the sum (what segment_sparse does). Merged with sharpened score
    weights (`policy="merge"`, the merge-only ablation), its slot keeps the most attended token almost
    exactly (and the bias restores the group's total weight); what gets blurred is the attention of
    the other three: rank by sum − max. `policy="random"`: drawn with `seed`. `ranked`: least loss
    (random: drawn) first instead of sorted by position."""
    groups = eligible_groups(length, settings)
    count = merge_count(length, settings) if count is None else count
    if count == 0:
        return []
    if policy == "random":
        g = torch.Generator().manual_seed(seed)
        chosen = [groups[i] for i in torch.randperm(len(groups), generator=g)[:count].tolist()]
    elif policy == "evict":
        chosen = least_attended(scores, length, settings, count)
    elif policy == "merge":
        upto = (groups[-1] + 1) * GROUP
        per_group = scores[:upto].float().view(-1, GROUP)[groups]  # [eligible, 4]
        lost = per_group.sum(-1) - per_group.max(-1).values
        chosen = [groups[i] for i in torch.argsort(lost, stable=True)[:count].tolist()]
    else:
        raise ValueError(f"choose_groups: policy {policy!r} is not evict, merge or random")
    return chosen if ranked else sorted(chosen)


def random_compression(length: int, settings: MergeSettings, seed: int) -> tuple[list[int], list[int]]:
    """(groups to merge, groups to evict): segment_sparse's counts of each, on random groups."""
    merged, evicted = compression_counts(length, settings)
    if merged + evicted == 0:
        return [], []
    order = choose_groups(None, length, settings, "random", seed=seed, count=merged + evicted, ranked=True)
    return sorted(order[evicted:]), sorted(order[:evicted])


def plan_score_weighted(length: int, groups: list[int], scores: torch.Tensor, sharpness: float = SHARPNESS,
                        evict: list[int] | tuple[int, ...] = ()) -> ScoreWeightedPlan:
    """`plan_groups`, but a merged slot leans to its most attended tokens: weights ∝ score ** sharpness,
    its position their weighted mean, its bias the log of its effective token count
    (`ScoreWeightedPlan.log_counts`)."""
    plan = plan_groups(length, groups, evict=evict)
    weight = plan.weight.clone()
    positions = torch.tensor(plan.positions, dtype=torch.float32)
    mass = torch.ones(plan.num_slots, dtype=torch.float32)
    merged = sorted({g for g in groups if g < length // GROUP})
    if merged:
        members = torch.tensor(merged)[:, None] * GROUP + torch.arange(GROUP)  # [merged groups, 4]
        slots = plan.target[members[:, 0]]
        s = scores[:length].float().cpu().clamp_min(1e-12)[members]  # one copy to the host
        top = s.max(dim=1, keepdim=True).values
        w = (s / top) ** sharpness
        w = w / w.sum(dim=1, keepdim=True)
        mass[slots] = (s.sum(dim=1, keepdim=True) / top).squeeze(1)
        weight[members.reshape(-1)] = w.reshape(-1)
        positions[slots] = (w * members.float()).sum(dim=1)
    return ScoreWeightedPlan(plan.target, weight, plan.counts, positions.tolist(), mass.tolist())


def plan_streaming(length: int, keep: int, sinks: int) -> MergePlan:
    """StreamingLLM: the first `sinks` tokens and the most recent `keep - sinks`."""
    target = torch.full((length,), -1, dtype=torch.int64)
    recent = max(0, keep - sinks)
    kept = list(range(min(sinks, length))) + list(range(max(sinks, length - recent), length))
    target[kept] = torch.arange(len(kept))
    return MergePlan(target, torch.ones(length), [1] * len(kept), [float(k) for k in kept])


def policy_plan(name: str, n: int, settings: MergeSettings, scores: torch.Tensor, seed: int,
                rotary: RotaryTable | None) -> tuple[MergePlan, bool, RotaryTable | None]:
    """(plan, with the log-count bias, RoPE table for merged keys) of policy `name` for an n-token
    prompt, at the groups / slot budget segment_sparse has at `settings`."""
    merge, evict = choose_compression(scores, n, settings)
    if name == "segment_sparse":
        return plan_groups(n, merge, evict=evict), True, rotary
    if name == "merge_only":  # no eviction: groups ranked by sum - max, sharpened score weights
        return plan_score_weighted(n, choose_groups(scores, n, settings, "merge"), scores), True, rotary
    if name == "merge_score_weighted":
        return plan_score_weighted(n, merge, scores, evict=evict), True, rotary
    if name == "merge_unsharpened":
        return plan_score_weighted(n, merge, scores, sharpness=1.0, evict=evict), True, rotary
    if name == "merge_post_rope":
        return plan_groups(n, merge, evict=evict), True, None
    if name == "merge_no_bias":
        return plan_groups(n, merge, evict=evict), False, rotary
    if name == "evict":
        return plan_groups(n, [], evict=merge + evict), True, None
    if name == "evict_same_ratio":  # evicting a group frees 4 slots: as many groups as free the same slots
        freed = n - compressed_length(n, settings)
        lowest = choose_groups(scores, n, settings, "evict", count=round(freed / GROUP))
        return plan_groups(n, [], evict=lowest), True, None
    if name == "random":  # segment_sparse's counts of merged and evicted groups, on random groups
        merge, evict = random_compression(n, settings, seed)
        return plan_groups(n, merge, evict=evict), True, rotary
    if name == "streaming":
        return plan_streaming(n, compressed_length(n, settings), settings.sinks), True, None
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")

