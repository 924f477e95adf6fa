"""Time one latent-attention decode step both ways, absorbed and expanded, on DeepSeek-V3's per-head
shapes (rank 512 + 64 rotary, 128 + 128 per head), side by side in one process.

    python jobs/experiments/mla_decode_forms.py [--heads 16] [--rows 8] [--context 1024] [--dtype float32] \
        [--out F.json]

Prints (and writes) the median seconds of each form and expanded ÷ absorbed: above 1, the absorbed form
the runtime uses for decode steps is the faster one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flashx_batch.models.config import ModelConfig
from flashx_batch.models.mla import IndexerChoice, MLAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256, "hidden_size": 1024, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": args.heads, "kv_lora_rank": 512, "q_lora_rank": 256,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 0,
           "num_experts_per_tok": 1, "moe_intermediate_size": 64}
    cfg = ModelConfig.from_hf(raw)
    attn = MLAttention(cfg, 0, dtype, torch.device("cpu"), IndexerChoice())
    for p in attn.parameters():
        p.data.normal_(0, 0.02)
    q_nope = torch.randn(args.rows, 1, args.heads, 128, dtype=dtype)
    q_rot = torch.randn(args.rows, 1, args.heads, 64, dtype=dtype)
    keys = torch.randn(args.rows, args.context, 576, dtype=dtype)
    mask = torch.zeros(args.rows, 1, 1, args.context, dtype=dtype)
    times: dict[str, list[float]] = {"absorbed": [], "expanded": []}
    with torch.inference_mode():
        for i in range(args.repeats + 2):
            for name in (("absorbed", "expanded") if i % 2 else ("expanded", "absorbed")):
                form = attn._absorbed if name == "absorbed" else attn._expanded
                start = time.perf_counter()
                form(q_nope, q_rot, keys, mask)
                if i >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(t) for name, t in times.items()}
    result.update(ratio_expanded_over_absorbed=result["expanded"] / result["absorbed"], heads=args.heads,
                  rows=args.rows, context=args.context, dtype=args.dtype, threads=torch.get_num_threads())
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
