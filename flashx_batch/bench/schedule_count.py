"""Decode steps W1 takes under three ways of handing out the KV arena: equal stripes cut for the
longest row still to come and per-row extents (both measured by running the engine, `kv_layout`
stripes / extents), and per-row (paged) allocation, counted.

    python -m flashx_batch.bench.schedule_count [--model PATH] [--out FILE.json]

Backs the README's schedule count: how many steps equal stripes cost, and that extents reach the
paged count (compaction keeps fragmentation from making rows wait). All use the same arena bytes
(max_batch_size rows of max_input_len + max_output_len slots), the same row cap (batch_growth x
max_batch_size) and the harness's W1 (full size, seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.workloads import FULL, mixed_intake
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.runtime.scheduler import bucket_key

BATCH, MAX_INPUT, MAX_OUTPUT, SEGMENT, GROWTH = 8, 512, 96, 16, 4


def paged_decode_steps(needs: list[int], new_tokens: list[int], slots: int, max_rows: int) -> int:
    """Decode steps for rows taken in order, each admitted before a step once its own `needs` slots
    (prompt + new tokens, whole segments) are free and fewer than `max_rows` rows decode; the row at
    the front waits for room, and the rows behind it wait with it. A row's first token comes from its
    prefill, so it decodes new_tokens - 1 steps and frees its slots when done."""
    queue, live, free, steps = deque(range(len(needs))), {}, slots, 0
    while queue or live:
        while queue and len(live) < max_rows and needs[queue[0]] <= free:
            row = queue.popleft()
            free -= needs[row]
            if new_tokens[row] > 1:
                live[row] = new_tokens[row] - 1
            else:
                free += needs[row]
        if not live:
            if queue:
                raise ValueError(f"row {queue[0]} needs {needs[queue[0]]} slots, the arena has {slots}")
            break
        steps += 1
        for row in list(live):
            live[row] -= 1
            if not live[row]:
                free += needs[row]
                del live[row]
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashx_batch.bench.schedule_count", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the bundled tiny model)")
    parser.add_argument("--out", type=Path, default=None, help="also write the counts here as JSON")
    args = parser.parse_args(argv)
    model = args.model or bundled_model_dir()
    engines = {(layout, order): Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=BATCH,
                                                       max_input_len=MAX_INPUT, max_output_len=MAX_OUTPUT,
                                                       segment_size=SEGMENT, batch_growth=GROWTH, kv_layout=layout,
                                                       sort_by_length=order == "sorted")
               for layout in ("stripes", "extents") for order in ("sorted", "arrival")}
    engine = engines["stripes", "sorted"]
    w1 = mixed_intake(FULL, engine.config.vocab_size)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w1.max_new_tokens]
    # what a row holds at its end, in whole segments (the engine's own arithmetic), in the engine's orders
    geometry = engine.geometry
    needs = [SEGMENT * geometry.segments_for(min(len(p), engine.prompt_slots) + q.max_new_tokens)
             for p, q in zip(w1.prompts, params)]
    counts: dict[str, dict[str, int]] = {}
    for order in ("sorted", "arrival"):
        rows = list(range(w1.rows))  # the extents' order: paged allocation takes rows as extents do
        if order == "sorted":
            rows.sort(key=lambda i: bucket_key(needs[i], w1.max_new_tokens[i], extents=True))
        counts[order] = {"paged": paged_decode_steps([needs[i] for i in rows], [w1.max_new_tokens[i] for i in rows],
                                                     BATCH * (MAX_INPUT + MAX_OUTPUT), GROWTH * BATCH)}
        for layout in ("stripes", "extents"):
            engine = engines[layout, order]
            engine.generate(w1.prompts, params)
            counts[order][layout] = engine.last_stats.decode_steps
            counts[order][f"peak_rows_{layout}"] = engine.last_stats.peak_rows
    print(f"W1 ({w1.rows} rows, {w1.output_tokens} output tokens), decode steps in {BATCH * (MAX_INPUT + MAX_OUTPUT)} "
          f"KV slots, at most {GROWTH * BATCH} rows:")
    print("order    stripes (ours)  extents (ours)  paged (counted)")
    for name, c in counts.items():
        print(f"{name:8} {c['stripes']:>14} {c['extents']:>15} {c['paged']:>16}")
    if args.out:
        args.out.write_text(json.dumps(counts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
