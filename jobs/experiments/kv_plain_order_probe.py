"""What a "plain attention order first" rule would cost segment-sparse's surprisal probe (a research
measurement; the rule is not built).

    python jobs/experiments/kv_plain_order_probe.py [--rows 48] [--prompt-len 512]

The rule: take the groups the window's attention alone would compress (SnapKV's choice,
`kv_merge.least_attended`) when none of them is surprising enough to protect, else plan as now
(`kv_merge.ProtectionSearch`). It ties evict-only wherever attention spares every surprising group,
but asks for the surprisal of attention's choice first. On `--rows` held-out prompts of the bundled
model (balanced preset), prints: the groups the current search asks for, the groups the rule would
ask for (its first round, plus the current search's groups where it falls back, those already known
free), and on how many prompts it falls back.
"""

from __future__ import annotations

import argparse

import torch

from flashx_batch import Engine
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime.kv_merge import GROUP, ProtectionSearch, group_sums, least_attended
from flashx_batch.runtime.options import bundled_model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(bundled_model_dir(), cache_policy="segment_sparse", max_batch_size=8,
                                    max_input_len=args.prompt_len, max_output_len=64, segment_size=16)
    runner, settings = engine.runner, engine.runner.merge
    prompts = token_windows(engine.tokenizer, args.prompt_len, args.rows)
    groups = asked_now = asked_rule = falls_back = 0
    for first in range(0, len(prompts), 4):
        batch = prompts[first : first + 4]
        starts = [k * (args.prompt_len + 64) for k in range(len(batch))]  # inside the arena, apart
        _, scores, kept = runner.passes.prefill_packed_at(batch, starts, observe=settings.window, keep_final=True)
        probe = runner.scorer.probe(kept)
        every = probe.tokens([torch.arange(len(p)) for p in batch])
        for prompt, row_scores, surprisal in zip(batch, scores, every, strict=True):
            row_scores = row_scores.cpu()
            groups += len(prompt) // GROUP
            search, asked = ProtectionSearch(row_scores, len(prompt), settings), set()
            while wanted := search.wanted():
                asked |= set(wanted)
                search.feed(wanted, group_sums(surprisal, wanted))
            asked_now += len(asked)
            plain = least_attended(row_scores, len(prompt), settings, search.need) if search.need else []
            known = set(plain)
            if plain and bool((group_sums(surprisal, plain) >= search.bar).any()):
                falls_back += 1
                known |= asked
            asked_rule += len(known)
    print(f"{len(prompts)} prompts, {groups} groups: the current search asks for {asked_now} "
          f"({asked_now / groups:.2f}), the rule would ask for {asked_rule} ({asked_rule / groups:.2f}) "
          f"and falls back to the current plan on {falls_back} of {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
