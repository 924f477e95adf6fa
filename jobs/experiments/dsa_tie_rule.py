"""How the DSA indexer's tie rule decides GLM-5 greedy tokens: ours against `transformers`, and each
against itself (cached decode vs one uncached forward over the same text).

Tiny random GLM-5 models (tests/model_factory.py) with two index heads and index_topk 6, below most
prompt lengths: with two heads, many keys score exactly 0 after the indexer's ReLU, so the top-k is
decided among ties. For each seed, five prompts of 5-30 tokens, 24 greedy tokens each; counted per row:
ours equal to `transformers`' greedy (plain `topk`, and with ties in key order), and whether
`transformers`' and our own greedy tokens are the argmax of the same model's teacher-forced logits
over prompt + tokens. `--plain-topk` runs ours with `torch.topk`'s own tie choice (the rule before
ties were taken in key order).

    python jobs/experiments/dsa_tie_rule.py --out DIR [--seeds 4] [--plain-topk]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def _plain_top_keys(index: torch.Tensor, k: int) -> torch.Tensor:
    best = index.topk(k, dim=-1).indices
    return torch.zeros(index.shape, dtype=torch.bool, device=index.device).scatter_(-1, best, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--plain-topk", action="store_true")
    args = parser.parse_args()
    from model_factory import build
    from parity_support import cpu_engine, hf_greedy, prompts, stable_topk

    from flashx_batch import SamplingParams
    from flashx_batch.models import mla

    if args.plain_topk:
        mla.top_keys = _plain_top_keys
    args.out.mkdir(parents=True, exist_ok=True)
    counts = dict(rows=0, ours_eq_hf_plain=0, ours_eq_hf_key_order=0, hf_plain_self_consistent=0,
                  hf_key_order_self_consistent=0, ours_self_consistent=0)
    for seed in range(args.seeds):
        model_dir = args.out / "models" / f"glm5_seed{seed}"
        hf = build("glm_moe_dsa", model_dir, seed=seed, index_n_heads=2, index_topk=6)
        engine = cpu_engine(model_dir)
        rows = prompts(seed + 10, (5, 17, 9, 30, 12))
        outs = engine.generate(rows, SamplingParams(max_new_tokens=24, ignore_eos=True))
        for prompt, out in zip(rows, outs):
            counts["rows"] += 1
            ours = out.token_ids
            scored = engine.score([prompt + ours])[0]
            counts["ours_self_consistent"] += scored[len(prompt) - 1 : -1].argmax(-1).tolist() == ours
            for name, block in (("plain", None), ("key_order", stable_topk)):
                with block() if block else torch.no_grad():
                    greedy = hf_greedy(hf, prompt, 24)
                    with torch.no_grad():
                        logits = hf(torch.tensor([prompt + greedy])).logits[0]
                counts[f"ours_eq_hf_{name}"] += greedy == ours
                counts[f"hf_{name}_self_consistent"] += logits[len(prompt) - 1 : -1].argmax(-1).tolist() == greedy
    result = {"tie_rule": "torch.topk" if args.plain_topk else "key order (models.mla.top_keys)", **counts}
    (args.out / "dsa_tie_rule.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
