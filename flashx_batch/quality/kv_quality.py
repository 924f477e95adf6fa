"""Teacher-forced quality of KV compression policies against the full (static) cache.

For each held-out window: prefill the prompt, compress its KV with a policy, then feed the
continuation through the compressed cache and compare its logits with the full-cache logits at
the same positions (mean KL, top-1 agreement, ΔNLL). `kv_bytes_ratio` = prompt slots kept ÷ prompt
tokens. Called by `python -m flashx_batch.quality`.
"""

from __future__ import annotations

import torch

from flashx_batch import Engine
from flashx_batch.quality.ablations import policy_plan
from flashx_batch.quality.metrics import Agreement
from flashx_batch.runtime.kv_merge import MergeSettings, apply_plan


def _full_logits(engine: Engine, tokens: list[int], from_position: int) -> torch.Tensor:
    logits, _ = engine.runner.passes.extend(tokens, 0, 0, 0, all_logits=True)
    return logits[from_position:]


def policy_quality(engine: Engine, windows: list[list[int]], prompt_len: int,
                   runs: dict[str, tuple[MergeSettings, tuple[str, ...]]]) -> dict[str, dict[str, dict[str, float]]]:
    """For each run (settings, policies): every policy at the same groups / slot budget as
    `segment_sparse` at those settings (the least attended groups evicted, the next merged 4:1 with
    equal weights: `choose_compression`); the other policies are the ablations of
    `flashx_batch.quality.ablations` (`POLICIES`). The `merge_*` ablations change how its merged
    groups are merged; `merge_only` merges the fraction's groups and evicts none (groups ranked by
    sum - max, weights sharpened from the scores); `evict` drops every group segment_sparse touches.
    The full-cache reference and the window scores do not depend on the settings (all runs must
    share one observation window), so each window computes them once."""
    observe = {settings.window for settings, _ in runs.values()}
    if len(observe) != 1:
        raise ValueError(f"policy_quality: runs observe {sorted(observe)} windows; score one window size per call")
    observe_window = observe.pop()
    results = {run: {name: Agreement() for name in policies} for run, (_, policies) in runs.items()}
    slots = {run: dict.fromkeys(policies, 0) for run, (_, policies) in runs.items()}
    runner, arena = engine.runner, engine.runner.arena
    for index, window in enumerate(windows):
        prompt, cont = window[:prompt_len], window[prompt_len:-1]
        targets = torch.tensor(window[prompt_len + 1 :])
        reference = _full_logits(engine, prompt + cont, prompt_len)
        _, scores = runner.passes.extend(prompt, 0, 0, 0, observe=observe_window)
        for run, (settings, policies) in runs.items():
            rotary = runner.model.rotary if settings.rerotate else None
            for name in policies:
                plan, with_bias, merge_rotary = policy_plan(name, prompt_len, settings, scores, index, rotary)
                runner.passes.extend(prompt, 0, 0, 0)  # fresh prompt KV: the previous policy rewrote it
                used = apply_plan(arena, 0, prompt_len, 0, plan, rotary=merge_rotary)
                if not with_bias:  # the no-bias ablation: merged slots attended without their log-count bias
                    arena.bias[:used] = 0.0
                logits, _ = runner.passes.extend(cont, 0, used, prompt_len, all_logits=True)
                results[run][name].add(reference, logits, targets)
                slots[run][name] += used
    return {run: {name: {**agg.summary(), "kv_bytes_ratio": slots[run][name] / (prompt_len * len(windows))}
                  for name, agg in by_policy.items()} for run, by_policy in results.items()}


def long_input_quality(engine: Engine, windows: list[list[int]], prompt_len: int,
                       budget: int, merge: MergeSettings | None = None) -> dict[str, dict[str, float]]:
    """A prompt longer than `budget`: rolling merge (history folded into `budget` slots, under `merge`;
    None: the engine's settings) versus truncate (keep the last `budget` tokens, positions restarting
    at 0), both against the full prompt."""
    results = {"rolling_merge": Agreement(), "truncate": Agreement()}
    for window in windows:
        prompt, cont = window[:prompt_len], window[prompt_len:-1]
        targets = torch.tensor(window[prompt_len + 1 :])
        reference = _full_logits(engine, prompt + cont, prompt_len)
        _, used = engine.runner.compress.rolling_prefill(prompt, 0, budget, merge)
        logits, _ = engine.runner.passes.extend(cont, 0, used, prompt_len, all_logits=True)
        results["rolling_merge"].add(reference, logits, targets)
        tail = prompt[-budget:]
        truncated = _full_logits(engine, tail + cont, budget)
        results["truncate"].add(reference, truncated, targets)
    return {name: {**agg.summary(), "kv_bytes_ratio": budget / prompt_len} for name, agg in results.items()}
