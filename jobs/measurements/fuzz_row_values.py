"""Row values through the per-row readers, counting what each gives: parameters, a row error, or an
exception (which would end the job): sampling columns, OpenAI Batch lines and scoring columns. The values and
the line shape are the default suite's
(`tests/integration/test_bad_row_values.py`); this counts instead of asserting, so it runs on any
checkout: `PYTHONPATH=<checkout> python jobs/measurements/fuzz_row_values.py --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from row_value_cases import line as _line
    from row_value_cases import values as _values

    from flashx_batch.config import SAMPLING_COLUMN_KEYS, DataSection, SamplingSection
    from flashx_batch.data import openai_batch
    from flashx_batch.data.row_sampling import row_params
    from flashx_batch.data.validate import score_row

    values = _values(random.Random(0))
    keys = tuple(SAMPLING_COLUMN_KEYS)
    sampling = SamplingSection(from_columns={k: k for k in keys})
    data = DataSection(answer_column="answer", prompt_column="text")
    outcomes: Counter = Counter()
    for value in values:
        for key in keys:
            try:
                got = row_params(sampling, {k: [value if k == key else None] for k in keys}, 0, 7, 64)
                outcomes["sampling column: " + (got.code if hasattr(got, "code") else "parameters")] += 1
            except Exception as exc:  # what would end the job
                outcomes[f"sampling column: {type(exc).__name__}"] += 1
        for field in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "top_logprobs",
                      "prompt", "messages", "tools", "model", "stream"):
            for url in (openai_batch.CHAT, openai_batch.COMPLETIONS):
                try:
                    text = json.dumps(_line("x", url=url, **{field: value}))
                except ValueError:
                    continue
                try:
                    cols = openai_batch.parse("f.jsonl", text.encode("utf-8", errors="surrogatepass"))
                    outcomes["batch line: " + ("bad_request" if cols["request_error"][0] else "request")] += 1
                except Exception as exc:
                    outcomes[f"batch line: {type(exc).__name__}"] += 1
        for task, column in (("multiple_choice", "answer"), ("multiple_choice", "choices"),
                             ("multiple_choice", "context"), ("loglikelihood", "continuation"), ("perplexity", "text")):
            columns = {"context": ["the licence"], "continuation": [" is void"], "choices": [["a", "b"]],
                       "answer": [0], "text": ["the licence"], column: [value]}
            try:
                got = score_row(task, data, columns, 0)
                outcomes["score row: " + (got.code if hasattr(got, "code") else "row")] += 1
            except Exception as exc:
                outcomes[f"score row: {type(exc).__name__}"] += 1
    exceptions = sorted(k for k in outcomes if k.split(": ")[1][0].isupper())  # exception class names
    result = {"examples": sum(outcomes.values()), "outcomes": dict(sorted(outcomes.items())),
              "exception_kinds": exceptions}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuzz_row_values.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
