"""int8 on CPU: every linear layer in int8 (weights per channel, activations quantized per call,
the x86 int8 GEMM) against float32 — quality and speed side by side in one process.

    python -m flashx_batch.bench.int8_cpu --out results/int8_cpu [--model PATH | --random-27m | --moe MODEL]
        [--threads 1,2] [--keep lm_head]
        [--windows 64] [--window-len 256] [--batch 8] [--prompt-len 256] [--new-tokens 64] [--repeats 3]

Quality (teacher-forced on `--windows` held-out windows of `--window-len` tokens): perplexity of
each model, ΔPPL = ppl_int8 / ppl_fp32 - 1, and top-1 agreement (the share of positions where both
models' most likely next token is the same). A mixture-of-experts model's stacked experts are int8
too (`quant.int8_experts`; routers stay float32). Speed: `--batch` held-out prompts of `--prompt-len`
tokens, `--new-tokens` greedy tokens each (EOS ignored), both engines interleaved `--repeats` times
per thread count; prefill and decode tokens/s from `generate`'s own stats, medians, and each ratio
int8 ÷ float32. Writes OUT/int8_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.models import MOE_SHAPES
from flashx_batch.quality.heldout import token_windows
from flashx_batch.quant.int8_experts import Int8Experts
from flashx_batch.quant.linear import QuantLinear
from flashx_batch.quant.precision_map import loaded_summary
from flashx_batch.quant.units import FormatSwap, model_units
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.bench.int8_cpu")


def quantize_all(engine: Engine, keep: tuple[str, ...] = ()) -> dict:
    """Every linear unit of the engine's model to int8 with the kernels the engine would pick, but
    those whose name contains one of `keep` (e.g. "lm_head")."""
    model = engine.runner.model
    units = {u.name: "int8" for u in model_units(model) if not any(k in u.name for k in keep)}
    FormatSwap(model, units, 64).originals.clear()
    return loaded_summary(model)


def quality(ref: Engine, q: Engine, windows: list[list[int]]) -> dict:
    nll_ref = nll_q = 0.0
    agree = count = 0
    for start in range(0, len(windows), 8):
        batch = windows[start : start + 8]
        for w, a, b in zip(batch, ref.score(batch), q.score(batch), strict=True):
            targets = torch.tensor(w[1:])
            la, lb = a[:-1].log_softmax(-1), b[:-1].log_softmax(-1)
            nll_ref -= la.gather(1, targets[:, None]).sum().item()
            nll_q -= lb.gather(1, targets[:, None]).sum().item()
            agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
            count += len(targets)
    ppl_ref, ppl_q = math.exp(nll_ref / count), math.exp(nll_q / count)
    return {"tokens": count, "ppl_fp32": ppl_ref, "ppl_int8": ppl_q, "delta_ppl": ppl_q / ppl_ref - 1,
            "top1_agreement": agree / count}


def speed(engines: dict[str, Engine], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for e in engines.values():
        e.generate(prompts[:2], params)  # warm-up
    rates: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in engines}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            outs = engines[name].generate(prompts, params)
            s = engines[name].last_stats
            rates[name]["prefill"].append(sum(map(len, prompts)) / s.prefill_s)
            rates[name]["decode"].append((s.output_tokens - s.rows) / s.decode_s)
            tokens[name] = [o.token_ids for o in outs]
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rates.items()}
    same = sum(a == b for a, b in zip(tokens["fp32"], tokens["int8"], strict=True))
    return {"tok_per_s": med, "ratio_prefill": med["int8"]["prefill"] / med["fp32"]["prefill"],
            "ratio_decode": med["int8"]["decode"] / med["fp32"]["decode"],
            "greedy_rows_identical": f"{same}/{len(prompts)}"}


def run(model_dir: Path, threads: list[int], windows: int, window_len: int, batch: int, prompt_len: int,
        new_tokens: int, repeats: int, keep: tuple[str, ...] = ()) -> dict:
    common = dict(backend="cpu", dtype="float32", max_batch_size=batch, max_input_len=max(window_len, prompt_len),
                  max_output_len=new_tokens)
    result: dict = {"model": str(model_dir), "kept_in_float32": list(keep), "threads": {}}
    for n in threads:
        ref = Engine.from_pretrained(model_dir, num_threads=n, **common)
        q = Engine.from_pretrained(model_dir, num_threads=n, **common)
        summary = quantize_all(q, keep)
        kernels = {m.kernel for m in q.runner.model.modules() if isinstance(m, (QuantLinear, Int8Experts))}
        if "quality" not in result:
            result["kernels"], result["weight_bytes"] = sorted(kernels), {
                "int8": summary["weight_bytes"], "fp32": loaded_summary(ref.runner.model)["weight_bytes"]}
            result["quality"] = quality(ref, q, token_windows(ref.tokenizer, window_len, windows))
            log.info("quality: %s", result["quality"])
        prompts = token_windows(ref.tokenizer, prompt_len, batch)
        result["threads"][n] = speed({"fp32": ref, "int8": q}, prompts, new_tokens, repeats)
        log.info("%d thread(s): %s", n, result["threads"][n])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/int8_cpu"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--random-27m", action="store_true",
                        help="a random 27 M Llama (bench.models.LLAMA_27M) with the bundled tokenizer: speed on a "
                             "wider model (its quality figures are those of random weights)")
    parser.add_argument("--moe", default=None, choices=["upcycled", "qwen3-moe", *MOE_SHAPES],
                        help="int8 experts against float32 ones on a mixture of experts: `upcycled`, the bundled "
                             "model's trained weights as an 8-expert top-2 Mixtral (bench.models."
                             "upcycled_bundled_moe); or a random Qwen3-MoE of this shape with the bundled tokenizer "
                             "(quality figures of random weights)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", default="", help="comma-separated unit names (substrings) left in float32, "
                        "e.g. lm_head")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = args.model or bundled_model_dir()
    if args.random_27m:
        from flashx_batch.bench.models import LLAMA_27M, random_llama_with_bundled_tokenizer

        model = random_llama_with_bundled_tokenizer(LLAMA_27M)
    if args.moe == "upcycled":
        from flashx_batch.bench.models import upcycled_bundled_moe

        model = upcycled_bundled_moe()
    elif args.moe:
        from flashx_batch.bench.models import QWEN3_MOE_78M, random_qwen3_moe_with_bundled_tokenizer

        model = random_qwen3_moe_with_bundled_tokenizer(MOE_SHAPES.get(args.moe, QWEN3_MOE_78M))
    result = run(model, [int(t) for t in args.threads.split(",")], args.windows,
                 args.window_len, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                 tuple(k for k in args.keep.split(",") if k))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
