"""Embedding throughput: `Engine.embed` ÷ `transformers` (its base model's batched forward, rows sorted by
length, batches of `--batch` right-padded with an attention mask, last-token pooling) on the bundled model and
the bundled sample's 120 prompts (cut to 512 tokens), float32 on CPU; the two alternated `--repeats` times,
prompt tokens per second each, the per-pair ratios; and the two's vectors compared (cosine).

    python jobs/measurements/embed_speed.py --out docs/results/embed_speed [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def hf_embed(model, prompts: list[list[int]], batch: int) -> torch.Tensor:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.no_grad():
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[row, : len(prompts[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(idx):
                out[i] = hidden[row, len(prompts[i]) - 1]
    return torch.nn.functional.normalize(torch.stack(out).float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModel

    from flashx_batch import Engine
    from flashx_batch.runtime.options import bundled_model_dir

    model_dir = bundled_model_dir()
    engine = Engine.from_pretrained(None, max_batch_size=args.batch, max_input_len=512, long_input="truncate")
    texts = [r["prompt"] for r in pq.read_table(REPO / "flashx_batch" / "assets" / "data" / "legal_docs.parquet")
             .to_pylist()]
    prompts = [engine.encode(t)[-512:] for t in texts]
    hf = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tokens = sum(map(len, prompts))
    ours, theirs = engine.embed(prompts, pooling="last"), hf_embed(hf, prompts, args.batch)  # warm, and compare
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    rates: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(args.repeats):
        for name, run in (("ours", lambda: engine.embed(prompts, pooling="last")),
                          ("transformers", lambda: hf_embed(hf, prompts, args.batch))):
            started = time.perf_counter()
            run()
            rates[name].append(tokens / (time.perf_counter() - started))
    ratios = [a / b for a, b in zip(rates["ours"], rates["transformers"])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(),
              "command": "python jobs/measurements/embed_speed.py " + " ".join(sys.argv[1:]),
              "rows": len(prompts), "prompt_tokens": tokens, "batch": args.batch,
              "torch_threads": torch.get_num_threads(),
              "min_cosine_vs_transformers": round(cosine.min().item(), 7),
              "ours_tok_per_s": [round(r, 1) for r in rates["ours"]],
              "transformers_tok_per_s": [round(r, 1) for r in rates["transformers"]],
              "ours_over_transformers": [round(r, 3) for r in ratios],
              "ours_over_transformers_median": round(statistics.median(ratios), 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embed_speed.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
