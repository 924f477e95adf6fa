"""Mixed-adapter throughput: one `generate` call whose rows cycle through `--adapters` LoRA adapters (PEFT
format, rank `--rank`, on every projection or the attention ones: `--targets`), ÷ the same call with every row
on the base model, on one engine (the adapters loaded either way). The model is the bundled one, or a random
Llama of `--hidden` width; the prompts are the bundled sample's first `--rows` (cut to `--max-input` tokens),
greedy, `--new-tokens` each; the two alternated `--repeats` times, generated tokens per second each, the
per-pair ratios and their median.

    python jobs/measurements/lora_speed.py --out docs/results/lora_speed [--hidden 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "attention": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def base_model(root: Path, hidden: int | None):
    """The bundled model (None), or a random Llama `hidden` wide with the bundled tokenizer, saved under root."""
    import shutil

    import transformers as tf

    from flashx_batch.runtime.options import bundled_model_dir

    bundled = bundled_model_dir()
    if hidden is None:
        return bundled, tf.AutoModelForCausalLM.from_pretrained(bundled, dtype=torch.float32)
    config = tf.AutoConfig.from_pretrained(bundled)
    config.hidden_size, config.intermediate_size = hidden, hidden * 11 // 4
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = hidden // 64, hidden // 128, 64
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    out = root / "base"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(bundled / name, out / name)
    return out, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--hidden", type=int, default=None, help="a random Llama this wide, not the bundled one")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    from flashx_batch import Engine
    from flashx_batch.runtime.params import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="lora_speed_"))
    model_dir, model = base_model(root, args.hidden)
    names = [f"adapter{i}" for i in range(args.adapters)]
    for seed, name in enumerate(names, start=1):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights=False,
                                                      target_modules=TARGETS[args.targets]), adapter_name=name)
        peft_model.save_pretrained(root / "adapters", selected_adapters=[name])
        model = peft_model.unload()
    engine = Engine.from_pretrained(model_dir, lora_adapters={n: root / "adapters" / n for n in names},
                                    max_batch_size=args.batch, max_input_len=args.max_input,
                                    max_output_len=args.new_tokens, long_input="truncate")
    texts = [r["prompt"] for r in pq.read_table(REPO / "flashx_batch" / "assets" / "data" / "legal_docs.parquet")
             .to_pylist()][: args.rows]
    prompts = [engine.encode(t)[-args.max_input :] for t in texts]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    mixed = [names[i % len(names)] for i in range(len(prompts))]
    calls = {"base": lambda: engine.generate(prompts, params),
             "mixed": lambda: engine.generate(prompts, params, adapters=mixed)}
    for run in calls.values():  # warm
        run()
    rates: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.repeats):
        for name, run in calls.items():
            started = time.perf_counter()
            outs = run()
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started))
    ratios = [m / b for m, b in zip(rates["mixed"], rates["base"])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    config = engine.config
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(),
              "command": "python jobs/measurements/lora_speed.py " + " ".join(sys.argv[1:]),
              "model": f"{config.architecture} hidden {config.hidden_size}, {config.num_layers} layers",
              "adapters": args.adapters, "rank": args.rank, "targets": args.targets, "rows": len(prompts),
              "prompt_tokens": sum(map(len, prompts)), "new_tokens": args.new_tokens, "batch": args.batch,
              "torch_threads": torch.get_num_threads(),
              "base_tok_per_s": [round(r, 1) for r in rates["base"]],
              "mixed_tok_per_s": [round(r, 1) for r in rates["mixed"]],
              "mixed_over_base": [round(r, 3) for r in ratios],
              "mixed_over_base_median": round(statistics.median(ratios), 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    label = "bundled" if args.hidden is None else f"hidden{args.hidden}"
    (args.out / f"lora_speed_{label}_{args.targets}_r{args.rank}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
