"""Ours against the engines a user would pick instead, side by side in one process: CTranslate2 and llama.cpp.

    python -m flashx_batch.bench.peers --out results/peers [--model PATH | --shape NAME]
        [--peers ctranslate2,llama_cpp] [--threads 1,2] [--repeats 3] [--quick] [--batch 8]

Both peers are optional benchmark extras, never dependencies: `pip install ctranslate2`; `pip install
llama-cpp-python` plus a llama.cpp source tree for its converter (`bench.peer_llama_cpp`). The same
checkpoint is converted with each peer's own converter and compared with ours in the same precision
class: float32 with float32; our int8 (`int8_dynamic`: int8 weights, activations quantized to int8 per
row, every linear layer) with CTranslate2's `int8_float32` and llama.cpp's `q8_0`. Workloads: W1 (mixed
intake) and W2 (equal lengths) from `bench.workloads`, token-id prompts, each row its own number of
greedy tokens with EOS ignored. Each engine batches its own way with at most `--batch` rows at once:
ours one `generate` call over the workload; CTranslate2 `generate_batch` over chunks of `--batch` rows
sorted by prompt length (what its own `max_batch_size` does), each row stopped at its length by the
step callback; llama.cpp a continuous-batching loop on its low-level API (a finished row's sequence
freed, the next prompt decoded with the live rows' next tokens). All run interleaved `--repeats` times
per thread count (rotating who goes first); the ratio is ours ÷ peer in useful output tokens/s, median
of the paired repeats. Token agreement at float32 (rows whose greedy tokens are identical) is checked on
every run. Writes OUT/peers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.models import (
    LLAMA_27M,
    LLAMA_134M,
    QWEN3_MOE_64X8,
    QWEN3_MOE_78M,
    parameter_count,
    random_llama_with_bundled_tokenizer,
    random_qwen3_moe_with_bundled_tokenizer,
)
from flashx_batch.bench.roofline import Machine, ModelCost, floor_seconds, measure_int8_matmul, measure_machine
from flashx_batch.bench.variants import prefix_reuse_options
from flashx_batch.bench.workloads import FULL, QUICK, Workload, equal_lengths, few_shot, mixed_intake
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.options import bundled_model_dir

if TYPE_CHECKING:
    from flashx_batch.bench.peer_llama_cpp import LlamaCpp

log = logging.getLogger("flashx_batch.bench.peers")
PEERS = ("ctranslate2", "llama_cpp")
# random models to compare on besides a checkpoint: how to build one, and what it is
SHAPES = {
    "llama-27m": (lambda out: random_llama_with_bundled_tokenizer(LLAMA_27M, out),
                  "Llama, 512 wide, 8 layers, vocab 8 K, 27 M"),
    "llama-134m": (lambda out: random_llama_with_bundled_tokenizer(LLAMA_134M, out),
                   "Llama, 768 wide, 12 layers, vocab 32 K, 134 M"),
    "qwen3-moe": (lambda out: random_qwen3_moe_with_bundled_tokenizer(QWEN3_MOE_78M, out),
                  "Qwen3-MoE, 8 experts top-2 in 6 layers, 512 wide, vocab 32 K, 78 M (35 M active)"),
    "qwen3-moe-64x8": (lambda out: random_qwen3_moe_with_bundled_tokenizer(QWEN3_MOE_64X8, out),
                       "Qwen3-MoE, 64 experts top-8 in 4 layers, 256 wide, vocab 8 K, 53 M (9 M active)"),
}


class PeerUnsupported(RuntimeError):
    """A peer that cannot run this checkpoint at all (no converter for its architecture)."""


class CT2:
    """One CTranslate2 generator over a converted copy of the checkpoint."""

    def __init__(self, model_dir: Path, work: Path, quantization: str, threads: int) -> None:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
        from ctranslate2.converters.transformers import _MODEL_LOADERS
        from tokenizers import Tokenizer
        from transformers import AutoConfig

        config = type(AutoConfig.from_pretrained(model_dir)).__name__
        if config not in _MODEL_LOADERS:  # its converter's own registry: refuse before converting anything
            raise PeerUnsupported(f"CTranslate2 {ctranslate2.__version__} has no converter for {config}")
        out = work / f"ct2-{quantization}"
        if not out.exists():
            TransformersConverter(str(model_dir)).convert(str(out), quantization=quantization, force=True)
        self.generator = ctranslate2.Generator(str(out), device="cpu", compute_type=quantization,
                                               intra_threads=threads, inter_threads=1)
        self.vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def close(self) -> None:
        del self.generator

    def generate(self, workload: Workload, batch: int) -> list[list[int]]:
        """Each row's greedy tokens, exactly its own count, in input order. Rows sharing a prefix
        (`Workload.shared_prefixes`, W3) go group by group with the prefix as CTranslate2's static prompt,
        whose model state it computes once and caches (`cache_static_prompt`); the rest in batches."""
        out: list[list[int]] = [[] for _ in range(workload.rows)]
        grouped = workload.shared_prefixes()
        in_group = {i for _, rows in grouped for i in rows}
        self._batches(workload, [i for i in range(workload.rows) if i not in in_group], batch, 0, out)
        for length, rows in grouped:
            self._batches(workload, rows, batch, length, out)
        return out

    def _batches(self, workload: Workload, rows: list[int], batch: int, prefix: int, out: list[list[int]]) -> None:
        order = sorted(rows, key=lambda i: -len(workload.prompts[i]))
        static = [self.vocab.id_to_token(t) for t in workload.prompts[rows[0]][:prefix]] if prefix and rows else None
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            tokens = [[self.vocab.id_to_token(t) for t in workload.prompts[i][prefix:]] for i in chunk]
            # the shortest prompt of a batch is forwarded at once; a longer one's extra tokens are fed through
            # the decoding loop first, and its steps count them: stop each row after its own new tokens
            shortest = min(map(len, tokens))
            stop = [workload.max_new_tokens[i] + len(t) - shortest for i, t in zip(chunk, tokens, strict=True)]
            # rows that all stop together need no per-token callback (its Python call costs CTranslate2 ~5 %)
            callback = None if len(set(stop)) == 1 else (lambda step, stop=stop: step.step + 1 >= stop[step.batch_id])
            results = self.generator.generate_batch(
                tokens, max_length=max(stop), sampling_topk=1, include_prompt_in_result=False, end_token=[],
                callback=callback, static_prompt=static)
            for i, result in zip(chunk, results, strict=True):
                out[i] = list(result.sequences_ids[0])[: workload.max_new_tokens[i]]


def _ours(engine: Engine, workload: Workload) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
    return [o.token_ids for o in engine.generate(workload.prompts, params)]


def _timed(fn) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _peer(name: str, model_dir: Path, work: Path, precision: str, threads: int, batch: int, longest: int,
          most: int) -> CT2 | LlamaCpp:
    """`name`'s engine for `precision`, taking prompts up to `longest` tokens and `most` new ones."""
    if name == "ctranslate2":
        return CT2(model_dir, work, {"float32": "float32", "int8": "int8_float32"}[precision], threads)
    from flashx_batch.bench.peer_llama_cpp import LlamaCpp

    return LlamaCpp(model_dir, work, precision, threads, batch, longest + most, longest)


def compare(model_dir: Path, threads: int, batch: int, repeats: int, quick: bool, work: Path,
            peers: list[str]) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sizes = QUICK if quick else FULL
    workloads = [mixed_intake(sizes, vocab, 0), equal_lengths(sizes, vocab, 0), few_shot(sizes, vocab, 0)]
    longest = max(w.max_prompt_len for w in workloads)
    most = max(w.max_output_len for w in workloads)
    common = dict(backend="cpu", dtype="float32", max_batch_size=batch, max_input_len=longest, max_output_len=most,
                  num_threads=threads)
    torch.set_num_threads(threads)
    machine = measure_machine("cpu")
    costs = roofline_costs(model_dir, machine)
    result: dict = {"machine": {"float32": costs["float32"][1].as_dict(),
                                "int8_gop_s": costs["int8"][1].matmul_gflop_s}}
    for precision in ("float32", "int8"):
        # ours as a user would run each workload: W3 (shared prefixes) with prefix reuse on, whose cache
        # region comes out of the same KV budget; the others without
        mine = {False: Engine.from_pretrained(model_dir, **common),
                True: Engine.from_pretrained(model_dir, **common, **prefix_reuse_options(longest))}
        if precision == "int8":
            try:
                for engine in mine.values():
                    quantize_all(engine)
            except ConfigError as exc:  # e.g. latent attention: its projections have no int8 units yet
                log.warning("int8 not compared: %s", exc)
                result.setdefault("skipped", {})["int8"] = f"ours: {exc}"
                continue
        others, skipped = {}, {}
        for name in peers:
            try:
                others[name] = _peer(name, model_dir, work, precision, threads, batch, longest, most)
            except PeerUnsupported as exc:
                log.warning("%s skipped: %s", name, exc)
                skipped[name] = str(exc)
        if skipped:
            result.setdefault("skipped", {}).update(skipped)
        try:
            _compare_precision(result, mine, others, workloads, precision, threads, batch, repeats, costs[precision])
        finally:
            for p in others.values():
                p.close()
    return result


def roofline_costs(model_dir: Path, machine: Machine) -> dict[str, tuple[ModelCost, Machine]]:
    """What a token costs and what the machine offers, per precision class: float32 weights and FLOP/s;
    int8 weights (a byte each) and int8 multiply-adds/s (`torch._int_mm`, 1024 cubed). The KV cache
    stays float32 in both."""
    cost = ModelCost.from_hf_dir(model_dir, parameter_count(model_dir), 4)
    int8 = dataclasses.replace(machine, matmul_gflop_s=measure_int8_matmul() / 1e9, matmul_dtype="int8")
    return {"float32": (cost, machine),
            "int8": (dataclasses.replace(cost, weight_bytes=cost.weight_bytes / 4), int8)}


def _compare_precision(result: dict, mine: dict[bool, Engine], others: dict, workloads: list[Workload],
                       precision: str, threads: int, batch: int, repeats: int,
                       roofline: tuple[ModelCost, Machine]) -> None:
    """Every workload, `repeats` paired runs of ours (`mine[shares prefixes]`) and each peer. A workload
    with shared prefixes (W3) gets freshly drawn prefixes for the warm-up and for each repeat (the
    same for every engine within one), so no engine's prefix cache carries over from an earlier run."""
    for w in workloads:
        sharing = bool(w.shared_prefixes())
        engine = mine[sharing]

        def runs_for(seed: int, engine: Engine = engine, w: Workload = w, sharing: bool = sharing) -> dict:
            run = w.with_fresh_prefixes(seed) if sharing else w
            fns = {"ours": lambda: _ours(engine, run)}
            fns.update({name: (lambda p=p: p.generate(run, batch)) for name, p in others.items()})
            return fns

        for fn in runs_for(-1).values():
            fn()  # warm-up
        pairs: dict[str, list[float]] = {name: [] for name in others}
        seconds: dict[str, list[float]] = {name: [] for name in ["ours", *others]}
        agree: dict[str, int] = {}
        for r in range(repeats):
            runs = runs_for(r)
            order = list(runs)
            order = order[r % len(order):] + order[: r % len(order)]  # who goes first rotates
            times, tokens = {}, {}
            for name in order:
                times[name], tokens[name] = _timed(runs[name])
                seconds[name].append(times[name])
            for name in others:
                pairs[name].append(times[name] / times["ours"])  # ours ÷ peer in tokens/s
                if precision == "float32":
                    same = sum(a == b for a, b in zip(tokens["ours"], tokens[name], strict=True))
                    agree[name] = min(agree.get(name, w.rows), same)  # the worst repeat
        key = f"{w.name}/{precision}"
        # the least time any static batcher of `batch` rows needs on this machine (`bench.roofline`):
        # each engine's fraction of it says how close to the hardware it runs
        floor = floor_seconds(w, batch, *roofline)["floor_s"]
        medians = {name: statistics.median(v) for name, v in seconds.items()}
        result[key] = {"output_tokens": w.output_tokens, "rows": w.rows, "seconds": medians, "floor_s": floor,
                       "roofline_fraction": {name: floor / t for name, t in medians.items()}}
        if sharing:
            result[key]["shared_prefixes"] = "ours: prefix reuse on; CTranslate2: static_prompt; llama.cpp: " \
                                             "prefix decoded once per group, copied to each row's sequence"
        for name in others:
            result[key][f"ratio_ours_over_{name}"] = statistics.median(pairs[name])
            result[key][f"pairs_{name}"] = pairs[name]
            if name in agree:
                result[key][f"float32_rows_identical_{name}"] = f"{agree[name]}/{w.rows}"
            same = f"{agree[name]}/{w.rows} rows identical" if name in agree else "int8: not compared"
            log.info("%d thread(s) %s: ours ÷ %s %.2f (%s)", threads, key, name,
                     result[key][f"ratio_ours_over_{name}"], same)


def check_installed(peers: list[str]) -> None:
    """A SystemExit naming the install step of any asked-for peer that is missing (before any work)."""
    if "ctranslate2" in peers:
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            raise SystemExit("CTranslate2 is an optional benchmark extra: pip install ctranslate2") from None
    if "llama_cpp" in peers:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise SystemExit("llama.cpp is an optional benchmark extra: pip install llama-cpp-python (builds from "
                             "source, ~14 minutes on 2 cores)") from None
        from flashx_batch.bench.peer_llama_cpp import converter_source

        converter_source()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/peers"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None,
                        help="a random Llama instead of --model: "
                        + "; ".join(f"{k}: {v[1]}" for k, v in SHAPES.items()))
    parser.add_argument("--peers", default="ctranslate2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the small workload sizes (bench --quick's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    peers = args.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"--peers {','.join(unknown)}: not wired in; available: {', '.join(PEERS)}")
    check_installed(peers)
    work = Path(tempfile.mkdtemp(prefix="flashx-peers-"))
    try:
        model = args.model or bundled_model_dir()  # a directory with tokenizer.json (CTranslate2's vocabulary)
        if args.shape:
            model = SHAPES[args.shape][0](work / args.shape)
        result = {"model": f"{args.shape} ({SHAPES[args.shape][1]})" if args.shape else str(model),
                  "peers": peers, "batch": args.batch,
                  "workloads": "quick" if args.quick else "full", "threads": {}}
        for n in [int(t) for t in args.threads.split(",")]:
            result["threads"][n] = compare(model, n, args.batch, args.repeats, args.quick, work, peers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
