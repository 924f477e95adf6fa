"""Count the distinct kinds of failure the preflight fuzz finds, without stopping at the first.

    python jobs/measurements/fuzz_failure_kinds.py --examples 2000 --seed 0

The test (`tests/unit/test_fuzz_preflight.py`) stops at its first failing example; this runs the same
strategies and the same `check_case` over many examples and groups the failures by kind: for a crash,
the exception type and the innermost flashx_batch frame; for a property, which one broke. It prints
one line per kind with its count, then one example per kind: the smallest seen, shrunk further by
dropping files, settings, decoys, lines and columns while the kind stays the same (--shrink-s per kind).

The flashx_batch measured is the one Python imports (set PYTHONPATH to measure another checkout); that
checkout's tests/batch_support.py is used when it has one; the strategies always come from the test
module next to this script, so the strategies live in one place.

Besides the test's properties it reports "extra" kinds (off with --no-extra): what a dry run accepted
that the real run could not write or use (ids past int64 or not UTF-8, passthrough columns named like
output columns or holding unwritable values, non-finite or negative settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa


def _candidates(case: Any, rows_free: bool) -> Iterator[Any]:
    """Smaller variants of `case`, the biggest cuts first."""
    rep = dataclasses.replace
    if case.layout != "file" and len(case.files) > 1:
        for i in range(len(case.files)):
            yield rep(case, files=case.files[:i] + case.files[i + 1:])
    if case.layout != "file" and len(case.files) == 1 and not case.decoys:
        yield rep(case, layout="file")
    for i in range(len(case.settings)):
        yield rep(case, settings=case.settings[:i] + case.settings[i + 1:])
    for i in range(len(case.decoys)):
        yield rep(case, decoys=case.decoys[:i] + case.decoys[i + 1:])
    if not rows_free:  # the ids of each file must stay right: rows go only with their file
        return
    for fi, f in enumerate(case.files):
        def with_file(new: Any, fi: int = fi) -> Any:
            return rep(case, files=case.files[:fi] + [new] + case.files[fi + 1:])

        if isinstance(f.content, bytes):
            lines = f.content.split(b"\n")
            first = 1 if f.fmt == "csv" else 0  # keep the CSV header
            for li in range(first, len(lines)):
                yield with_file(rep(f, content=b"\n".join(lines[:li] + lines[li + 1:])))
        else:
            n = len(f.content[0][1]) if f.content else 0
            for ri in range(n):
                keep = pa.array([j for j in range(n) if j != ri], pa.int64())
                yield with_file(rep(f, content=[(c, a.take(keep)) for c, a in f.content]))
            for ci in range(len(f.content)):
                yield with_file(rep(f, content=f.content[:ci] + f.content[ci + 1:]))


def shrink(fuzz: Any, model: Path, case: Any, kind: str, budget_s: float) -> tuple[Any, str]:
    """Greedy: keep any smaller variant that still fails with the same kind, until none does or time is up."""
    # a failure of the id properties depends on the ids a file holds, which cutting lines would change
    rows_free = not kind.startswith("exit 0 but") or kind in EXTRA_ID_KINDS
    deadline = time.monotonic() + budget_s
    detail = ""
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _candidates(case, rows_free):
            if time.monotonic() >= deadline:
                break
            found = fuzz.check_case(model, cand, extra_checks=True)
            if found is not None and found.kind == kind:
                case, detail, improved = cand, found.detail, True
                break
    return case, detail


EXTRA_ID_KINDS = ("exit 0 but an id cannot be written as int64", "exit 0 but an id cannot be written as string",
                  "exit 0 but a passthrough column cannot be written")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-extra", action="store_true", help="only the test's properties")
    ap.add_argument("--shrink-s", type=float, default=30.0, help="seconds to shrink each kind's example (0: off)")
    args = ap.parse_args()

    import flashx_batch

    here = Path(__file__).resolve().parents[2] / "tests"
    code_tests = Path(flashx_batch.__file__).resolve().parents[1] / "tests"
    support = code_tests if (code_tests / "batch_support.py").is_file() else here
    sys.path[:0] = [str(support), str(here / "unit")]
    import batch_support
    import test_fuzz_preflight as fuzz
    from hypothesis import HealthCheck, Phase, given, seed, settings

    print(f"flashx_batch: {flashx_batch.__file__}\nbatch_support: {batch_support.__file__}\n"
          f"strategies: {fuzz.__file__}\nexamples: {args.examples}, seed: {args.seed}\n")
    model = batch_support.tiny_model_dir()
    kinds: dict[str, dict] = {}
    outcomes: Counter = Counter()
    seen = [0]

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz.cases())
    def explore(case: fuzz.Case) -> None:
        seen[0] += 1
        try:
            finding = fuzz.check_case(model, case, extra_checks=not args.no_extra, outcomes=outcomes)
        except Exception as exc:  # the harness itself: reported, never a reason to stop
            finding = fuzz.Finding(f"harness error: {type(exc).__name__}", repr(exc))
        if finding is None:
            return
        k = kinds.setdefault(finding.kind, {"count": 0, "size": None, "case": None, "detail": "",
                                            "extra": finding.extra})
        k["count"] += 1
        if k["size"] is None or case.size() < k["size"]:
            k.update(size=case.size(), case=case, detail=finding.detail)

    start = time.monotonic()
    explore()
    wall = time.monotonic() - start
    print(f"ran {seen[0]} examples in {wall:.0f} s; outcomes: "
          + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())))
    if args.shrink_s > 0:
        for kind, v in kinds.items():
            if not kind.startswith("harness error"):
                case, detail = shrink(fuzz, model, v["case"], kind, args.shrink_s)
                v.update(case=case, detail=detail or v["detail"])
    for extra in (False, True):
        rows = sorted(((k, v) for k, v in kinds.items() if v["extra"] == extra), key=lambda kv: -kv[1]["count"])
        title = "extra (accepted by the dry run, unusable by a real run)" if extra else "property failures"
        print(f"\n== {title}: {len(rows)} distinct kind(s), {sum(v['count'] for _, v in rows)} example(s)")
        for kind, v in rows:
            print(f"{v['count']:6d}  {kind}")
        for kind, v in rows:
            print(f"\n--- {kind} ({v['count']}x); a small example:\n{v['case']!r}\n{v['detail'].rstrip()}")


if __name__ == "__main__":
    main()
