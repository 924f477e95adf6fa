"""Log-likelihoods: the engine equals lm-evaluation-harness's Hugging Face backend (HFLM) on the bundled
model, multiple choice equals per-choice scoring, and `task` jobs write one result or error row per id."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashx_batch import Engine, SamplingParams
from flashx_batch.runtime.lm_requests import rolling_windows
from flashx_batch.runtime.options import bundled_model_dir

MAX_LEN = 64  # short windows: the rolling texts span several
HELDOUT = bundled_model_dir().parent.parent / "data" / "legal_heldout_eval.jsonl"


@pytest.fixture(scope="module")
def engine(one_thread):
    return Engine.from_pretrained(max_input_len=MAX_LEN, max_batch_size=4, max_output_len=8, long_input="truncate")


@pytest.fixture(scope="module")
def hflm(one_thread):
    lm_hf = pytest.importorskip("lm_eval.models.huggingface")
    # logits_cache=False: lm-eval 0.4.13's one-token-continuation cache groups requests by context +
    # continuation[:-1], and a rolling window of one text that shares its input with another text's window
    # (different continuation lengths) got the other's score in a batch (31 nats off here); uncached, every
    # value is the one HFLM gives for the request alone
    return lm_hf.HFLM(pretrained=str(bundled_model_dir()), dtype="float32", batch_size=16, device="cpu",
                      max_length=MAX_LEN, logits_cache=False)


@pytest.fixture(scope="module")
def texts():
    return [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines() if line.strip()]


def _instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _pairs(texts, engine):
    """~110 (context, continuation) pairs: line-split documents (contexts with trailing whitespace, long ones
    left-truncated), an empty context, a context starting with BOS, and the model's own greedy continuations."""
    pairs = []
    for t in texts:
        lines = [x for x in t.split("\n") if x.strip()]
        for i in range(1, min(len(lines), 6)):
            pairs.append(("\n".join(lines[:i])[-400:] + ("\n" if i % 2 else " "), lines[i][:60]))
    pairs += [("", "Copyright (C) 2001"), ("", " the licence"), ("<s>Permission is", " hereby granted")]
    prompts = [p[0].rstrip()[-120:] for p in pairs[:8]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    pairs += [(p, o.text) for p, o in zip(prompts, outs, strict=True) if o.text and o.text.strip()]
    return pairs


def test_loglikelihood_equals_lm_eval(engine, hflm, texts):
    pairs = _pairs(texts, engine)
    assert len(pairs) >= 100
    ours = engine.loglikelihood(pairs)
    ref = hflm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, ref, strict=True))
    assert diff <= 1e-4, diff
    assert [a[1] for a in ours] == [b[1] for b in ref]
    assert any(b[1] for b in ref)  # the greedy continuations are greedy for both
    # token ids as lm-eval encodes them give the same numbers
    ids = [(hflm.tok_encode(c.rstrip()), None) for c, _ in pairs[:3]]
    assert [engine.lm.encode_pairs(pairs[:3])[i][0] for i in range(3)] == [c for c, _ in ids]


def test_loglikelihood_rolling_equals_lm_eval(engine, hflm, texts):
    docs = [t[i * 50 : i * 50 + 180 + 30 * (i % 5)] for t in texts for i in range(5)]
    docs = [d for d in docs if d.strip()][:110]
    assert len(docs) >= 100
    ours = engine.loglikelihood_rolling(docs)
    ref = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    # a document's sum runs over up to ~200 tokens, each float32 GEMMs summed in another order than
    # transformers' (oneDNN against MKL): equal to float32 precision relative to the sum
    worst = max(abs(a - b) / (1e-4 + 1e-6 * abs(b)) for a, b in zip(ours, ref, strict=True))
    assert worst <= 1.0, worst
    assert max(len(rolling_windows(engine.lm.encoder.encode([d])[0], 1, MAX_LEN)) for d in docs) > 1


def test_rolling_windows_match_lm_eval():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (1, 5, 63, 64, 65, 128, 129, 200):
        tokens = list(range(10, 10 + n))
        want = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 1, 64, 1)]
        assert rolling_windows(tokens, 1, 64) == [(list(a), list(b)) for a, b in want]


def test_multiple_choice_equals_per_choice(engine, texts):
    items = []
    for t in texts[:12]:
        words = t.split()
        items.append((" ".join(words[:30]), [" ".join(words[30:34]), "the court", "x", words[30]]))
    items.append((" ".join(texts[0].split()[:200]), ["a", "long context is truncated"]))  # plain rows
    items.append(("", ["Copyright", "Permission"]))
    scores = engine.choice_logprobs(items, delimiter=" ")
    flat = engine.loglikelihood([(c, " " + ch) for c, chs in items for ch in chs])
    got = [(lp, g) for s in scores for lp, g in zip(s.logprobs, s.is_greedy, strict=True)]
    assert max(abs(a[0] - b[0]) for a, b in zip(got, flat, strict=True)) <= 1e-4
    assert [a[1] for a in got] == [b[1] for b in flat]
    s = scores[0]
    assert s.logprobs_norm == [lp / len(c) for lp, c in zip(s.logprobs, items[0][1], strict=True)]
    assert s.pred == max(range(4), key=lambda i: s.logprobs[i])
    one = engine.multiple_choice(*items[1], delimiter=" ")
    assert one.logprobs == pytest.approx(scores[1].logprobs, abs=1e-5)


def test_bad_requests_are_refused(engine):
    with pytest.raises(ValueError, match="continuation has no tokens"):
        engine.loglikelihood([([1, 2], [])])
    with pytest.raises(ValueError, match="more than max_length"):
        engine.loglikelihood([([1], list(range(5, 5 + MAX_LEN + 1)))])
    assert engine.loglikelihood([([], [5, 6])])[0][0] == pytest.approx(engine.loglikelihood([([1], [5, 6])])[0][0])


# ---- jobs -----------------------------------------------------------------------------------------
def _run_job(tmp_path, rows, *extra):
    from batch_support import overrides

    from flashx_batch.config import compose_job
    from flashx_batch.runner import run

    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "out"
    code = run(compose_job(overrides(bundled_model_dir(), data, out, "output.report=false", *extra)))
    return code, out


def _tables(out):
    gen = pq.read_table(out / "generations").to_pylist()
    err = pq.read_table(out / "errors").to_pylist()
    return {r["id"]: r for r in gen}, {r["id"]: r["error_code"] for r in err}


def test_job_loglikelihood_rows_and_error_rows(engine, tmp_path):
    rows = [{"id": 0, "context": "Permission is hereby", "continuation": " granted, free of charge"},
            {"id": 1, "context": "", "continuation": "Copyright (C) 2001"},
            {"id": 2, "context": "The licence ", "continuation": "is void"},
            {"id": 3, "context": None, "continuation": "x"},
            {"id": 4, "context": "a", "continuation": ""},
            {"id": 5, "context": "   ", "continuation": "x"},
            {"id": 6, "context": "a", "continuation": " b" * 600}]
    code, out = _run_job(tmp_path, rows, "task=loglikelihood", "runtime.shard_size=2")
    assert code == 0
    gen, err = _tables(out)
    assert err == {3: "null_context", 4: "empty_continuation", 5: "empty_context", 6: "continuation_too_long"}
    want = engine.loglikelihood([(r["context"], r["continuation"]) for r in rows[:3]])
    for r, (lp, greedy) in zip(rows[:3], want, strict=True):
        assert gen[r["id"]]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert gen[r["id"]]["is_greedy"] == greedy and gen[r["id"]]["num_tokens"] >= 1


def test_a_scoring_context_past_max_input_len_is_an_error_row_or_flagged(engine, tmp_path):
    """A context too long for max_input_len with its continuation was once scored on its last tokens
    silently, even under long_input=error: now it is a prompt_too_long error row there, and under
    long_input=truncate it is scored so with truncated=true (the short row: false)."""
    rows = [{"id": 0, "context": " the licence" * 400, "continuation": " is void"},
            {"id": 1, "context": "The licence ", "continuation": "is void"}]
    (tmp_path / "error").mkdir()
    (tmp_path / "truncate").mkdir()
    code, out = _run_job(tmp_path / "error", rows, "task=loglikelihood", "runtime.long_input=error")
    gen, err = _tables(out)
    assert code == 0 and err == {0: "prompt_too_long"} and list(gen) == [1] and gen[1]["truncated"] is False
    code, out = _run_job(tmp_path / "truncate", rows, "task=loglikelihood", "runtime.long_input=truncate")
    gen, err = _tables(out)
    assert code == 0 and not err and gen[0]["truncated"] is True and gen[1]["truncated"] is False


def test_job_multiple_choice_equals_per_choice_loglikelihood(engine, tmp_path):
    rows = [{"id": "q0", "context": "Permission is hereby", "choices": ["granted", "denied", "x"], "answer": 0},
            {"id": "q1", "context": "The GNU General Public", "choices": ["License", "Library"], "answer": 1},
            {"id": "q2", "context": "Copyright", "choices": ["(C) 2001"], "answer": None},
            {"id": "q3", "context": "a", "choices": [], "answer": 0},
            {"id": "q4", "context": "a", "choices": ["b", "c"], "answer": 2},
            {"id": "q5", "context": "a", "choices": ["b", None], "answer": 0}]
    code, out = _run_job(tmp_path, rows, "task=multiple_choice")
    assert code == 0
    gen, err = _tables(out)
    assert err == {"q3": "empty_choices", "q4": "answer_out_of_range", "q5": "empty_choice"}
    for r in rows[:3]:
        want = [lp for lp, _ in engine.loglikelihood([(r["context"], " " + c) for c in r["choices"]])]
        got = gen[r["id"]]
        assert got["choice_logprobs"] == pytest.approx(want, abs=1e-4)
        assert got["choice_logprobs_norm"] == pytest.approx([lp / len(c) for lp, c in zip(want, r["choices"],
                                                                                           strict=True)], abs=1e-4)
        assert got["pred"] == max(range(len(want)), key=lambda i: want[i])
        assert got["correct"] == (None if r["answer"] is None else got["pred"] == r["answer"])


def test_job_perplexity(engine, tmp_path):
    rows = [{"id": 0, "prompt": "Permission is hereby granted, free of charge, to any person"},
            {"id": 1, "prompt": "This program is free software; you can redistribute it"},
            {"id": 2, "prompt": "  "}, {"id": 3, "prompt": None}]
    code, out = _run_job(tmp_path, rows, "task=perplexity")
    assert code == 0
    gen, err = _tables(out)
    assert err == {2: "empty_prompt", 3: "null_prompt"}
    want = engine.loglikelihood_rolling([r["prompt"] for r in rows[:2]])
    for r, lp in zip(rows[:2], want, strict=True):
        got = gen[r["id"]]
        assert got["logprob"] == pytest.approx(lp, abs=1e-4)
        assert got["perplexity"] == pytest.approx(math.exp(-got["logprob"] / got["num_tokens"]))


@pytest.mark.parametrize("extra, message", [
    (["task=bogus"], "task='bogus'"),
    (["task=loglikelihood", "data.messages_column=messages"], "chat rows are for task=generate"),
    (["task=perplexity", "data.prompt_prefix=Q:"], "prompt_prefix"),
    (["task=multiple_choice", "data.choices_column=id"], "two roles"),
    (["task=loglikelihood", "sampling.n=2", "sampling.temperature=0.7"], "generates none"),
    (["task=multiple_choice", "sampling.logprobs=3"], "generates none"),
])
def test_bad_task_config_is_refused(extra, message):
    from batch_support import overrides, tiny_model_dir

    from flashx_batch.config import compose_job
    from flashx_batch.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        compose_job(overrides(tiny_model_dir(), "in.parquet", None, *extra))


def test_multiple_choice_job_resumes_after_a_crash_exactly_once(tmp_path):
    import signal

    from batch_support import cli, faults_override, output_ids, overrides

    rows = [{"id": i, "context": f"Section {i}: permission is", "choices": ["granted", "denied"], "answer": i % 2}
            for i in range(6)] + [{"id": 6, "context": "a", "choices": [], "answer": 0}]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "out"
    args = overrides(bundled_model_dir(), data, out, "task=multiple_choice", "runtime.shard_size=2",
                     "output.report=false")
    crashed = cli([*args, faults_override(["crash:at=after_publish:shard=b*-0001-*"])], cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    published = {p.name for p in (out / "generations").glob("part-*.parquet")}
    assert any("-0001-" in name for name in published)  # published, never committed (no manifest)
    resumed = cli(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    generated, errors = output_ids(out)
    assert max((generated + errors).values()) == 1
    assert set(generated) == set(range(6)) and set(errors) == {6}


def test_loglikelihood_equals_lm_eval_on_a_second_family(tmp_path, one_thread, texts):
    """The same parity on a tiny random Qwen2 (q / k / v biases, tied embeddings) with the bundled tokenizer: the
    scores are not a property of the bundled Llama alone."""
    import sys

    lm_hf = pytest.importorskip("lm_eval.models.huggingface")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from model_factory import build

    from flashx_batch.bench.models import add_bundled_tokenizer

    build("qwen2", tmp_path, seed=7, vocab_size=4096, max_position_embeddings=128)
    add_bundled_tokenizer(tmp_path, 4096)
    engine = Engine.from_pretrained(tmp_path, max_input_len=MAX_LEN, max_batch_size=4, max_output_len=8,
                                    long_input="truncate")
    from transformers import PreTrainedTokenizerFast

    # the tokenizer its files name (`tokenizer_class: PreTrainedTokenizerFast`), as our engine reads it: left to
    # itself, transformers 5 picks its Qwen2 tokenizer class by the config's model type, which splits this
    # (Llama-style) tokenizer.json's text differently; real Qwen2 checkpoints ship a tokenizer.json that agrees
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    hf = lm_hf.HFLM(pretrained=str(tmp_path), tokenizer=tokenizer, dtype="float32", batch_size=16, device="cpu",
                    max_length=MAX_LEN, logits_cache=False)
    pairs = _pairs(texts, engine)[:40]
    ours = engine.loglikelihood(pairs)
    ref = hf.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    assert max(abs(a[0] - b[0]) for a, b in zip(ours, ref, strict=True)) <= 1e-4
    assert [a[1] for a in ours] == [b[1] for b in ref]
