"""Property test of the commit protocol (docs/batch_jobs.md, "Output layout and exactly-once"):
random interleavings of attempts of any piece of three shards — staged and left pending (zombies),
published, crashed mid-write or mid-publish, resumed over — never commit two pieces that share a
row, and finishing the job always yields committed ids = planned ids, each exactly once, with no
orphan file left behind."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashx_batch.data.plan import ShardSpec
from flashx_batch.runner import pieces
from flashx_batch.runner.layout import KINDS, OutputDir

# Three planned shards of 4, 3 and 1 rows; a row's id is 100 * shard + row.
SHARDS = [ShardSpec(f"b0{k}-0000-x", "generate", k, 1, 8, tuple((k, i) for i in range(n)), n, 1.0)
          for k, n in enumerate((4, 3, 1))]


def _all_pieces(spec: ShardSpec) -> list[ShardSpec]:
    return [spec] + ([p for half in pieces.split(spec) for p in _all_pieces(half)] if spec.num_rows > 1 else [])


PIECES = [p for s in SHARDS for p in _all_pieces(s)]
IDS = Counter(100 * fi + ri for s in SHARDS for fi, ri in s.refs)


class _Crash(BaseException):
    """A process dying at a hook: nothing after it runs (a BaseException, so no `except Exception` eats it)."""


class _CrashAt:
    def __init__(self, point: str) -> None:
        self.point = point

    def fire(self, point: str, shard: str, attempt: int, ids=None, kind=None, peers=()) -> None:
        if point == self.point:
            raise _Crash(point)


def _tables(spec: ShardSpec) -> dict[str, pa.Table]:
    ids = [100 * fi + ri for fi, ri in spec.refs]
    return {"generations": pa.table({"id": pa.array(ids, pa.int64())}),
            "stats": pa.table({"rows": [len(ids)]})}


class CommitProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None  # fsync-heavy: keep it off the real disk
        self.tmp = Path(tempfile.mkdtemp(prefix="fx-commit-sm-", dir=base))
        self.out = OutputDir(self.tmp / "job")
        self.out.prepare()
        self.staged: list[tuple[str, int, Path]] = []  # attempts written but not published: zombies-to-be
        self.attempt = 0

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _next_attempt(self) -> int:
        self.attempt += 1
        return self.attempt

    @rule(piece=st.sampled_from(PIECES))
    def stage_an_attempt(self, piece):
        attempt = self._next_attempt()
        self.staged.append((piece.shard_id, attempt, self.out.stage(piece.shard_id, attempt, _tables(piece), {})))

    @rule(piece=st.sampled_from(PIECES))
    def crash_while_writing(self, piece):
        staging = self.out.start_attempt(piece.shard_id, self._next_attempt())
        (staging / "generations.parquet").write_bytes(b"PAR1 torn")

    @precondition(lambda self: self.staged)
    @rule(data=st.data(), crash=st.sampled_from([None, "after_publish", "before_manifest"]))
    def publish_an_attempt(self, data, crash):
        shard_id, attempt, staging = self.staged.pop(data.draw(st.integers(0, len(self.staged) - 1)))
        publisher = OutputDir(self.out.root, _CrashAt(crash) if crash else None)
        try:
            publisher.publish(shard_id, attempt, staging)
        except _Crash:
            pass
        except FileNotFoundError:
            assert not staging.exists()  # a zombie whose attempt dir a resume removed: it cannot publish

    @precondition(lambda self: self.out.committed())
    @rule(data=st.data())
    def zombie_overlapping_a_committed_piece(self, data):
        """An attempt of a piece sharing rows with a committed one (the same piece, the shard it was
        split from, or a half of it) finishes late: it must lose and leave the winner's files alone."""
        winner = data.draw(st.sampled_from(sorted(self.out.committed())))
        zombie = data.draw(st.sampled_from([p for p in PIECES if pieces.overlaps(p.shard_id, winner)]))
        before = self.out.part("generations", winner).read_bytes()
        assert not self.out.commit(zombie.shard_id, self._next_attempt(), _tables(zombie), {})
        assert self.out.part("generations", winner).read_bytes() == before

    @rule()
    def resume(self):
        committed = self.out.committed()
        self.out.clean_orphans(committed)
        for kind in KINDS:  # after a resume's clean-up, every file in place belongs to a committed piece
            names = {p.name for p in (self.out.root / kind).iterdir()}
            assert names <= {f"part-{c}.parquet" for c in committed}, kind

    @invariant()
    def committed_pieces_never_overlap_and_hold_their_rows(self):
        committed = sorted(self.out.committed())
        assert not [(a, b) for i, a in enumerate(committed) for b in committed[i + 1:] if pieces.overlaps(a, b)]
        for c in committed:
            got = pq.read_table(self.out.part("generations", c)).column("id").to_pylist()
            spec = next(p for p in PIECES if p.shard_id == c)
            assert got == [100 * fi + ri for fi, ri in spec.refs]

    def check_finish(self) -> None:
        """Resume, run every uncovered piece to commit: committed ids = planned ids, exactly once."""
        self.resume()
        for spec in SHARDS:
            for piece in pieces.uncovered(spec, self.out.committed()):
                assert self.out.commit(piece.shard_id, self._next_attempt(), _tables(piece), {})
        committed = self.out.committed()
        self.out.clean_orphans(committed)
        ids = Counter(i for c in committed for i in pq.read_table(self.out.part("generations", c)).column("id")
                      .to_pylist())
        assert ids == IDS
        assert {p.name for p in (self.out.root / "generations").iterdir()} == {f"part-{c}.parquet" for c in committed}

    @rule()
    def finish(self):
        self.check_finish()


TestCommitProtocol = CommitProtocol.TestCase
TestCommitProtocol.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
