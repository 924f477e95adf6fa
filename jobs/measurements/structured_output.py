"""Structured output on the bundled model (never trained to write JSON), measured three ways:

1. extraction: the bundled legal sample's prompts repeated to `--rows` rows, each with its own schema from a
   `schema` column (10 distinct schemas: enums, integer ranges, arrays with item limits, nested objects,
   anyOf with null, string patterns, numbers, dates), plus rows constrained by a regex and by a choice list
   (`+sampling.from_columns={json_schema: schema, regex: pattern, choice: options}`), run as a job from the
   command line: how many rows finish, how many of those validate (`jsonschema`; `re.fullmatch`; membership),
   and how many grammars each actor compiled (the stats' `grammar_compiles`, summed per worker);
   then the same rows' first 100 through the Python API (`run_job(data=table)`) and as an OpenAI Batch file
   with `response_format` (json_schema, strict) — every finished row validated the same way;
2. cost: constrained ÷ free decoding, output tokens per second, on one engine with batch 8, the two runs
   alternated `--repeats` times (ignore_eos on both, so each generates the same number of tokens; the
   constrained rows' schema asks for more array items than the budget holds, so no row ends early).

    python jobs/measurements/structured_output.py --out docs/results/structured_output [--rows 1000]
    python jobs/measurements/structured_output.py --out docs/results/structured_output_cost --cost-only --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"kind": {"enum": ["licence", "notice", "warranty", "other"]}},
     "required": ["kind"], "additionalProperties": False},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1970, "maximum": 2030}},
     "required": ["year"], "additionalProperties": False},
    {"type": "object", "properties": {"holders": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["holders"], "additionalProperties": False},
    {"type": "object", "properties": {"grant": {"type": "object", "properties": {
        "copy": {"type": "boolean"}, "modify": {"type": "boolean"}, "sublicense": {"type": "boolean"}},
        "required": ["copy", "modify", "sublicense"], "additionalProperties": False}},
     "required": ["grant"], "additionalProperties": False},
    {"type": "object", "properties": {"licensor": {"anyOf": [S, {"type": "null"}]},
                                      "spdx": {"enum": ["MIT", "BSD-3-Clause", "GPL-2.0", "Apache-2.0"]}},
     "required": ["licensor", "spdx"], "additionalProperties": False},
    {"type": "object", "properties": {"ref": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{3}$"}},
     "required": ["ref"], "additionalProperties": False},
    {"type": "object", "properties": {"share": {"type": "number", "minimum": 0, "maximum": 1},
                                      "signed": {"type": "string", "format": "date"}},
     "required": ["share", "signed"], "additionalProperties": False},
    {"type": "object", "properties": {"clauses": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 20}, "title": S},
        "required": ["n", "title"], "additionalProperties": False}}},
     "required": ["clauses"], "additionalProperties": False},
    {"type": "object", "properties": {"warranty": {"type": "boolean"}, "liability_cap": {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000000}, {"type": "null"}]}},
     "required": ["warranty", "liability_cap"], "additionalProperties": False},
    {"type": "object", "properties": {"parties": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "properties": {"role": {"enum": ["licensor", "licensee"]}, "name": S},
        "required": ["role", "name"], "additionalProperties": False}}},
     "required": ["parties"], "additionalProperties": False},
]
PATTERN = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
OPTIONS = ["permissive", "copyleft", "proprietary", "unclear"]


def rows(n: int) -> pa.Table:
    """`n` rows of the bundled prompts: of every 12, 10 carry a schema (one each), one a regex, one a choice."""
    sample = pq.read_table(REPO / "flashx_batch" / "assets" / "data" / "legal_docs.parquet").to_pylist()
    out = {"id": [], "prompt": [], "schema": [], "pattern": [], "options": []}
    for i in range(n):
        k = i % 12
        out["id"].append(f"row-{i:05d}")
        out["prompt"].append(sample[i % len(sample)]["prompt"])
        out["schema"].append(json.dumps(SCHEMAS[k]) if k < 10 else None)
        out["pattern"].append(PATTERN if k == 10 else None)
        out["options"].append(json.dumps(OPTIONS) if k == 11 else None)
    return pa.table(out)


def check(text: str, schema: str | None, pattern: str | None, options: str | None) -> bool:
    try:
        if schema is not None:
            jsonschema.validate(json.loads(text), json.loads(schema), format_checker=jsonschema.FormatChecker())
            return True
        if pattern is not None:
            return re.fullmatch(pattern, text) is not None
        return text in json.loads(options)
    except (ValueError, jsonschema.ValidationError):
        return False


def counts(gens: list[dict], by_id: dict[str, dict]) -> dict:
    done = [g for g in gens if g["finish_reason"] == "stop"]
    valid = sum(check(g["generated_text"], *(by_id[g["id"]][c] for c in ("schema", "pattern", "options")))
                for g in done)
    return {"rows": len(gens), "finished": len(done), "finished_valid": valid,
            "finished_share": round(len(done) / max(1, len(gens)), 4)}


COLUMNS = "+sampling.from_columns={json_schema: schema, regex: pattern, choice: options}"


def extraction(table: pa.Table, work: Path, max_new: int) -> dict:
    src = work / "extract.parquet"
    pq.write_table(table, src)
    out = work / "extract_out"
    args = [sys.executable, "-m", "flashx_batch", "conf=legal_docs", f"data.path={src}", f"output.dir={out}",
            COLUMNS, f"sampling.max_new_tokens={max_new}", "runtime.max_output_len=96", "runtime.shard_size=64",
            "runtime.long_input=truncate"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=work, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"extraction job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    gens = pq.read_table(out / "generations").to_pylist()
    stats = pq.read_table(out / "stats").to_pylist()
    per_worker: dict[str, int] = {}
    for s in stats:
        per_worker[s["worker"]] = per_worker.get(s["worker"], 0) + s["grammar_compiles"]
    by_id = {r["id"]: r for r in table.to_pylist()}
    met = [g for g in gens if g["finish_reason"] == "length"]
    return {"command": " ".join(a if " " not in a else repr(a) for a in args[1:]), "exit_code": done.returncode,
            "wall_s": round(wall, 1), **counts(gens, by_id),
            "length_rows_constraint_met": sum(bool(g["constraint_met"]) for g in met),
            "distinct_constraints": len(SCHEMAS) + 2, "grammar_compiles_per_actor": per_worker,
            "shards": len(stats)}


def python_api(table: pa.Table, work: Path, max_new: int) -> dict:
    from flashx_batch import read_output, run_job

    out = work / "api_out"
    code = run_job(["conf=legal_docs", f"output.dir={out}", "executor.kind=local", COLUMNS,
                    f"sampling.max_new_tokens={max_new}", "runtime.max_output_len=96", "runtime.long_input=truncate"],
                   data=table)
    gens = read_output(str(out)).to_table().to_pylist() if code == 0 else []
    return {"exit_code": code, **counts(gens, {r["id"]: r for r in table.to_pylist()})}


def openai_file(table: pa.Table, work: Path, max_new: int) -> dict:
    path, out = work / "requests.jsonl", work / "openai_out"
    lines, expect = [], {}
    for r in table.to_pylist():
        if r["schema"] is None:
            continue
        schema = {"name": "extract", "strict": True, "schema": json.loads(r["schema"])}
        body = {"model": "legal-tiny", "messages": [{"role": "user", "content": r["prompt"]}], "max_tokens": max_new,
                "response_format": {"type": "json_schema", "json_schema": schema}}
        lines.append({"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions", "body": body})
        expect[r["id"]] = r
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = [sys.executable, "-m", "flashx_batch", "conf=legal_docs", f"data.path={path}", "data.format=openai_batch",
            "output.format=openai_batch", f"output.dir={out}", "executor.kind=local", "runtime.max_output_len=96",
            "runtime.long_input=truncate"]
    done = subprocess.run(args, cwd=work, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, check=False)
    got = [json.loads(x) for x in (out / "openai_batch_output.jsonl").read_text().splitlines()] if not done.returncode \
        else []
    gens = [{"id": g["custom_id"], "generated_text": g["response"]["body"]["choices"][0]["message"]["content"],
             "finish_reason": g["response"]["body"]["choices"][0]["finish_reason"]} for g in got if g["response"]]
    return {"exit_code": done.returncode, "lines": len(lines), "error_lines": sum(g["response"] is None for g in got),
            **counts(gens, expect)}


def cost(repeats: int, tokens: int) -> dict:
    from flashx_batch import Engine, SamplingParams

    engine = Engine.from_pretrained(None, max_batch_size=8, max_output_len=tokens, long_input="truncate")
    prompts = [r["prompt"] for r in rows(8).to_pylist()]
    free = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=tokens, ignore_eos=True, json_schema={
        "type": "object", "required": ["notes"], "additionalProperties": False, "properties": {"notes": {
            "type": "array", "minItems": tokens, "items": {"type": "string", "maxLength": 16}}}})
    engine.generate(prompts, free), engine.generate(prompts, constrained)  # warm both paths
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(repeats):
        for name, params in (("free", free), ("constrained", constrained)):
            outs = engine.generate(prompts, params)
            s = engine.last_stats
            assert all(o.num_generated_tokens == tokens for o in outs)
            rates[name].append(s.output_tokens / s.wall_s)
    ratios = [c / f for c, f in zip(rates["constrained"], rates["free"])]
    return {"batch": 8, "new_tokens": tokens, "repeats": repeats,
            "free_tok_per_s_median": round(statistics.median(rates["free"]), 1),
            "constrained_tok_per_s_median": round(statistics.median(rates["constrained"]), 1),
            "constrained_over_free_median": round(statistics.median(ratios), 3),
            "constrained_over_free_min": round(min(ratios), 3),
            "free_tok_per_s": [round(r, 1) for r in rates["free"]],
            "constrained_tok_per_s": [round(r, 1) for r in rates["constrained"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cost-only", action="store_true", help="only the constrained / free cost")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "model": "bundled legal-tiny",
              "command": "python jobs/measurements/structured_output.py " + " ".join(sys.argv[1:])}
    table = rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="fx-structured-") as tmp:
        work = Path(tmp)
        report["cost"] = cost(args.repeats, 48)
        print("cost", report["cost"], flush=True)
        if not args.cost_only:
            run_jobs(report, table, work, args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_output.json").write_text(json.dumps(report, indent=1) + "\n")


def run_jobs(report: dict, table: pa.Table, work: Path, max_new: int) -> None:
    """The three runs of part 1 into `report`."""
    report["extraction_job"] = extraction(table, work, max_new)
    print("job", report["extraction_job"], flush=True)
    report["python_api"] = python_api(table.slice(0, 100), work, max_new)
    print("api", report["python_api"], flush=True)
    report["openai_batch"] = openai_file(table.slice(0, 120), work, max_new)
    print("openai", report["openai_batch"], flush=True)


if __name__ == "__main__":
    main()
