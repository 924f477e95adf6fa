"""Generation logprobs, several samples per prompt, per-row sampling parameters.

Logprobs are pinned to the *raw* model distribution (log-softmax of the logits, before temperature /
top-k / top-p): equal to `transformers`' greedy `generate(output_scores=True)` scores, and for sampled
rows to its raw `output_logits` on the same tokens, not to its processed scores.
"""

from __future__ import annotations

import pytest
import torch
from parity_support import cpu_engine, prompts

from flashx_batch import SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.sampling import SamplingBatch, host_tokens, sample

K = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def qwen2(tiny_models, one_thread):
    model_dir, hf = tiny_models["qwen2"]
    return cpu_engine(model_dir), hf


def _hf_raw_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`transformers`' raw log-softmax [steps, vocab] at each of our generated positions (teacher-forced on
    our sampled tokens: its own sampler draws other tokens, and what its `output_logits` would hold for
    these tokens is exactly this forward pass)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)


def _check_top(top: list[list[tuple[int, float]]], chosen: list[int], chosen_lp: list[float], k: int) -> None:
    for alternatives, token, lp in zip(top, chosen, chosen_lp, strict=True):
        assert len(alternatives) == k
        values = [v for _, v in alternatives]
        assert values == sorted(values, reverse=True)
        if lp >= values[-1] + 1e-6:  # the chosen token is in the top K: it is listed with its logprob
            assert dict(alternatives)[token] == pytest.approx(lp, abs=1e-6)


def test_greedy_logprobs_equal_transformers_scores(qwen2):
    engine, hf = qwen2
    rows = prompts(3, (9, 23, 5, 40))
    outs = engine.generate(rows, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=K))
    worst, compared = 0.0, 0
    for prompt, out in zip(rows, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert ref.sequences[0, len(prompt):].tolist() == out.token_ids
        lp = torch.stack(ref.scores)[:, 0].float().log_softmax(-1)  # [steps, vocab]
        ours = torch.tensor(out.logprobs)
        theirs = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = max(worst, (ours - theirs).abs().max().item())
        for step, alternatives in enumerate(out.top_logprobs):
            ids = [t for t, _ in alternatives]
            assert torch.allclose(torch.tensor([v for _, v in alternatives]), lp[step, ids], atol=TOL)
            assert set(ids) == set(lp[step].topk(K).indices.tolist())
        _check_top(out.top_logprobs, out.token_ids, out.logprobs, K)
        assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy: the chosen token is the most likely
        compared += len(out.token_ids)
    print(f"greedy logprobs vs transformers: max abs diff {worst:.2e} over {compared} tokens")
    assert worst < TOL


def test_sampled_logprobs_are_the_raw_distribution(qwen2):
    engine, hf = qwen2
    rows = prompts(4, (11, 30))
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=8, seed=3, ignore_eos=True, logprobs=3)
    outs = engine.generate(rows, params)
    worst, processed_gap = 0.0, 0.0
    for prompt, out in zip(rows, outs, strict=True):
        raw = _hf_raw_logprobs(hf, prompt, out.token_ids)
        # transformers' processed scores: temperature, then top-k (what `output_scores` holds when sampling)
        scaled = raw / 0.7
        kth = scaled.topk(8).values[:, -1:]
        processed = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(-1)
        idx = torch.tensor(out.token_ids)[:, None]
        ours = torch.tensor(out.logprobs)
        worst = max(worst, (ours - raw.gather(1, idx)[:, 0]).abs().max().item())
        processed_gap = max(processed_gap, (ours - processed.gather(1, idx)[:, 0]).abs().max().item())
        _check_top(out.top_logprobs, out.token_ids, out.logprobs, 3)
    print(f"sampled logprobs vs transformers' raw logits: max abs diff {worst:.2e}")
    assert worst < TOL
    assert processed_gap > 1e-2  # not the temperature / top-k processed distribution


def test_logprobs_off_costs_nothing_and_on_changes_no_token(qwen2, monkeypatch):
    engine, _ = qwen2
    rows = prompts(5, (7, 19, 33))
    plain = engine.generate(rows, SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, ignore_eos=True))
    calls = []
    real = torch.Tensor.log_softmax
    monkeypatch.setattr(torch.Tensor, "log_softmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    again = engine.generate(rows, SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, ignore_eos=True))
    assert not calls and all(o.logprobs is None and o.top_logprobs is None for o in again)
    mixed = engine.generate(rows, [SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, ignore_eos=True,
                                                  logprobs=k) for k in (0, 2, 4)])
    assert calls
    assert [o.token_ids for o in plain] == [o.token_ids for o in again] == [o.token_ids for o in mixed]
    assert mixed[0].logprobs is None
    assert [len(t[0]) for t in (mixed[1].top_logprobs, mixed[2].top_logprobs)] == [2, 4]
    alone = engine.generate([rows[1]], SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, ignore_eos=True,
                                                      logprobs=4))[0]  # batch-mates and K change no value
    assert mixed[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert [[t for t, _ in top[:2]] for top in alone.top_logprobs] == [[t for t, _ in top] for top in
                                                                        mixed[1].top_logprobs]


def test_host_tokens_one_transfer_and_top_k_past_the_vocabulary():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    batch = SamplingBatch.build([SamplingParams(logprobs=10)] * 2, 3, torch.device("cpu"))
    tokens = sample(logits, batch, torch.zeros(2, dtype=torch.long))
    ids, lps, top = host_tokens(logits, tokens, batch)
    assert ids == [1, 0]
    assert [t for t, _ in top[0]] == [1, 2, 0] and len(top[1]) == 3
    assert lps[0] == pytest.approx(logits[0].log_softmax(-1)[1].item())


def test_n_samples_differ_are_reproducible_and_keep_sample_zero(qwen2):
    engine, _ = qwen2
    rows = prompts(6, (12, 25))
    base = SamplingParams(max_new_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    outs = engine.generate(rows, SamplingParams(**{**base.__dict__, "n": 3}))
    assert [(o.index, o.sample_index) for o in outs] == [(i, s) for i in range(2) for s in range(3)]
    single = engine.generate(rows, base)
    for i in range(2):
        mine = [o.token_ids for o in outs if o.index == i]
        assert mine[0] == single[i].token_ids  # sample 0 is the n=1 sample
        assert len({tuple(t) for t in mine}) == 3
        # sample s alone, with its own seed, is the same sample
        alone = engine.generate([rows[i]], SamplingParams(**{**base.__dict__, "seed": base.sample_seed(2)}))[0]
        assert alone.token_ids == mine[2]


@pytest.mark.parametrize("options", [dict(prefix_cache_tokens=64), dict(kv_layout="stripes", refill=False)])
def test_n_samples_and_logprobs_under_prefix_reuse_and_stripes(tiny_models, qwen2, options):
    """Prefix reuse computes the samples' shared prompt once; the tokens and logprobs stay the plain path's."""
    engine, _ = qwen2
    other = cpu_engine(tiny_models["qwen2"][0], **options)
    rows = prompts(7, (40, 21))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=9, ignore_eos=True, n=3, logprobs=2)
    ours, ref = other.generate(rows, params), engine.generate(rows, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    for o, r in zip(ours, ref, strict=True):
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    if "prefix_cache_tokens" in options:
        stats = other.last_stats  # 3 x (40 + 21) prompt tokens: the shared whole segments are computed once
        assert stats.prefill_tokens_computed < stats.input_tokens // 2


def test_n_with_greedy_is_refused():
    with pytest.raises(ConfigError, match="identical"):
        SamplingParams(n=2)
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=-1)


# ---- the job side: per-row sampling columns, config keys, fingerprint --------------------------------

def _job(path, out, *extra):
    from batch_support import tiny_model_dir

    from flashx_batch.config import compose_job

    return compose_job(["conf=smoke", f"data.path={path}", "data.limit=null", "data.passthrough_columns=[]",
                        "data.passthrough_if_present=[]",
                        f"model.path={tiny_model_dir()}", f"output.dir={out}", *extra])


def test_bad_per_row_values_become_error_rows_and_null_keeps_the_job_value(tmp_path):
    from batch_support import sample_rows, write_parquet

    from flashx_batch.runner.job import plan_job

    rows = sample_rows(9, seed=2)
    cells = [(0.7, 4, 7, ["</s>", "x"]), (None, None, None, None), (-0.5, 4, 1, None), (float("nan"), 4, 1, None),
             (0.7, 0, 1, None), (0.7, 99, 1, None), (0.7, 4, -3, None), (0.0, 4, 1, None), (0.7, 4, 1, ["ok", ""])]
    for r, (temp, budget, seed, stop) in zip(rows, cells, strict=True):
        r.update(temp=temp, budget=budget, seed=seed, stops=stop)
    path = write_parquet(tmp_path / "in.parquet", rows)
    columns = "+sampling.from_columns={temperature:temp,max_new_tokens:budget,seed:seed,stop:stops}"
    plan = plan_job(_job(path, tmp_path / "out", columns, "sampling.n=2", "sampling.temperature=0.9")).plan
    errors = {e.id: (e.code, e.message) for errs in plan.row_errors.values() for e in errs}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8]
    assert {code for code, _ in errors.values()} == {"bad_sampling_param"}
    assert "temperature must be >= 0" in errors[2][1] and "finite" in errors[3][1]
    assert "max_new_tokens must be >= 1" in errors[4][1] and "max_output_len=16" in errors[5][1]
    assert "seed" in errors[6][1] and "identical samples" in errors[7][1] and "empty string" in errors[8][1]
    assert plan.num_valid == 2

    from flashx_batch.data.row_sampling import row_params

    job = _job(path, tmp_path / "out", columns, "sampling.n=2", "sampling.temperature=0.9")
    cols = {k: [r[k] for r in rows] for k in ("temp", "budget", "seed", "stops")}
    first, default = (row_params(job.sampling, cols, i, 123, 16) for i in (0, 1))
    assert (first.temperature, first.max_new_tokens, first.seed, first.stop) == (0.7, 4, 7, ("</s>", "x"))
    assert (default.temperature, default.max_new_tokens, default.seed, default.n) == (0.9, 8, 123, 2)


def test_missing_sampling_column_and_bad_keys_stop_the_job(tmp_path):
    from batch_support import cli, overrides, sample_rows, tiny_model_dir, write_parquet

    path = write_parquet(tmp_path / "in.parquet", sample_rows(3))
    out = tmp_path / "out"
    proc = cli(overrides(tiny_model_dir(), path, out, "+sampling.from_columns={temperature:nope}"), cwd=tmp_path)
    assert proc.returncode == 2 and not out.exists()
    assert "missing column(s) 'nope' (named by sampling.from_columns.temperature)" in proc.stderr
    with pytest.raises(ConfigError, match="not a per-row sampling key"):
        _job(path, out, "+sampling.from_columns={n:k}")
    with pytest.raises(ConfigError, match="identical"):
        _job(path, out, "sampling.n=2")  # greedy job-wide, no per-row temperature
    assert _job(path, out, "sampling.n=2", "+sampling.from_columns={temperature:t}").sampling.n == 2
    with pytest.raises(ConfigError, match="logprobs"):
        _job(path, out, "sampling.logprobs=-2")


def test_fingerprint_holds_the_new_keys_only_when_set(tmp_path):
    from batch_support import sample_rows, write_parquet

    from flashx_batch.runner import fingerprint
    from flashx_batch.runner.job import plan_job

    path = write_parquet(tmp_path / "in.parquet", sample_rows(3))
    job = _job(path, tmp_path / "out")
    plan = plan_job(job).plan
    plain = fingerprint.compute(job, plan, {})
    new_keys = {"sampling.logprobs", "sampling.n", "sampling.from_columns", "sampling.json_schema", "sampling.regex",
                "sampling.choice", "sampling.grammar", "sampling.json_fit_budget", "output.answer_format"}
    assert not new_keys & set(plain)  # older jobs still resume
    constrained = fingerprint.compute(_job(path, tmp_path / "out", 'sampling.regex="[0-9]+"'), plan, {})
    assert constrained["sampling.regex"] == "[0-9]+"
    asked = fingerprint.compute(_job(path, tmp_path / "out", "sampling.logprobs=3", "sampling.n=2",
                                     "sampling.temperature=1.0", "+sampling.from_columns={seed:id}"), plan, {})
    assert (asked["sampling.logprobs"], asked["sampling.n"], asked["sampling.from_columns"]) == (3, 2, {"seed": "id"})
