"""The synthetic retrieval sequences of jobs/training/train_retrieval_model.py: the same seed gives the same
sequences, and the loss mask covers exactly the retrieval targets (the repeated span; the queried
values)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "jobs" / "training" / "train_retrieval_model.py"


@pytest.fixture(scope="module")
def job():
    spec = importlib.util.spec_from_file_location("train_retrieval_model", JOB)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    path = list(sys.path)  # the job puts jobs/ first on sys.path
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path[:] = path


TEXT = [7 + (i * 37) % 500 for i in range(5000)]  # stand-in licence tokens


def test_same_seed_same_sequences(job):
    for make in (job.random_copy, job.random_mqar):
        a = [make(random.Random(3), TEXT) for _ in range(3)]
        b = [make(random.Random(3), TEXT) for _ in range(3)]
        assert [(e.ids, e.targets) for e in a] == [(e.ids, e.targets) for e in b]
        assert make(random.Random(3), TEXT).ids != make(random.Random(4), TEXT).ids
        assert all(len(e.ids) == job.SEQ_LEN for e in a)


def test_copy_mask_is_the_repeated_span(job):
    rng = random.Random(0)
    for _ in range(20):
        e = job.random_copy(rng, TEXT)
        first = e.ids.index(job.MARK_SPAN) + 1
        query = e.ids.index(job.MARK_QUERY) + 1
        span = len(e.targets)
        assert e.targets == list(range(query, query + span))
        assert e.ids[query : query + span] == e.ids[first : first + span]
        labels = e.labels()
        assert [i for i, t in enumerate(labels) if t != job.IGNORE] == e.targets
        assert all(labels[i] == e.ids[i] for i in e.targets)


def test_mqar_mask_is_the_queried_values(job):
    rng = random.Random(1)
    for _ in range(20):
        e = job.random_mqar(rng, TEXT)
        start = e.ids.index(job.MARK_SPAN) + 1
        query = e.ids.index(job.MARK_QUERY) + 1
        n = len(e.targets)
        pairs = dict(zip(e.ids[start : start + 2 * n : 2], e.ids[start + 1 : start + 2 * n : 2]))
        assert len(pairs) == n  # distinct keys
        assert e.targets == list(range(query + 1, query + 2 * n, 2))
        assert sorted(e.ids[query : query + 2 * n : 2]) == sorted(pairs)  # every key queried once
        assert all(e.ids[t] == pairs[e.ids[t - 1]] for t in e.targets)
        assert [i for i, t in enumerate(e.labels()) if t != job.IGNORE] == e.targets


def test_repeat_rows_target_every_token_after_the_first_copy(job):
    rng = random.Random(2)
    for _ in range(20):
        e = job.repeat_example(rng, 256)
        assert len(e.ids) == 256 and e.ids[0] == job.MARK_SPAN
        span = e.targets[0] - 1
        assert e.targets == list(range(1 + span, 256))
        assert all(e.ids[t] == e.ids[t - span] for t in e.targets)


def test_induction_targets_point_after_the_previous_occurrence(job):
    import torch

    ids = torch.tensor([[9, 5, 6, 7, 5, 6, 8, 8, 5]])
    # 5 at t=4 last seen at 1 -> look at 2; 6 at 5 -> 3; the second 8 follows the first directly: none;
    # 5 at 8 last seen at 4 -> 5
    assert job.induction_targets(ids).tolist() == [[-1, -1, -1, -1, 2, 3, -1, -1, 5]]
    rng = random.Random(4)
    e = job.repeat_example(rng, 64)
    target = job.induction_targets(torch.tensor([e.ids]))[0]
    # in a repeated span, the key after the previous occurrence holds the token that comes next
    assert all(e.ids[int(target[t])] == e.ids[t + 1] for t in e.targets[:-1] if target[t] >= 0)


def test_plain_rows_carry_no_marker_and_skip_the_unpredictable_first_token(job):
    rng = random.Random(6)
    for _ in range(20):
        c = job.random_copy(rng, TEXT, markers_share=0.0)
        m = job.random_mqar(rng, TEXT, markers_share=0.0)
        for e in (c, m):
            assert len(e.ids) == job.SEQ_LEN
            assert job.MARK_SPAN not in e.ids and job.MARK_QUERY not in e.ids
        first = c.targets[0] - 1  # the repeat's first token is not a target
        repeat = c.ids[first : c.targets[-1] + 1]
        assert c.targets == list(range(first + 1, first + len(repeat)))
        assert any(c.ids[i : i + len(repeat)] == repeat for i in range(first - len(repeat) + 1))  # seen before
        assert all(m.ids[t] in m.ids[: t - 2] for t in m.targets)  # each value was seen after its key
