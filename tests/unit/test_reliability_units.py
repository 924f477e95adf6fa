"""The pure parts of the reliability layer: piece ids, fault specs, the retry/split policy, and the
publish rules that keep overlapping pieces (zombies of a split shard) from both committing."""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest

from flashx_batch.data.plan import ShardSpec
from flashx_batch.errors import ConfigError
from flashx_batch.job_errors import FatalEngineError
from flashx_batch.runner import faults, pieces
from flashx_batch.runner.failures import DIED, ERROR, FATAL, TIMEOUT, WORKER_CRASH, Work, decide, kind_of
from flashx_batch.runner.layout import OutputDir


def _spec(n: int, shard_id: str = "b01-0000-abcd") -> ShardSpec:
    return ShardSpec(shard_id, "generate", 1, 1, 16, tuple((0, i) for i in range(n)), 10 * n, 1.0)


def _table(ids):
    return pa.table({"id": pa.array(ids, pa.int64())})


def test_split_halves_and_coverage():
    s = _spec(5)
    left, right = pieces.split(s)
    assert (left.shard_id, right.shard_id) == ("b01-0000-abcd~0", "b01-0000-abcd~1")
    assert left.refs + right.refs == s.refs and left.num_rows == 3
    assert pieces.split(left)[1].shard_id == "b01-0000-abcd~01"
    assert pieces.uncovered(s, set()) == [s]
    # one grandchild committed: the rest of the shard is exactly its three complementary pieces
    rest = pieces.uncovered(s, {"b01-0000-abcd~01", "b01-0000-abcdzz"})
    assert [p.shard_id for p in rest] == ["b01-0000-abcd~00", "b01-0000-abcd~1"]
    assert sum(p.num_rows for p in rest) == 4
    assert pieces.uncovered(s, {"b01-0000-abcd~0", "b01-0000-abcd~1"}) == []
    assert pieces.overlaps("a~0", "a") and pieces.overlaps("a~01", "a~0") and not pieces.overlaps("a~0", "a~1")
    assert not pieces.overlaps("a", "b") and pieces.root_of("a~011") == "a"
    with pytest.raises(ValueError):
        pieces.split(_spec(1))


def test_fault_specs_parse_match_and_reject():
    f = faults.parse("crash:at=after_publish:attempt=1:shard=b01-*")
    assert f.matches("after_publish", "b01-0000-x", 1, None, None)
    assert not f.matches("after_publish", "b01-0000-x", 2, None, None)
    assert not f.matches("before_manifest", "b01-0000-x", 1, None, None)
    poison = faults.parse("crash:row=17")
    assert poison.at == "before_generate" and poison.matches("before_generate", "s", 3, [5, 17], None)
    assert not poison.matches("before_generate", "s", 3, [5, 18], None)
    assert faults.parse("enospc:kind=stats").matches("write", "s", 1, None, "stats")
    for bad in ("explode", "crash", "crash:at=nowhere", "hang:color=red", "fatal:attempt=x"):
        with pytest.raises(ConfigError):
            faults.parse(bad)
    assert faults.load([], environ={}) is None  # off by default: the call sites skip every hook
    armed = faults.load(["hang:row=3"], environ={faults.ENV_VAR: "fatal:attempt=1; enospc"})
    assert [x.action for x in armed.faults] == ["hang", "fatal", "enospc"]
    with pytest.raises(FatalEngineError):
        armed.fire("before_generate", "s", 1, [1])
    with pytest.raises(OSError) as exc:
        armed.fire("write", "s", 2, kind="generations")
    assert exc.value.errno == errno.ENOSPC
    armed.fire("after_generate", "s", 1, [1])  # nothing armed there: returns


def test_retry_split_and_give_up_policy():
    four, one = Work(_spec(4), 1), Work(_spec(1), 1)
    assert decide(four, ERROR, 3).retry == (Work(four.spec, 2),)
    assert decide(Work(four.spec, 3), FATAL, 3).fail
    assert decide(Work(four.spec, 2), TIMEOUT, 2).give_up == TIMEOUT
    # a first death may be bad luck: the whole piece is retried; a second one splits it
    assert decide(four, DIED, 3).retry == (Work(four.spec, 2),)
    halves = decide(Work(four.spec, 2), DIED, 3).retry
    assert [w.spec.shard_id for w in halves] == ["b01-0000-abcd~0", "b01-0000-abcd~1"]
    assert {w.attempt for w in halves} == {2}  # halves continue the parent's tries
    assert decide(one, DIED, 2).retry == (Work(one.spec, 2),)
    assert decide(Work(one.spec, 2), DIED, 2).give_up == WORKER_CRASH
    # max_attempts=1: no second try, a dying piece is split at once
    assert len(decide(four, DIED, 1).retry) == 2


def test_fatal_errors_are_recognised_through_wrapping():
    assert kind_of(FatalEngineError("x")) == FATAL
    assert kind_of(RuntimeError("CUDA error: an illegal memory access was encountered")) == FATAL
    assert kind_of(RuntimeError("shape mismatch")) == ERROR
    assert kind_of(OSError(errno.ENOSPC, "full")) == ERROR

    class Wrapped(Exception):  # what Ray's RayTaskError carries
        cause = FatalEngineError("device lost")

    assert kind_of(Wrapped("task failed")) == FATAL


def test_a_zombie_overlapping_a_committed_piece_loses(tmp_path):
    out = OutputDir(tmp_path / "o")
    out.prepare()
    whole = out.stage("s", 1, {"generations": _table([1, 2, 3])}, {"rows": 3})  # a zombie of the whole shard
    assert out.commit("s~0", 2, {"generations": _table([1, 2])}, {"rows": 2})
    assert not out.publish("s", 1, whole)  # would duplicate ids 1 and 2
    assert out.commit("s~1", 2, {"generations": _table([3])}, {"rows": 1})
    assert set(out.committed()) == {"s~0", "s~1"}
    assert not out.commit("s~01", 3, {"generations": _table([2])}, {})  # inside a committed half
    assert sorted(p.name for p in (tmp_path / "o" / "generations").iterdir()) == ["part-s~0.parquet",
                                                                                   "part-s~1.parquet"]
    assert not any((tmp_path / "o" / "_attempts").iterdir())


def test_enospc_leaves_nothing_in_the_final_folders(tmp_path):
    out = OutputDir(tmp_path / "o", faults.Faults((faults.parse("enospc:kind=stats"),)))
    out.prepare()
    with pytest.raises(OSError, match="No space left"):
        out.commit("s", 1, {"generations": _table([1]), "stats": _table([0])}, {})
    for kind in ("generations", "stats", "_manifest"):
        assert not any((tmp_path / "o" / kind).iterdir()), kind
    assert out.committed() == {}
