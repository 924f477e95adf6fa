"""Teacher-forced quality of KV compression policies against the full (static) cache.

For each held-out window: prefill the prompt, compress its KV with a policy, then feed the
continuation through the compressed cache and compare its logits with the full-cache logits at
the same positions (mean KL, top-1 agreement, ΔNLL). `kv_bytes_ratio` = prompt slots kept ÷ prompt
tokens. Called by `python -m flashx_batch.quality`.
"""

from __future__ import annotations

import torch

from flashx_batch import Engine
from flashx_batch.quality.metrics import Agreement
from flashx_batch.runtime.kv_merge import MergeSettings, apply_plan, choose_groups, plan_groups, plan_streaming


def _full_logits(engine: Engine, tokens: list[int], from_position: int) -> torch.Tensor:
    logits, _ = engine.runner.extend(tokens, 0, 0, 0, all_logits=True)
    return logits[from_position:]


def policy_quality(engine: Engine, windows: list[list[int]], prompt_len: int, settings: MergeSettings,
                   policies: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Every policy at the same mask / slot budget as `segment_sparse` at `settings.fraction`."""
    results = {name: Agreement() for name in policies}
    slots = {name: 0 for name in policies}
    runner, arena = engine.runner, engine.runner.arena
    for index, window in enumerate(windows):
        prompt, cont = window[:prompt_len], window[prompt_len:-1]
        targets = torch.tensor(window[prompt_len + 1 :])
        reference = _full_logits(engine, prompt + cont, prompt_len)
        _, scores = runner.extend(prompt, 0, 0, 0, observe=settings.window)
        mask = choose_groups(scores, prompt_len, settings, "segment_sparse")
        # evicting a group frees 4 slots, merging frees 3: evict 3/4 as many to keep as many slots
        same_ratio = choose_groups(scores, prompt_len, settings, "evict", count=round(0.75 * len(mask)))
        kept_by_merge = plan_groups(prompt_len, mask).num_slots
        rotary = engine.runner.model.rotary if settings.rerotate else None
        plans = {  # name: (plan, log-count bias, rotary for merged keys)
            "segment_sparse": (plan_groups(prompt_len, mask, scores=scores), True, rotary),
            "merge_unsharpened": (plan_groups(prompt_len, mask, scores=scores, sharpness=1.0), True, rotary),
            "merge_equal_weights": (plan_groups(prompt_len, mask), True, rotary),
            "merge_post_rope": (plan_groups(prompt_len, mask, scores=scores), True, None),
            "merge_no_bias": (plan_groups(prompt_len, mask, scores=scores), False, rotary),
            "evict": (plan_groups(prompt_len, mask, drop=True), True, None),
            "evict_same_ratio": (plan_groups(prompt_len, same_ratio, drop=True), True, None),
            "random": (plan_groups(prompt_len, choose_groups(None, prompt_len, settings, "random", seed=index),
                                   scores=scores), True, rotary),
            "streaming": (plan_streaming(prompt_len, kept_by_merge, settings.sinks), True, None),
        }
        for name in policies:
            plan, with_bias, merge_rotary = plans[name]
            runner.extend(prompt, 0, 0, 0)  # fresh prompt KV: the previous policy rewrote it
            used = apply_plan(arena, 0, prompt_len, 0, plan, with_bias=with_bias, rotary=merge_rotary)
            logits, _ = runner.extend(cont, 0, used, prompt_len, all_logits=True)
            results[name].add(reference, logits, targets)
            slots[name] += used
    return {name: {**agg.summary(), "kv_bytes_ratio": slots[name] / (prompt_len * len(windows))}
            for name, agg in results.items()}


def long_input_quality(engine: Engine, windows: list[list[int]], prompt_len: int,
                       budget: int) -> dict[str, dict[str, float]]:
    """A prompt longer than `budget`: rolling merge (history folded into `budget` slots) versus
    truncate (keep the last `budget` tokens, positions restarting at 0), both against the full prompt."""
    results = {"rolling_merge": Agreement(), "truncate": Agreement()}
    for window in windows:
        prompt, cont = window[:prompt_len], window[prompt_len:-1]
        targets = torch.tensor(window[prompt_len + 1 :])
        reference = _full_logits(engine, prompt + cont, prompt_len)
        _, used = engine.rolling_prefill(prompt, 0, budget)
        logits, _ = engine.runner.extend(cont, 0, used, prompt_len, all_logits=True)
        results["rolling_merge"].add(reference, logits, targets)
        tail = prompt[-budget:]
        truncated = _full_logits(engine, tail + cont, budget)
        results["truncate"].add(reference, truncated, targets)
    return {name: {**agg.summary(), "kv_bytes_ratio": budget / prompt_len} for name, agg in results.items()}
