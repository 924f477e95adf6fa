"""Engine-vs-transformers benchmark: our `Engine` vs `transformers` `generate`, equal-length batch, same process.

    python -m flashx_batch.bench.runtime_vs_hf --out results/runtime [--repeats 5]

Workload: B=8 prompts of 256 random tokens, 64 new tokens each (EOS ignored), greedy, float32 on
CPU. Both sides are loaded and warmed up first; then the two run interleaved `repeats` times and
the median of each gives the ratio. Writes `OUT/runtime_vs_hf.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.models import LLAMA_27M, parameter_count, random_llama
from flashx_batch.bench.timing import seconds
from flashx_batch.bench.variants import hf_greedy
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger(__name__)


def compare(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(model_dir, backend="cpu", dtype="float32", max_batch_size=batch,
                                    max_input_len=prompt_len, max_output_len=new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = engine.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def ours():
        return engine.generate(prompts.tolist(), params)

    def theirs():
        return hf_greedy(hf, prompts, torch.ones_like(prompts), new_tokens, pad_id=0)

    same = [o.token_ids for o in ours()] == theirs()[:, prompt_len:].tolist()  # warm-up + correctness gate
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(repeats):
        times["ours"].append(seconds(ours))
        times["transformers"].append(seconds(theirs))
    tokens = batch * new_tokens
    tok_s = {k: tokens / statistics.median(v) for k, v in times.items()}
    return {
        "model": str(model_dir), "parameters": parameter_count(model_dir), "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats, "greedy_tokens_identical": same,
        "output_tok_per_s": tok_s, "seconds": times,
        "ratio_ours_over_transformers": tok_s["ours"] / tok_s["transformers"],
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/runtime"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, action="append", help="extra model directories to include")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    models = {"bundled legal-tiny": bundled_model_dir(), "random llama 27M": random_llama(LLAMA_27M)}
    for extra in args.model or []:
        models[extra.name] = extra
    results = {name: compare(path, 8, 256, 64, args.repeats) for name, path in models.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime_vs_hf.json").write_text(json.dumps(results, indent=2))
    for name, r in results.items():
        log.info("%s: ours %.1f tok/s, transformers %.1f tok/s, ratio %.2f (identical greedy: %s)", name,
                 r["output_tok_per_s"]["ours"], r["output_tok_per_s"]["transformers"],
                 r["ratio_ours_over_transformers"], r["greedy_tokens_identical"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
