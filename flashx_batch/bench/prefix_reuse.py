"""Prefix-reuse benchmark: prefix reuse on few-shot sweeps (W3) and multi-turn chat histories.

    python -m flashx_batch.bench.prefix_reuse --out results/prefix_reuse [--repeats 3]

Same engine settings with and without `prefix_cache_tokens`, interleaved repeats, medians.
Reports output tokens/s and prompt tokens computed (prefill) for both; writes OUT/prefix_reuse.json.
Workloads are built from the held-out legal text, so token statistics are real:
- few-shot: groups of 32 rows; each row = a shared few-shot preamble (80 % of its tokens) + its
  own question; 8 new tokens per row.
- chat: conversations of 5 turns, one row per turn, each row the whole history so far (chat
  template applied) + the new user message; 8 new tokens per row.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger("flashx_batch.bench.prefix_reuse")


def few_shot_rows(tokenizer: Tokenizer, groups: int, per_group: int, row_len: int,
                  prefix_fraction: float = 0.8) -> list[list[int]]:
    """`groups` x `per_group` rows of `row_len` tokens; the first `prefix_fraction` shared per group."""
    prefix_len = int(row_len * prefix_fraction)
    texts = token_windows(tokenizer, row_len - prefix_len, groups * per_group + groups)
    preambles = token_windows(tokenizer, prefix_len, groups)
    return [preambles[g] + texts[groups + g * per_group + i] for g in range(groups) for i in range(per_group)]


def chat_rows(tokenizer: Tokenizer, conversations: int, turns: int = 5, turn_tokens: int = 40) -> list[list[int]]:
    """One row per turn: system + the history so far + the new user message, chat template applied."""
    pieces = [tokenizer.decode(w) for w in token_windows(tokenizer, turn_tokens, conversations * (2 * turns + 1))]
    rows: list[list[int]] = []
    for c in range(conversations):
        text = iter(pieces[c * (2 * turns + 1) : (c + 1) * (2 * turns + 1)])
        messages = [{"role": "system", "content": "You answer questions about software licences. " + next(text)}]
        for _ in range(turns):
            messages.append({"role": "user", "content": next(text)})
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            rows.append(tokenizer.encode(rendered, add_special_tokens=False))
            messages.append({"role": "assistant", "content": next(text)})
    return rows


def compare(model_dir: Path, rows: list[list[int]], new_tokens: int, repeats: int, **options) -> dict:
    common = dict(backend="cpu", dtype="float32", max_batch_size=8, max_input_len=max(map(len, rows)),
                  max_output_len=new_tokens, segment_size=16, **options)
    engines = {"without": Engine.from_pretrained(model_dir, **common),
               "with_prefix_reuse": Engine.from_pretrained(model_dir, prefix_cache_tokens=8192, **common)}
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    stats, outputs = {}, {}
    for _ in range(repeats):
        for name, engine in engines.items():
            if engine.scheduler.prefix_cache is not None:
                engine.scheduler.prefix_cache.clear()  # every repeat starts cold: no credit for earlier repeats
            started = time.perf_counter()
            outputs[name] = [o.token_ids for o in engine.generate(rows, params)]
            seconds[name].append(time.perf_counter() - started)
            stats[name] = engine.last_stats.as_dict()
    tok_s = {n: len(rows) * new_tokens / statistics.median(s) for n, s in seconds.items()}
    computed = {n: s["prefill_tokens_computed"] for n, s in stats.items()}
    return {
        "rows": len(rows), "input_tokens": stats["without"]["input_tokens"], "new_tokens": new_tokens,
        "identical_outputs": outputs["without"] == outputs["with_prefix_reuse"],
        "output_tok_per_s": tok_s, "seconds": seconds, "prefill_tokens_computed": computed,
        "ratio_output_tok_per_s": tok_s["with_prefix_reuse"] / tok_s["without"],
        "prefill_tokens_reduction": 1 - computed["with_prefix_reuse"] / computed["without"],
        "hit_rate": stats["with_prefix_reuse"]["prefix_hit_rate"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/prefix_reuse"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model_dir = args.model or bundled_model_dir()
    tokenizer = Tokenizer(model_dir)
    results = {
        "few_shot_w3": compare(model_dir, few_shot_rows(tokenizer, groups=2, per_group=32, row_len=320), 8,
                               args.repeats),
        "chat_5_turns": compare(model_dir, chat_rows(tokenizer, conversations=6), 8, args.repeats),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_reuse.json").write_text(json.dumps(results, indent=2))
    for name, r in results.items():
        log.info("%s: tok/s ratio %.2f, prefill tokens computed -%.1f %% (%s), identical outputs: %s", name,
                 r["ratio_output_tok_per_s"], 100 * r["prefill_tokens_reduction"], r["prefill_tokens_computed"],
                 r["identical_outputs"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
