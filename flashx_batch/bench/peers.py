"""Ours against the engines a user would pick instead, side by side in one process: CTranslate2.

    python -m flashx_batch.bench.peers --out results/peers [--model PATH | --random-wide] [--threads 1,2]
        [--repeats 3] [--quick] [--batch 8]

CTranslate2 is an optional benchmark extra (`pip install ctranslate2`), never a dependency. The same
checkpoint is converted with its own converter (`TransformersConverter`), float32 and int8
(`int8_float32`: int8 weights and activations, float32 elsewhere), and compared with ours in the same
precision class: float32 with float32, our int8 (`int8_dynamic`, every linear layer) with its int8.
Workloads: W1 (mixed intake) and W2 (equal lengths) from `bench.workloads`, token-id prompts, each row
its own number of greedy tokens with EOS ignored. Each engine batches its own way with at most
`--batch` rows at once: ours one `generate` call over the workload; CTranslate2 `generate_batch` over
chunks of `--batch` rows sorted by prompt length (what its own `max_batch_size` does), each row stopped
at its length by the step callback. Both run interleaved `--repeats` times per thread count (rotating
who goes first); the ratio is ours ÷ peer in useful output tokens/s, median of the paired repeats.
Token agreement at float32 (rows whose greedy tokens are identical) is checked on every run.
llama.cpp (`llama-cpp-python`, built from source) is not wired in yet: asking for it is an error.
Writes OUT/peers.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.workloads import FULL, QUICK, Workload, equal_lengths, mixed_intake
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.bench.peers")
PEERS = ("ctranslate2",)


class CT2:
    """One CTranslate2 generator over a converted copy of the checkpoint."""

    def __init__(self, model_dir: Path, work: Path, quantization: str, threads: int) -> None:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
        from tokenizers import Tokenizer

        out = work / f"ct2-{quantization}"
        if not out.exists():
            TransformersConverter(str(model_dir)).convert(str(out), quantization=quantization, force=True)
        self.generator = ctranslate2.Generator(str(out), device="cpu", compute_type=quantization,
                                               intra_threads=threads, inter_threads=1)
        self.vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def generate(self, workload: Workload, batch: int) -> list[list[int]]:
        """Each row's greedy tokens, exactly its own count, in input order."""
        order = sorted(range(workload.rows), key=lambda i: -len(workload.prompts[i]))
        out: list[list[int]] = [[] for _ in range(workload.rows)]
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            tokens = [[self.vocab.id_to_token(t) for t in workload.prompts[i]] for i in rows]
            # the shortest prompt of a batch is forwarded at once; a longer one's extra tokens are fed through
            # the decoding loop first, and its steps count them: stop each row after its own new tokens
            shortest = min(map(len, tokens))
            stop = [workload.max_new_tokens[i] + len(t) - shortest for i, t in zip(rows, tokens, strict=True)]
            # rows that all stop together need no per-token callback (its Python call costs CTranslate2 ~5 %)
            callback = None if len(set(stop)) == 1 else (lambda step, stop=stop: step.step + 1 >= stop[step.batch_id])
            results = self.generator.generate_batch(
                tokens, max_length=max(stop), sampling_topk=1, include_prompt_in_result=False, end_token=[],
                callback=callback)
            for i, result in zip(rows, results, strict=True):
                out[i] = list(result.sequences_ids[0])[: workload.max_new_tokens[i]]
        return out


def _ours(engine: Engine, workload: Workload) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
    return [o.token_ids for o in engine.generate(workload.prompts, params)]


def _timed(fn) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def compare(model_dir: Path, threads: int, batch: int, repeats: int, quick: bool, work: Path) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sizes = QUICK if quick else FULL
    workloads = [mixed_intake(sizes, vocab, 0), equal_lengths(sizes, vocab, 0)]
    longest = max(w.max_prompt_len for w in workloads)
    most = max(w.max_output_len for w in workloads)
    common = dict(backend="cpu", dtype="float32", max_batch_size=batch, max_input_len=longest, max_output_len=most,
                  num_threads=threads)
    ours = {"float32": Engine.from_pretrained(model_dir, **common), "int8": Engine.from_pretrained(model_dir, **common)}
    quantize_all(ours["int8"])
    peer = {"float32": CT2(model_dir, work, "float32", threads), "int8": CT2(model_dir, work, "int8_float32", threads)}
    result: dict = {}
    for w in workloads:
        for precision in ("float32", "int8"):
            mine, theirs = ours[precision], peer[precision]
            _ours(mine, w), theirs.generate(w, batch)  # warm-up
            pairs, agree = [], None
            for r in range(repeats):
                runs = [("ours", lambda m=mine, w=w: _ours(m, w)),
                        ("ctranslate2", lambda t=theirs, w=w: t.generate(w, batch))]
                times = {}
                for name, fn in (runs if r % 2 == 0 else runs[::-1]):
                    times[name], tokens = _timed(fn)
                    if name == "ours":
                        ours_tokens = tokens
                    else:
                        ct2_tokens = tokens
                pairs.append(times["ctranslate2"] / times["ours"])  # ours ÷ peer in tokens/s
                if precision == "float32":
                    agree = sum(a == b for a, b in zip(ours_tokens, ct2_tokens, strict=True))
            key = f"{w.name}/{precision}"
            result[key] = {"ratio_ours_over_ctranslate2": statistics.median(pairs), "pairs": pairs,
                           "output_tokens": w.output_tokens, "rows": w.rows}
            if agree is not None:
                result[key]["float32_rows_identical"] = f"{agree}/{w.rows}"
            log.info("%d thread(s) %s: ours ÷ CTranslate2 %.2f (%s)", threads, key, result[key]
                     ["ratio_ours_over_ctranslate2"], result[key].get("float32_rows_identical", "int8"))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/peers"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--random-wide", action="store_true",
                        help="a random Llama of the 27 M shape (512 wide, 8 layers) with the bundled tokenizer's "
                             "4,096-token vocabulary (24 M parameters): speed on a wider model")
    parser.add_argument("--peers", default="ctranslate2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the small workload sizes (bench --quick's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    unknown = [p for p in args.peers.split(",") if p not in PEERS]
    if unknown:
        raise SystemExit(f"--peers {','.join(unknown)}: not wired in; available: {', '.join(PEERS)}")
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise SystemExit("CTranslate2 is an optional benchmark extra: pip install ctranslate2") from None
    work = Path(tempfile.mkdtemp(prefix="flashx-peers-"))
    try:
        model = args.model or bundled_model_dir()  # a directory with tokenizer.json (CTranslate2's vocabulary)
        if args.random_wide:
            from flashx_batch.bench.models import LLAMA_27M, random_llama_with_bundled_tokenizer

            model = random_llama_with_bundled_tokenizer({**LLAMA_27M, "vocab_size": 4096}, work / "llama-wide")
        result = {"model": "random-wide (LLAMA_27M shape, vocab 4096)" if args.random_wide else str(model),
                  "batch": args.batch,
                  "workloads": "quick" if args.quick else "full", "threads": {}}
        for n in [int(t) for t in args.threads.split(",")]:
            result["threads"][n] = compare(model, n, args.batch, args.repeats, args.quick, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
