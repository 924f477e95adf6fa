"""Segment-sparse KV: which 4-token groups to evict or merge, and the rewrite itself.

Pure planning (`plan_*`, `choose_compression`) is integer / small-tensor work on the host;
`apply_plan` / `apply_plans` are the one place that rewrites arena tensors. A plan maps every source
slot to a target slot (or drops it) with a weight, so one mechanism serves segment-sparse compression
of a prompt (the least attended groups evicted, the next merged 4:1) and rolling merges of
already-merged slots (weights by token count) for prompts longer than max_input_len.

Merged slot = weighted mean of its tokens' values and keys (equal weights for a segment-sparse
merge; token counts for a rolling merge; keys averaged before RoPE and rotated to the slot's
weighted mean position when a RoPE table is given); attention adds log(count) to its logit, so a
slot standing for 4 identical tokens weighs exactly as the 4 did.

The research ablations `python -m flashx_batch.quality` compares this against (merge-only,
score-weighted merges, evict-only, random groups, StreamingLLM, no bias) live in
`flashx_batch/quality/ablations.py`; the measurements are in docs/benchmarks.md ("Segment-sparse KV").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from flashx_batch.kvcache.arena import KVArena
from flashx_batch.models.layers import RotaryTable
from flashx_batch.runtime.options import KV_PRESETS

GROUP = 4


@dataclass(frozen=True)
class MergeSettings:
    # fraction and evict_share defaults: the balanced preset (`runtime.kv_preset`), picked from the
    # task curves of `python -m flashx_batch.quality.kv_tasks` (docs/benchmarks.md, "Segment-sparse KV")
    fraction: float = KV_PRESETS["balanced"][0]  # of eligible groups
    sinks: int = 4  # first tokens never merged (attention sinks)
    window: int = 32  # last tokens: the observation window, never merged
    rerotate: bool = True  # merge keys before RoPE and rotate to the group's mean position
    # of the slots the fraction frees, the share freed by evicting the least attended groups outright;
    # the rest by 4:1 merges of the next least attended (0 = merge only, 1 = evict only)
    evict_share: float = KV_PRESETS["balanced"][1]
    # mean surprisal per token (nats) from which a group is protected (`ProtectionSearch`); the
    # engine sets it from the vocabulary (`protect_nats_for`); None: attention only
    protect_nats: float | None = None

    @property
    def surprisal(self) -> bool:
        """Whether a plan wants the prompt's per-token surprisal (the prefill computes it then)."""
        return self.protect_nats is not None


@dataclass
class MergePlan:
    """target[i] = output slot of source slot i (-1 = dropped); weight[i] its share in that slot."""

    target: torch.Tensor  # [L] int64
    weight: torch.Tensor  # [L] float32
    counts: list[int]  # tokens each output slot stands for
    positions: list[float]  # the (count-weighted mean) position each output slot stands at

    @property
    def num_slots(self) -> int:
        return len(self.counts)

    def log_counts(self) -> torch.Tensor:
        """Per-slot attention bias: log(count), so a slot standing for 4 identical tokens weighs as the 4 did."""
        return torch.tensor([math.log(c) for c in self.counts], dtype=torch.float32)


def _eligible(length: int, settings: MergeSettings) -> range:
    first = -(-settings.sinks // GROUP)
    last = (length - settings.window) // GROUP  # exclusive
    return range(first, max(first, last))


def eligible_groups(length: int, settings: MergeSettings) -> list[int]:
    """Groups g (tokens 4g..4g+3) clear of the sinks and of the observation window."""
    return list(_eligible(length, settings))


def merge_count(length: int, settings: MergeSettings) -> int:
    return round(settings.fraction * len(_eligible(length, settings)))


def compression_counts(length: int, settings: MergeSettings) -> tuple[int, int]:
    """(groups merged 4:1, groups evicted) for a `length`-token prompt. Together they free about the
    slots merging `merge_count` groups would (GROUP - 1 per merged group, GROUP per evicted one),
    `evict_share` of them by eviction. Rounding to whole groups can free a slot or two more or fewer;
    `compressed_length` is exact either way. `evict_share` 1 evicts only."""
    freed = (GROUP - 1) * merge_count(length, settings)
    if settings.evict_share >= 1.0:
        return 0, round(freed / GROUP)
    evicted = round(settings.evict_share * freed / GROUP)
    return max(0, round((freed - GROUP * evicted) / (GROUP - 1))), evicted


def compressed_length(length: int, settings: MergeSettings) -> int:
    """Slots a `length`-token prompt occupies once compressed at `settings`."""
    merged, evicted = compression_counts(length, settings)
    return length - (GROUP - 1) * merged - GROUP * evicted


def max_compressed_length(limit: int, settings: MergeSettings) -> int:
    """The most slots any prompt of up to `limit` tokens occupies once compressed. Not simply the
    value at `limit`: rounding the group counts can leave a slightly shorter prompt a slot or two longer."""
    return max(compressed_length(n, settings) for n in range(1, limit + 1))


def protect_nats_for(vocab_size: int, share: float = 0.75) -> float:
    """The mean surprisal per token from which a group is protected: `share` of what a token drawn
    uniformly from the vocabulary carries (ln vocab_size). Ordinary text sits far below it (a few
    nats per token for any model worth running); random strings, ids and keys sit at or above it."""
    return share * math.log(vocab_size)


def least_attended(scores: torch.Tensor, length: int, settings: MergeSettings, count: int) -> list[int]:
    """The `count` eligible groups whose tokens received the least attention (pooled sum of
    `scores`, one per token), least attended first. `count` must be at least 1."""
    groups = _eligible(length, settings)
    lost = group_sums(scores, groups)
    return [groups[i] for i in torch.argsort(lost, stable=True)[:count].tolist()]


def attention_order(scores: torch.Tensor, length: int, settings: MergeSettings) -> list[int]:
    """The eligible groups, least worth keeping by attention first: ordered by what the observation
    window (the prompt's last tokens, where the question sits) paid the group, or the group before
    it. The tokens after an attended one are what copying or recalling needs next, and the window
    attends to where a match starts. Ties go to the earlier group."""
    groups = _eligible(length, settings)
    attention = group_sums(scores, groups)
    attention = torch.maximum(attention, torch.cat((attention[:1], attention[:-1])))
    return [groups[i] for i in torch.argsort(attention, stable=True).tolist()]


class ProtectionSearch:
    """The segment-sparse plan of one prompt, asking for surprisal only where it decides anything.

    Attention orders the groups (`attention_order`); surprisal protects: a group whose tokens
    carried, on average, at least `settings.protect_nats` that their context did not predict (about
    as unpredictable as random vocabulary: ids, keys, numbers, a string to copy) is worth more than
    any unprotected group, however little the window looked at it. A question that arrives after
    the prompt (the next request about a document, the queries of a recall task) is invisible to
    attention; what it will need is where the surprise was, and the model cannot reconstruct it.
    Protected groups are ordered among themselves by surprisal, so an over-full budget gives up the
    least surprising first.

    The plan compresses the least attended unprotected groups, so only the groups at the bottom of the
    attention order need their surprisal: `wanted()` names the next ones (the shortfall and a few
    more, `slack`), `feed()` takes their per-group sums,
    until `wanted()` is empty; then `plan()`. The plan is exactly the one every group's surprisal would
    give. Without `settings.protect_nats` nothing is wanted: attention alone."""

    def __init__(self, scores: torch.Tensor, length: int, settings: MergeSettings) -> None:
        self.merged, self.evicted = compression_counts(length, settings)
        self.need = self.merged + self.evicted
        self.order = attention_order(scores, length, settings) if self.need else []
        # compared in float32, as the per-group sums are
        self.bar = None if settings.protect_nats is None else float(torch.tensor(GROUP * settings.protect_nats))
        self.asked = 0  # groups of `order` whose surprisal is known
        self.later = 0  # size of the last round after the first (0: none yet)
        self.unprotected: list[int] = []
        self.protected: dict[int, float] = {}

    def wanted(self) -> list[int]:
        if self.bar is None or len(self.unprotected) >= self.need or self.asked >= len(self.order):
            return []
        short = self.need - len(self.unprotected)
        if not self.asked:
            return self.order[: short + self.slack(short)]
        # later rounds: the shortfall over the share of asked groups that came back unprotected, with a
        # quarter more to spare (licence text: one small round after the first, where asking "as many
        # again" probed nearly every group of a prompt with a few names in it), and at least twice the
        # previous later round: a band of protected groups past the first cut takes a few doubling
        # rounds, not dozens of small ones; a mostly protected prompt asks for the rest at once
        count = math.ceil(short * 1.25 * self.asked / max(1, len(self.unprotected)))
        count = max(count + self.slack(count), 2 * self.later)
        return self.order[self.asked : self.asked + count]

    @staticmethod
    def slack(short: int) -> int:
        """Groups asked for beyond the shortfall: a protected group or two among them costs no
        second round (each round runs the final layer once more), more would be paid for every prompt."""
        return 1 + short // 16

    def feed(self, groups: list[int], info: torch.Tensor) -> None:
        """`info[i]`: the summed surprisal of groups[i]'s tokens, for the groups `wanted()` returned."""
        if groups != self.order[self.asked : self.asked + len(groups)]:
            raise ValueError("ProtectionSearch.feed takes the groups wanted() returned, in that order")
        if self.asked:
            self.later = len(groups)
        for g, value in zip(groups, info.tolist(), strict=True):
            if value >= self.bar:
                self.protected[g] = value
            else:
                self.unprotected.append(g)
        self.asked += len(groups)

    def plan(self) -> tuple[list[int], list[int]]:
        """(groups to merge, groups to evict): the least valuable `evicted` groups go, the next `merged`
        are merged 4:1 (equal weights, log 4 bias), so a merge spends its slot where an approximation is
        worth keeping while groups the model can do without are dropped."""
        if self.wanted():
            raise ValueError("ProtectionSearch.plan before every wanted group was fed")
        if self.bar is None:
            ranked = self.order
        else:  # every group was asked for, or enough unprotected ones were found
            ranked = self.unprotected + sorted(self.protected, key=lambda g: (self.protected[g], g))
        chosen = ranked[: self.need]
        return sorted(chosen[self.evicted :]), sorted(chosen[: self.evicted])


def group_tokens(groups: list[int]) -> torch.Tensor:
    """The token positions of the listed 4-token groups, group after group."""
    return (torch.tensor(groups, dtype=torch.long)[:, None] * GROUP + torch.arange(GROUP)).reshape(-1)


def group_sums(values: torch.Tensor, groups: list[int] | range) -> torch.Tensor:
    """Sum of a per-token tensor over each listed 4-token group (any order) -> float32 [len(groups)].
    Consecutive groups (a `range`, such as the eligible ones) are one slice: no index tensor."""
    if isinstance(groups, range) and groups.step == 1:
        return values.float()[groups.start * GROUP : groups.stop * GROUP].view(-1, GROUP).sum(-1)
    return values.float()[group_tokens(groups)].view(-1, GROUP).sum(-1)


def choose_compression(scores: torch.Tensor, length: int, settings: MergeSettings,
                       surprisal: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """(groups to merge, groups to evict): the segment-sparse plan for one prompt (`ProtectionSearch`)
    from every token's surprisal at hand. `scores`: the attention each token received from the
    observation window (one value per token); `surprisal`: each token's -log p given the tokens before
    it (None: attention only). The measurements behind the split are in docs/benchmarks.md
    ("Segment-sparse KV")."""
    search = ProtectionSearch(scores, length, settings if surprisal is not None
                              else dataclasses.replace(settings, protect_nats=None))
    while wanted := search.wanted():
        search.feed(wanted, group_sums(surprisal, wanted))
    return search.plan()


def plan_groups(length: int, groups: list[int], evict: list[int] | tuple[int, ...] = ()) -> MergePlan:
    """Merge each listed 4-token group into one slot (its tokens weighed equally, bias log 4) and
    evict the groups in `evict`; every other token keeps its slot.

    Host bookkeeping on a few hundred integers per row, done in numpy: a torch op costs several times
    a numpy op at this size, and a packed prefill plans every row it compresses."""
    if set(groups) & set(evict):
        raise ValueError(f"plan_groups: groups {sorted(set(groups) & set(evict))[:8]} are both merged and evicted")
    tokens = np.arange(length)
    whole = length // GROUP  # groups lying fully inside the prompt: only those can merge
    group_of = np.minimum(tokens // GROUP, whole)
    inside = tokens < whole * GROUP

    def members_of(listed) -> np.ndarray:
        chosen = np.zeros(whole + 1, dtype=bool)
        chosen[[g for g in listed if g < whole]] = True
        return chosen[group_of] & inside

    in_group, dropped = members_of(groups), members_of(evict)
    kept = ~(in_group | dropped)
    starts = kept | ((tokens % GROUP == 0) & in_group)  # tokens that open a slot
    target = np.cumsum(starts) - 1
    target[dropped] = -1
    num_slots = int(starts.sum())
    weight = np.ones(length, dtype=np.float32)
    counts = np.ones(num_slots, dtype=np.int64)
    positions = np.zeros(num_slots, dtype=np.float32)
    positions[target[kept]] = tokens[kept]
    if in_group.any():
        members = tokens[in_group].reshape(-1, GROUP)  # [merged groups, 4]
        slots = target[members[:, 0]]
        counts[slots] = GROUP
        weight[members.reshape(-1)] = np.float32(1.0 / GROUP)
        positions[slots] = (np.float32(1.0 / GROUP) * members.astype(np.float32)).sum(axis=1, dtype=np.float32)
    return MergePlan(torch.from_numpy(target.astype(np.int64)), torch.from_numpy(weight), counts.tolist(),
                     positions.tolist())


def plan_oldest(counts: list[int], positions: list[float], slots_to_free: int, settings: MergeSettings) -> MergePlan:
    """Rolling merge: fold the oldest runs of 4 slots (after the sinks, before the window) into one
    until `slots_to_free` slots are free. Already-merged slots merge again, weighted by their token
    counts, so older history grows coarser while recent tokens stay exact."""
    target = torch.empty(len(counts), dtype=torch.int64)
    weight = torch.ones(len(counts), dtype=torch.float32)
    out_counts: list[int] = []
    out_positions: list[float] = []
    freed, i, limit = 0, 0, len(counts) - settings.window
    while i < len(counts):
        if freed < slots_to_free and settings.sinks <= i and i + GROUP <= limit:
            run = counts[i : i + GROUP]
            total = sum(run)
            target[i : i + GROUP] = len(out_counts)
            weight[i : i + GROUP] = torch.tensor([c / total for c in run])
            out_counts.append(total)
            out_positions.append(sum(c * p for c, p in zip(run, positions[i : i + GROUP])) / total)
            freed += GROUP - 1
            i += GROUP
        else:
            target[i] = len(out_counts)
            out_counts.append(counts[i])
            out_positions.append(positions[i])
            i += 1
    if 0 < freed < slots_to_free:  # one pass was not enough: fold the (now coarser) history again
        again = plan_oldest(out_counts, out_positions, slots_to_free - freed, settings)
        return _compose(target, weight, again)
    return MergePlan(target, weight, out_counts, out_positions)


def _compose(first_target: torch.Tensor, first_weight: torch.Tensor, second: MergePlan) -> MergePlan:
    kept = first_target >= 0
    target = torch.full_like(first_target, -1)
    target[kept] = second.target[first_target[kept]]
    weight = first_weight * torch.where(kept, second.weight[first_target.clamp_min(0)], 0.0)
    return MergePlan(target, weight, second.counts, second.positions)


def apply_plan(arena: KVArena, src_start: int, length: int, dst_start: int, plan: MergePlan,
               rotary: RotaryTable | None = None, src_positions: list[float] | None = None) -> int:
    """Rewrite `length` slots at `src_start` (all layers, K and V) into `plan.num_slots` slots at
    `dst_start`, and set their log-count bias. The source is read fully before the write, so the
    two regions may overlap (in-place compression). Returns the new slot count.

    With `rotary`, a merged slot's key is the mean of its tokens' keys *before* RoPE, rotated to
    the slot's mean position, instead of the mean of rotated keys (whose phases partly cancel).
    Unmerged slots are copied bit for bit either way."""
    return apply_plans(arena, [(src_start, length, dst_start, plan)], rotary, src_positions)[0]


def apply_plans(arena: KVArena, jobs: list[tuple[int, int, int, MergePlan]],
                rotary: RotaryTable | None = None, src_positions: list[float] | None = None) -> list[int]:
    """`apply_plan` for several (src_start, length, dst_start, plan) at once — the rows of one packed
    prefill. Every job's source is read before any job writes, so a job's destination may overlap
    any job's source; the jobs' destinations must not overlap one another (each row writes its own
    stripe: the writes go in one `index_copy_`, whose order on a GPU is not defined). `src_positions`
    (a rolling merge's slot positions) belong to a single job.
    Returns each job's slot count."""
    if src_positions is not None and len(jobs) != 1:
        raise ValueError("src_positions describe one job's source slots; pass one job with them")
    fan_ins = []  # per job: the source slots kept, and how many sources each target slot has (numpy, host)
    for _, _, _, plan in jobs:
        target = plan.target.numpy()
        kept = np.flatnonzero(target >= 0)
        fan_ins.append((kept, np.bincount(target[kept], minlength=plan.num_slots)))
    if all(np.isin(fan_in, (1, GROUP)).all() for _, fan_in in fan_ins):
        _apply_groups(arena, jobs, fan_ins, rotary, src_positions)
    else:  # one by one: only rolling merges (a single job) have slots of other fan-in
        for (src_start, length, dst_start, plan), (kept, _) in zip(jobs, fan_ins):
            _apply_any(arena, src_start, length, dst_start, plan, torch.from_numpy(kept), rotary, src_positions)
    # every job's log-count bias in one write (on a GPU: one copy over, not one per row)
    where = torch.cat([torch.arange(dst, dst + plan.num_slots) for _, _, dst, plan in jobs])
    bias = torch.cat([plan.log_counts() for *_, plan in jobs])
    arena.write_bias(where, bias)
    return [plan.num_slots for *_, plan in jobs]


def _apply_groups(arena: KVArena, jobs: list[tuple[int, int, int, MergePlan]],
                  fan_ins: list[tuple[np.ndarray, np.ndarray]], rotary: RotaryTable | None,
                  src_positions: list[float] | None) -> None:
    """Every slot is one source copied or GROUP sources merged (4:1 plans, evictions, one-pass rolling
    merges): gather the copies and the groups of every job, reduce each group densely, write all
    back. Faster than the scatter-add of `_apply_any` (docs/benchmarks.md, "Segment-sparse KV"), and
    one set of kernels for all the rows of a packed prefill."""
    storage, device = arena.storage, arena.storage.device
    # the index bookkeeping is numpy on the host (a few small arrays per row of the pack); one copy of
    # each index array to the device at the end
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("src", "dst", "members", "slots", "w", "at", "slot_at")}
    for (src_start, _, dst_start, plan), (kept, fan_in) in zip(jobs, fan_ins):
        target = plan.target.numpy()
        per_source = fan_in[target[kept]]
        single = kept[per_source == 1]
        grouped = kept[per_source == GROUP]
        grouped = grouped[np.argsort(target[grouped], kind="stable")]  # each slot's sources side by side
        parts["src"].append(src_start + single)
        parts["dst"].append(dst_start + target[single])
        if len(grouped):
            slots = target[grouped[::GROUP]]
            parts["members"].append(src_start + grouped)
            parts["slots"].append(dst_start + slots)
            parts["w"].append(plan.weight.numpy()[grouped])
            # a source slot's position: its token index, or a rolling merge's slot positions
            parts["at"].append(grouped.astype(np.float32) if src_positions is None
                               else np.asarray(src_positions, dtype=np.float32)[grouped])
            parts["slot_at"].append(np.asarray(plan.positions, dtype=np.float32)[slots])
    joined = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items() if v}
    # index_select / index_copy_ move whole [Hkv, D] slots: faster than advanced indexing on dim 2
    # (docs/benchmarks.md, "Segment-sparse KV")
    copies = storage.index_select(2, joined["src"].to(device))  # copies, read before any write
    writes = [(joined["dst"], copies)]
    if parts["members"]:
        weights = joined["w"].view(-1, GROUP).to(device)[None, :, :, None, None]
        members = storage.index_select(2, joined["members"].to(device)).float()  # [layers, 2, 4g, Hkv, D]
        values = (members[:, 1].unflatten(1, (-1, GROUP)) * weights).sum(2)
        keys = members[:, 0]
        if rotary is not None:
            keys = rotary.rotate(keys, joined["at"], inverse=True)  # back to before RoPE
        keys = (keys.unflatten(1, (-1, GROUP)) * weights).sum(2)
        if rotary is not None:
            keys = rotary.rotate(keys, joined["slot_at"])
        writes.append((joined["slots"], torch.stack((keys, values), dim=1).to(storage.dtype)))
    for targets, data in writes:
        storage.index_copy_(2, targets.to(device), data)


def _apply_any(arena: KVArena, src_start: int, length: int, dst_start: int, plan: MergePlan, kept: torch.Tensor,
               rotary: RotaryTable | None, src_positions: list[float] | None) -> None:
    """Any plan (slots of any fan-in, e.g. a rolling merge composed over two passes): scatter-add."""
    device = arena.storage.device
    source = arena.storage[:, :, src_start : src_start + length].float()  # [layers, 2, L, Hkv, D]
    out = torch.zeros(*source.shape[:2], plan.num_slots, *source.shape[3:], dtype=torch.float32, device=device)
    weights = plan.weight[kept].to(device).view(1, 1, -1, 1, 1)
    targets = plan.target[kept].to(device)
    out.index_add_(2, targets, source[:, :, kept.to(device)] * weights)
    merged = [i for i, c in enumerate(plan.counts) if c > 1]
    if rotary is not None and merged:
        positions = torch.tensor(src_positions if src_positions is not None else range(length), dtype=torch.float32)
        into_merged = (torch.tensor(plan.counts) > 1)[plan.target[kept]]  # only these tokens need un-rotating
        tokens = kept[into_merged]
        keys = rotary.rotate(source[:, 0, tokens.to(device)], positions[tokens], inverse=True)  # before RoPE
        mean = torch.zeros_like(out[:, 0]).index_add_(1, targets[into_merged.to(device)],
                                                       keys * weights[:, 0, into_merged.to(device)])
        index = torch.tensor(merged, device=device)
        at = torch.tensor([plan.positions[i] for i in merged], dtype=torch.float32)
        out[:, 0, index] = rotary.rotate(mean[:, index], at)
    arena.storage[:, :, dst_start : dst_start + plan.num_slots] = out.to(arena.storage.dtype)
