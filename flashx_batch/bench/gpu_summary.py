"""The GPU check's headline figures in one small file: `OUT/summary.json`, from what `jobs/operations/gpu_check.sh`
left in OUT (the device tests' log, `gpu_protocol.json`, `kv_sparse/kv_sparse.json`).

    python -m flashx_batch.bench.gpu_summary OUT

A figure whose part did not run (or failed) is null, and `missing` says which part; nothing is filled in.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

FLOAT32_PARITY_TEST = "test_float32_on_gpu_matches_cpu"
GRAPHS_TEST = "test_decode_steps_from_cuda_graphs_give_the_eager_tokens"


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _test_outcome(log: str, name: str) -> bool | None:
    """True where every case of test `name` passed in a `pytest -rA` log, False where one failed, None if absent."""
    outcomes = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED)\S* \S*::{name}\b", log, flags=re.MULTILINE)
    if not outcomes or all(o == "SKIPPED" for o in outcomes):
        return None
    return all(o in ("PASSED", "SKIPPED") for o in outcomes)


def _median(node: dict | None, *keys: str) -> float | None:
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, dict):
        node = node.get("median")
    return node if isinstance(node, (int, float)) else None


def summarize(out: Path) -> dict:
    protocol = _json(out / "gpu_protocol.json")
    sparse = _json(out / "kv_sparse" / "kv_sparse.json")
    try:
        tests_log = (out / "device_tests.txt").read_text()
    except OSError:
        tests_log = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    steps = (protocol or {}).get("decode_steps") or {}
    w1, w2 = (protocol or {}).get("W1"), (protocol or {}).get("W2")
    summary = {
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "device": ((protocol or {}).get("machine") or {}).get("device"),
        "decode_b1_fraction_of_bound": _median(steps, "1", "ours_fraction_of_bound"),
        "decode_b256_fraction_of_bound": _median(steps, "256", "ours_fraction_of_bound"),
        "w1_ratio_vs_transformers": _median(w1, "ratio_ours_bucketed_over_transformers_arrival"),
        "w2_output_tok_s": _median(w2, "output_tok_per_s", "ours_bucketed"),
        "w2_batch_size": (w2 or {}).get("batch_size"),
        "w1_extents_over_stripes": _median((protocol or {}).get("W1_layouts"), "ratio_extents_over_stripes"),
        "kv_sparse_ratio_fixed_budget": _median(sparse, "ratio_output_tok_per_s_paired"),
        "kv_sparse_ratio_rows": (sparse or {}).get("ratio_admitted_rows"),
        "tokens_match_cpu_float32": _test_outcome(tests_log, FLOAT32_PARITY_TEST),
        "graph_tokens_match_eager": _test_outcome(tests_log, GRAPHS_TEST),
    }
    parts = {"device tests": tests_log or None, "gpu protocol": protocol, "kv_sparse": sparse}
    summary["missing"] = [name for name, found in parts.items() if not found]
    summary["errors"] = (protocol or {}).get("errors")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(args[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
