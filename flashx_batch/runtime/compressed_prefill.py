"""Prompts whose KV is compressed as it enters the arena: segment-sparse rows (prefilled packed,
then merged down into their stripes) and over-long prompts rolled into a row's slots
(`long_input=rolling_merge`). Part of the torch runner: the merge needs the prefill's attention
scores. The planning is `runtime.kv_merge`; this module decides where rows are staged and in what
order they are merged, so that no merge overwrites a row still waiting. It runs on the forward passes
and the scorer (`ForwardPasses`, `Scorer`), never on the runner that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashx_batch.errors import ConfigError
from flashx_batch.models.layers import RotaryTable
from flashx_batch.runtime.kv_merge import (
    GROUP,
    MergeSettings,
    ProtectionSearch,
    apply_plan,
    apply_plans,
    group_tokens,
    plan_groups,
    plan_oldest,
)

if TYPE_CHECKING:
    from flashx_batch.runtime.forward_passes import ForwardPasses
    from flashx_batch.runtime.scorer import Scorer


@dataclass(frozen=True)
class PrefillPolicy:
    """How prompts go into stripes: plain, or segment-sparse (merged down after a packed prefill);
    a prompt longer than `max_input_len` is rolled into `prompt_slots` (long_input=rolling_merge)."""

    max_input_len: int
    prompt_slots: int
    sparse: bool
    segment_size: int
    max_output_len: int
    row_capacity: int  # slots of a full-length row, whole segments


class CompressedPrefill:
    def __init__(self, passes: ForwardPasses, scorer: Scorer, policy: PrefillPolicy, merge: MergeSettings) -> None:
        self.passes, self.scorer, self.policy, self.merge = passes, scorer, policy, merge

    def fill_merged(self, first: int, cap: int, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Segment-sparse rows into stripes first, first + 1, ...: as many rows as fit are prefilled
        in one packed pass, their full KV staged at the end of the free space (every stripe from
        `first` on, plus the spare segments), then merged down one by one, in stripe order, into
        their stripes. Staging at the end keeps each merge's destination clear of the rows still
        waiting: see `staged_rows`."""
        last_logits, slots, done = [], [], 0
        num_slots = self.passes.arena.num_slots
        while done < len(prompts):
            row = first + done
            lengths = [len(p) for p in prompts[done:]]
            count = staged_rows(row * cap, num_slots, cap, lengths)
            starts = (num_slots - torch.tensor(lengths[:count]).flip(0).cumsum(0).flip(0)).tolist()
            logits, scores, kept = self.passes.prefill_packed_at(
                prompts[done : done + count], starts, observe=self.merge.window, keep_final=self.merge.surprisal)
            probe = self.scorer.probe(kept) if kept is not None else None
            # the plans are host work on a few numbers per group: the scores come over once, not row by row
            scores = torch.cat(scores).cpu().split(lengths[:count])
            searches = [ProtectionSearch(row_scores, n, self.merge) for n, row_scores in zip(lengths, scores)]
            # every row's next groups in one call: the final layer and LM head for those tokens only
            while any(wanted := [s.wanted() for s in searches]):
                surprisal = probe.tokens([group_tokens(w) for w in wanted])
                for search, groups, values in zip(searches, wanted, surprisal, strict=True):
                    if groups:
                        search.feed(groups, values.view(-1, GROUP).sum(-1))
            del probe, kept  # the final layer's kept inputs: not held through the next packed prefill
            jobs = []
            for j, (n, src, search) in enumerate(zip(lengths, starts, searches)):
                merge, evict = search.plan()
                plan = plan_groups(n, merge, evict=evict)
                jobs.append((src, n, (row + j) * cap, plan))
            # reads every row before writing
            slots += apply_plans(self.passes.arena, jobs, rotary=self.rotary(self.merge))
            last_logits.append(logits)
            done += count
        return torch.cat(last_logits), slots

    def rotary(self, merge: MergeSettings) -> RotaryTable | None:
        """The RoPE table merges re-rotate keys with (None: average rotated keys as they are)."""
        return self.passes.model.rotary if merge.rerotate else None

    def rolling_prefill(self, prompt: list[int], start: int, budget: int, merge: MergeSettings | None = None
                        ) -> tuple[torch.Tensor, int]:
        """long_input=rolling_merge: prefill segment by segment; before a segment would overflow
        `budget` slots, fold the oldest slots 4:1 (again and again for the oldest history).

        Returns the last position's logits and the slots the row now holds at flat slot `start`
        (also the quality harness's entry point, which passes `merge` settings of its own; None: the
        engine's)."""
        merge = merge or self.merge
        chunk = min(self.policy.segment_size, budget - merge.sinks - merge.window)
        if chunk < 1:
            raise ConfigError(f"max_input_len={self.policy.max_input_len} leaves no room to roll a long prompt "
                              f"past {merge.sinks} sink and {merge.window} window tokens; raise it.")
        # positions run on past the slots: the RoPE table must cover the true token count
        self.passes.model.build_rotary(len(prompt) + self.policy.max_output_len)
        counts: list[int] = []
        positions: list[float] = []
        logits = None
        for begin in range(0, len(prompt), chunk):
            piece = prompt[begin : begin + chunk]
            overflow = len(counts) + len(piece) - budget
            if overflow > 0:
                plan = plan_oldest(counts, positions, overflow, merge)
                if plan.num_slots + len(piece) > budget:
                    raise ConfigError(f"rolling merge cannot fit a {len(prompt)}-token prompt into {budget} slots; "
                                      "raise max_input_len or shorten the prompt.")
                apply_plan(self.passes.arena, start, len(counts), start, plan, rotary=self.rotary(merge),
                           src_positions=positions)
                counts, positions = plan.counts, plan.positions
            logits, _ = self.passes.extend(piece, start, len(counts), begin)
            counts += [1] * len(piece)
            positions += [float(p) for p in range(begin, begin + len(piece))]
        return logits, len(counts)


def staged_rows(free_start: int, free_end: int, cap: int, lengths: list[int]) -> int:
    """How many of `lengths` (the next rows, stripe after stripe from `free_start`) one packed
    prefill can stage at the end of [free_start, free_end) and still merge safely in order: row j's
    merged slots, at most its stripe [free_start + j*cap, + cap), must end before the staged prompts
    of rows j+1.. begin (its own may overlap: a merge reads its source before writing). At least 1:
    the arena keeps the last stripe plus spare segments as long as the longest prompt."""
    count = 1
    while count < len(lengths):
        staged = lengths[: count + 1]
        if sum(staged) > free_end - free_start:
            break
        # row j's stripe end vs the first staged slot of row j + 1 (rows after j sit behind it)
        if any(free_start + (j + 1) * cap > free_end - sum(staged[j + 1 :]) for j in range(count + 1)):
            break
        count += 1
    return count
