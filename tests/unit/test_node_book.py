"""The Ray executor's node policy, without Ray: placement, failure domains, exclusion, the elastic pool."""

from flashx_batch.runner.node_book import NodeBook


def _node(node_id, cpus=1, alive=True):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus}}


def test_placement_fills_the_roomiest_node_and_the_pool_follows_the_nodes():
    book = NodeBook({"CPU": 1.0}, limit=3, ceiling=None)
    joined, lost = book.refresh([_node("a", 2), _node("b", 1), _node("head", 0)])
    assert joined == ["a", "b"] and lost == [] and book.room() == 3
    assert [book.place(f"w{i}") for i in range(4)] == ["a", "b", "a", None]
    joined, lost = book.refresh([_node("a", 2), _node("b", 1, alive=False), _node("c", 1)])
    assert joined == ["c"] and lost == ["w1"]
    book.remove("w1")
    assert book.room() == 1 and book.place("w4") == "c"


def test_a_failed_shard_avoids_its_node_while_another_node_has_actors():
    book = NodeBook({"CPU": 1.0}, limit=3, ceiling=None)
    book.refresh([_node("a"), _node("b")])
    book.place("wa")
    book.place("wb")
    book.ready |= {"wa", "wb"}
    assert book.failed("wa", "b00-0001-x", "RuntimeError: boom") is None
    assert not book.may_run("b00-0001-x", "wa") and book.may_run("b00-0001-x", "wb")
    assert not book.may_run("b00-0001-x~0", "wa")  # its split pieces too
    book.remove("wb")  # no other node holds an actor: waiting would wait forever
    assert book.may_run("b00-0001-x", "wa")


def test_a_node_failing_every_attempt_is_excluded_and_a_success_resets_the_count():
    book = NodeBook({"CPU": 1.0}, limit=3, ceiling=2)
    book.refresh([_node("a"), _node("b"), _node("c")])
    book.place("wa")
    book.place("wb")
    book.failed("wb", "s1", "x")
    book.failed("wb", "s2", "x")
    book.succeeded("wb")
    assert book.failed("wb", "s3", "x") is None
    book.failed("wa", "s4", "e")
    book.remove("wa")  # the actor died: its failures still count for its node
    book.failed("wa", "s5", "ActorDiedError")
    assert book.failed("wa", "s6", "FatalEngineError: dead") == "a"
    assert book.place("w2") == "c"  # never back on the excluded node
    summary = book.summary()
    assert summary["a"]["excluded"].startswith("3 different shards failed in a row") and summary["b"]["shards"] == 1
    assert not book.all_excluded()


def test_one_shard_failing_again_counts_once_and_the_last_node_is_kept():
    book = NodeBook({"CPU": 1.0}, limit=3, ceiling=None)
    book.refresh([_node("only")])
    book.place("w1")
    for attempt in range(5):  # one poison shard and its split pieces: the shard's problem, not the node's
        assert book.failed("w1", "b00-0001" + "~0" * attempt, "boom") is None
    assert [book.failed("w1", f"s{i}", "boom") for i in range(4)] == [None] * 4  # the last usable node stays
    assert not book.all_excluded()
    book.refresh([_node("only", alive=False)])
    assert not book.all_excluded()  # gone, not excluded: the pool waits for nodes to come back
