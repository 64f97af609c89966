"""The writer thread: group commit, the two passes, replies after commit, shutdown.

These tests run real threads and a real SQLite file, so they use trio's real clock with
``fail_after`` bounds; the store's own time comes from an injected clock.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import attrs
import pytest
import trio

from relay.protocol import wire
from relay.protocol.errors import (
    InternalError,
    JobNotFound,
    LeaseExpired,
    ShuttingDown,
    StaleToken,
    Unavailable,
)
from relay.protocol.model import JobState, SubmitSpec, parse_job_id
from relay.store import commands as cmd
from relay.store.base import Changes
from relay.store.sqlite import SqliteStore
from relay.store.writer import Writer, open_writer
from tests.conftest import T0

# Every wait in these tests is bounded; a hang fails the test instead of the run.
BOUND_S = 10


class FakeClock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class Collect:
    """A reply sink that records each delivery (one list per batch) in order."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.deliveries: list[list[tuple[Any, Any]]] = []
        self.done = trio.Event()

    def deliver(self, pairs: list[tuple[Any, Any]]) -> None:
        # (item, reply) pairs; a typed command's reply is its outcome, its tag item[2].
        self.deliveries.append([(item[2], reply) for item, reply in pairs])
        if sum(map(len, self.deliveries)) >= self.expected:
            self.done.set()

    @property
    def outcomes(self) -> dict[Any, Any]:
        return {tag: outcome for batch in self.deliveries for tag, outcome in batch}


@attrs.frozen(eq=False)
class Gate:
    """A command that holds the writer thread until released, so that the commands sent
    meanwhile are all queued when the thread takes its next batch."""

    entered: threading.Event = attrs.Factory(threading.Event)
    release: threading.Event = attrs.Factory(threading.Event)

    def apply(self, store: SqliteStore, now: int) -> str:
        self.entered.set()
        assert self.release.wait(BOUND_S), "gate never released"
        return "passed"


@attrs.frozen
class WriteThenExplode:
    """Inserts a job, then fails with an unexpected (non-relay) exception."""

    def apply(self, store: SqliteStore, now: int) -> None:
        store.jobs_submit([SubmitSpec("explode", "1")], now)
        raise ZeroDivisionError("boom")


@attrs.frozen
class WriteThenRefuse:
    """Inserts a job, then refuses: a refusal that breaks the store's rule of refusing
    before writing anything."""

    def apply(self, store: SqliteStore, now: int) -> None:
        store.jobs_submit([SubmitSpec("refuse", "1")], now)
        raise StaleToken("job_0000000000000001")


async def hold_writer(writer: Writer) -> Gate:
    """Occupy the writer thread with a Gate and return once it is inside it."""
    gate = Gate()
    sink = Collect(1)
    await writer.send(gate, sink)
    await trio.to_thread.run_sync(gate.entered.wait, BOUND_S)
    return gate


async def one_batch(writer: Writer, commands: list[tuple[Any, Any]]) -> Collect:
    """Queue ``commands`` ((tag, command) pairs) behind a held writer thread, so that they
    form its next batch, and wait until every one is answered."""
    gate = await hold_writer(writer)
    sink = Collect(len(commands))
    for tag, command in commands:
        await writer.send(command, sink, tag=tag)
    gate.release.set()
    await sink.done.wait()
    return sink


def spec(queue: str = "q", **kw: Any) -> SubmitSpec:
    return SubmitSpec(queue, kw.pop("payload", "{}"), **kw)


@pytest.fixture
def db_path(tmp_path) -> str:
    return str(tmp_path / "relay.db")


async def batch_then_stats(db_path: str, commands: list[tuple[Any, Any]]) -> tuple[dict, dict]:
    """Run ``commands`` as one batch of a fresh writer on ``db_path``: their outcomes by
    tag, and the queue counts afterwards."""
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            sink = await one_batch(writer, commands)
            stats = await writer.execute(cmd.Stats())
    return sink.outcomes, stats


def committed_ids(path: str) -> set[int]:
    with sqlite3.connect(path) as conn:
        return {row[0] for row in conn.execute("SELECT id FROM jobs")}


async def test_queued_commands_share_one_transaction(db_path):
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            gate = await hold_writer(writer)
            sink = Collect(50)
            for i in range(50):
                await writer.send(cmd.Submit((spec(),)), sink, tag=i)
            before = writer.statistics()
            gate.release.set()
            await sink.done.wait()
            after = writer.statistics()
    # Fifty waiting, and the gate in the thread's hands.
    assert before.queued == 51
    # All fifty were waiting when the thread came back: one batch, one commit, one hand-off.
    assert len(sink.deliveries) == 1
    # Two transactions in all: the gate's, then the fifty submits together.
    assert (before.batches, after.batches) == (0, 2)
    assert after.commands == 51
    assert after.batch_sizes.count == after.batches
    assert [tag for tag, _ in sink.deliveries[0]] == list(range(50))


async def test_a_refused_command_does_not_undo_the_others_in_its_batch(db_path):
    out, stats = await batch_then_stats(db_path, [
        ("a", cmd.Submit((spec(payload="1"),))),
        ("stale", cmd.Ack("job_0000000000000001", "w", "bad")),
        ("explode", WriteThenExplode()),
        ("b", cmd.Submit((spec(payload="2"),))),
    ])  # fmt: skip
    assert out["a"][0].state == JobState.READY
    assert out["b"][0].state == JobState.READY
    assert isinstance(out["stale"], Exception) and out["stale"].code == "not_found"
    assert isinstance(out["explode"], InternalError)
    assert "ZeroDivisionError" in out["explode"].message
    # The exploding command's own insert was rolled back with its savepoint.
    assert stats == {"q": {"pending": 0, "ready": 2, "leased": 0, "retrying": 0,
                           "succeeded": 0, "dead": 0, "cancelled": 0}}  # fmt: skip
    assert committed_ids(db_path) == {
        parse_job_id(out["a"][0].job_id),
        parse_job_id(out["b"][0].job_id),
    }


async def test_a_refusal_that_wrote_first_is_undone_and_the_others_stand(db_path):
    # The first pass runs without savepoints, trusting that a refusal writes nothing; it
    # checks that, and a refusal that did write sends the batch to the careful pass.
    out, stats = await batch_then_stats(db_path, [
        ("a", cmd.Submit((spec(payload="1"),))),
        ("refuse", WriteThenRefuse()),
        ("b", cmd.Submit((spec(payload="2"),))),
    ])  # fmt: skip
    assert isinstance(out["refuse"], StaleToken)
    assert committed_ids(db_path) == {
        parse_job_id(out["a"][0].job_id),
        parse_job_id(out["b"][0].job_id),
    }
    assert set(stats) == {"q"} and stats["q"]["ready"] == 2


async def test_a_batch_that_fails_nowhere_runs_without_savepoints(db_path):
    store = SqliteStore.open(db_path)
    statements: list[str] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit((spec(), spec())))
            first, second = await writer.execute(cmd.Claim(("q",), "w", 2, 30_000))
            (waiting,) = await writer.execute(cmd.Submit((spec(),)))
            store._db.set_trace_callback(statements.append)
            sink = await one_batch(writer, [
                ("submit", cmd.Submit((spec(),))),
                ("ack1", cmd.Ack(first.job_id, "w", first.token)),
                ("ack2", cmd.Ack(second.job_id, "w", second.token)),
                ("stale", cmd.Ack(second.job_id, "w", "0" * 32)),
                ("claim", cmd.Claim(("q",), "w", 1, 30_000)),
            ])  # fmt: skip
            store._db.set_trace_callback(None)
    out = sink.outcomes
    assert out["ack1"] is None and out["ack2"] is None
    assert isinstance(out["stale"], StaleToken)
    # Claims run first in a batch: the claim takes the job that was ready before it.
    assert [lease.job_id for lease in out["claim"]] == [waiting.job_id]
    assert statements and not [s for s in statements if "SAVEPOINT" in s or "RELEASE" in s]


async def test_a_command_alone_in_its_batch_is_undone_when_it_fails(db_path):
    # A bug in a command rolls the first pass back; the careful pass undoes exactly that
    # command with its savepoint, and the writer goes on.
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            with pytest.raises(InternalError, match="ZeroDivisionError"):
                await writer.execute(WriteThenExplode())
            with pytest.raises(JobNotFound):
                await writer.execute(cmd.Ack("job_0000000000000001", "w", "bad"))
            (kept,) = await writer.execute(cmd.Submit((spec(),)))
            stats = await writer.execute(cmd.Stats())
            statistics = writer.statistics()
    assert committed_ids(db_path) == {parse_job_id(kept.job_id)}
    assert stats == {"q": {"pending": 0, "ready": 1, "leased": 0, "retrying": 0,
                           "succeeded": 0, "dead": 0, "cancelled": 0}}  # fmt: skip
    assert statistics.failed_commits == 0 and statistics.batches == 4


async def test_replies_are_delivered_only_after_their_commit(db_path):
    store = SqliteStore.open(db_path)
    seen_committed: list[bool] = []

    class CheckOnDelivery(Collect):
        def deliver(self, pairs):
            # A second connection sees only committed data.
            ids = committed_ids(db_path)
            for _item, results in pairs:
                seen_committed.extend(parse_job_id(r.job_id) in ids for r in results)
            super().deliver(pairs)

    sink = CheckOnDelivery(20)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            for i in range(20):
                await writer.send(cmd.Submit((spec(),)), sink, tag=i)
            await sink.done.wait()
    assert seen_committed == [True] * 20


async def test_a_failed_commit_answers_every_command_with_an_error(db_path):
    store = SqliteStore.open(db_path)
    real_commit = store.commit
    failures = iter([False, True])  # the gate's batch commits, the next one fails

    def commit_once_failing() -> Changes:
        if next(failures, False):
            raise sqlite3.OperationalError("disk I/O error")
        return real_commit()

    store.commit = commit_once_failing  # type: ignore[method-assign]
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            sink = await one_batch(writer, [(i, cmd.Submit((spec(),))) for i in range(3)])
            stats = await writer.execute(cmd.Stats())
            failed = writer.statistics().failed_commits
    assert all(isinstance(o, InternalError) for o in sink.outcomes.values())
    assert all("not committed" in o.message for o in sink.outcomes.values())
    assert failed == 1
    # Nothing of the failed batch is in the file, and the in-memory counts agree.
    assert committed_ids(db_path) == set()
    assert stats == {}


async def test_concurrent_claimers_never_hold_one_job_twice(db_path):
    store = SqliteStore.open(db_path)
    clock = FakeClock()
    claims: list[tuple[str, str]] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=clock) as writer:
            await writer.execute(cmd.Submit(tuple(spec(payload=str(i)) for i in range(300))))

            async def claimer(n: int) -> None:
                while True:
                    leases = await writer.execute(cmd.Claim(("q",), f"w{n}", 1 + n % 4, 30_000))
                    if not leases:
                        return
                    claims.extend((lease.job_id, lease.token) for lease in leases)

            async with trio.open_nursery() as nursery:
                for n in range(40):
                    nursery.start_soon(claimer, n)
            stats = await writer.execute(cmd.Stats())
    job_ids = [job_id for job_id, _ in claims]
    assert len(job_ids) == 300
    assert len(set(job_ids)) == 300, "a job was leased twice"
    assert len({token for _, token in claims}) == 300
    assert stats["q"]["leased"] == 300 and stats["q"]["ready"] == 0


async def test_concurrent_idempotent_submits_create_one_job(db_path):
    store = SqliteStore.open(db_path)
    results = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:

            async def submit() -> None:
                (result,) = await writer.execute(cmd.Submit((spec(idempotency_key="order-17"),)))
                results.append(result)

            async with trio.open_nursery() as nursery:
                for _ in range(30):
                    nursery.start_soon(submit)
    assert len({r.job_id for r in results}) == 1
    assert sorted(r.duplicate for r in results) == [False] + [True] * 29
    assert len(committed_ids(db_path)) == 1


async def test_stale_token_error_is_raised_by_execute(db_path):
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit((spec(),)))
            (lease,) = await writer.execute(cmd.Claim(("q",), "w", 1, 30_000))
            with pytest.raises(StaleToken):
                await writer.execute(cmd.Ack(lease.job_id, "w", "0" * 32))
            await writer.execute(cmd.Ack(lease.job_id, "w", lease.token))
            info = await writer.execute(cmd.Inspect(lease.job_id))
    assert info.state == JobState.SUCCEEDED


async def test_inspect_takes_an_abbreviated_id_only_with_prefix(db_path):
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock(T0)) as writer:
            (result,) = await writer.execute(cmd.Submit((spec(),)))
            whole = await writer.execute(cmd.Inspect(result.job_id))
            assert await writer.execute(cmd.Inspect(result.job_id[:11], prefix=True)) == whole
            with pytest.raises(JobNotFound):
                await writer.execute(cmd.Inspect(result.job_id[:11]))
            assert await writer.execute(cmd.ShortIds((result.job_id,))) == [result.job_id[:11]]


async def test_the_store_sees_the_injected_clock(db_path):
    store = SqliteStore.open(db_path)
    clock = FakeClock(T0)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=clock) as writer:
            (result,) = await writer.execute(cmd.Submit((spec(delay_ms=5_000),)))
            assert result.state == JobState.PENDING
            clock.now = T0 + 4_999
            assert await writer.execute(cmd.PromoteDue(100)) == 0
            clock.now = T0 + 5_000
            assert await writer.execute(cmd.PromoteDue(100)) == 1
            info = await writer.execute(cmd.Inspect(result.job_id))
    assert info.state == JobState.READY
    assert info.ready_at == T0 + 5_000


async def test_commit_listeners_hear_which_queues_got_ready_jobs(db_path):
    store = SqliteStore.open(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            await writer.execute(cmd.Submit((spec("emails"), spec("later", delay_ms=60_000))))
    ready = set().union(*(c.ready_queues for c in heard))
    due = [c.next_due_at for c in heard if c.next_due_at is not None]
    assert ready == {"emails"}
    assert due == [T0 + 60_000]


# -- job state changes for watchers (Writer.recording) -------------------------------------


def heard_events(heard: list[Changes]) -> list[tuple[str, str, int]]:
    """(queue, state, attempt) of every event the listeners heard, in order."""
    return [(queue, state, attempt) for c in heard for _, queue, state, attempt, *_ in c.events]


async def test_commit_listeners_get_the_events_while_the_writer_records(db_path):
    store = SqliteStore.open(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            await writer.execute(cmd.Submit((spec("off"),)))
            writer.recording = True
            (result,) = await writer.execute(cmd.Submit((spec(),)))
            (lease,) = await writer.execute(cmd.Claim(("q",), "w", 1, 60_000))
            await writer.execute(cmd.Ack(lease.job_id, "w", lease.token))
            writer.recording = False
            await writer.execute(cmd.Submit((spec("off"),)))
    assert [c.events for c in heard] == [
        [],
        [(result.job_id, "q", "ready", 0, T0, None)],
        [(result.job_id, "q", "leased", 1, T0, "ready")],
        [(result.job_id, "q", "succeeded", 1, T0, "leased")],
        [],
    ]


async def test_a_batch_records_all_of_its_changes_or_none(db_path):
    # Recording is read once as a batch starts: turned on halfway, it records from the
    # next batch on, never half of one.
    store = SqliteStore.open(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            await writer.execute(cmd.Submit((spec("leased"),)))
            (lease,) = await writer.execute(cmd.Claim(("leased",), "w", 1, 60_000))
            first = await hold_writer(writer)
            sink = Collect(4)
            second = Gate()
            await writer.send(cmd.Submit((spec("before"),)), sink)
            await writer.send(second, sink)
            await writer.send(cmd.Ack(lease.job_id, "w", lease.token), sink, tag="ack")
            first.release.set()
            # That batch runs its submit, the gate, then the ack (acks last).
            await trio.to_thread.run_sync(second.entered.wait, BOUND_S)
            writer.recording = True  # halfway through it
            await writer.send(cmd.Submit((spec("late"),)), sink)  # the next batch
            second.release.set()
            await sink.done.wait()
            await writer.execute(cmd.Submit((spec("after"),)))
            stats = await writer.execute(cmd.Stats())
    assert sink.outcomes["ack"] is None and stats["leased"]["succeeded"] == 1
    batch = next(c for c in heard if c.ready_queues == {"before"})
    assert batch.events == []
    assert heard_events(heard) == [("late", "ready", 0), ("after", "ready", 0)]


async def test_a_command_undone_in_the_careful_pass_leaves_no_event(db_path):
    store = SqliteStore.open(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            writer.recording = True
            sink = await one_batch(writer, [
                ("kept", cmd.Submit((spec("a"),))),
                ("explode", WriteThenExplode()),
                ("refuse", WriteThenRefuse()),
                ("also kept", cmd.Submit((spec("b"),))),
            ])  # fmt: skip
    assert isinstance(sink.outcomes["explode"], InternalError)
    assert isinstance(sink.outcomes["refuse"], StaleToken)
    # (Both submits ran first, merged: one run of the Submit class.)
    assert heard_events(heard) == [("a", "ready", 0), ("b", "ready", 0)]
    assert [job for c in heard for job, *_ in c.events] == [
        sink.outcomes["kept"][0].job_id,
        sink.outcomes["also kept"][0].job_id,
    ]


async def test_a_batch_of_plain_submits_alone_delivers_its_events(db_path):
    from relay.server.requests import ops

    store = SqliteStore.open(db_path)
    heard: list[Changes] = []
    statements: list[str] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            writer.recording = True
            gate = await hold_writer(writer)
            sink = Collect(3)
            for i in range(3):
                writer.put((ops.SUBMIT, sink, i, trio.current_time(), spec(f"q{i}")))
            store._db.set_trace_callback(statements.append)
            gate.release.set()
            await sink.done.wait()
            store._db.set_trace_callback(None)
    # The gate's batch committed; then the three submits, as one statement alone.
    assert statements[0] == "COMMIT"
    assert len(statements) == 2 and statements[1].startswith("INSERT INTO jobs")
    assert heard_events(heard) == [("q0", "ready", 0), ("q1", "ready", 0), ("q2", "ready", 0)]
    ids = [wire_job_id(sink.outcomes[i]) for i in range(3)]
    assert [job for c in heard for job, *_ in c.events] == ids


def wire_job_id(line: bytes) -> str:
    import orjson

    return orjson.loads(line)["job_id"]


async def test_shutdown_commits_everything_queued_then_refuses(db_path):
    store = SqliteStore.open(db_path)
    sink = Collect(100)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            gate = await hold_writer(writer)
            for i in range(100):
                await writer.send(cmd.Submit((spec(),)), sink, tag=i)
            gate.release.set()
            # Leaving the block closes the channel while all hundred are still queued.
        assert sink.done.is_set()
        with pytest.raises(ShuttingDown):
            await writer.execute(cmd.Stats())
    assert all(not isinstance(o, Exception) for o in sink.outcomes.values())
    assert len(committed_ids(db_path)) == 100
    # The thread closed the store: the WAL was checkpointed into the main file.
    reopened = SqliteStore.open(db_path)
    try:
        assert reopened.queue_stats()["q"]["ready"] == 100
    finally:
        reopened.close()


async def test_a_crashed_writer_answers_what_it_held_and_what_was_queued(db_path):
    @attrs.frozen
    class Crash:
        def apply(self, store: SqliteStore, now: int) -> None:
            raise SystemExit("simulated thread death")

    store = SqliteStore.open(db_path)
    sink = Collect(2)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            gate = await hold_writer(writer)
            await writer.send(cmd.Submit((spec(),)), sink, tag="held")
            await writer.send(Crash(), sink, tag="crash")
            gate.release.set()
            await sink.done.wait()
            with pytest.raises(ShuttingDown):
                await writer.execute(cmd.Stats())
    outcomes = sink.outcomes
    assert isinstance(outcomes["held"], InternalError)
    assert isinstance(outcomes["crash"], InternalError)
    assert committed_ids(db_path) == set()


async def test_a_run_of_submits_becomes_one_store_call(db_path):
    store = SqliteStore.open(db_path)
    calls: list[int] = []
    real_submit = store.jobs_submit

    def counting_submit(specs, now):
        calls.append(len(specs))
        return real_submit(specs, now)

    store.jobs_submit = counting_submit  # type: ignore[method-assign]
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            submits = [(i, cmd.Submit((spec(payload=str(i)), spec()))) for i in range(10)]
            sink = await one_batch(writer, submits)
    assert calls == [20]
    outcomes = sink.outcomes
    assert [len(outcomes[i]) for i in range(10)] == [2] * 10
    ids = [result.job_id for i in range(10) for result in outcomes[i]]
    assert ids == sorted(ids) and len(set(ids)) == 20


async def test_a_failing_submit_in_a_merged_run_fails_alone(db_path):
    from relay.protocol.errors import QueueFull
    from relay.store.base import StoreConfig

    store = SqliteStore.open(db_path, StoreConfig(max_depth=3))
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            sink = await one_batch(writer, [(i, cmd.Submit((spec(),))) for i in range(5)])
            stats = await writer.execute(cmd.Stats())
    outcomes = sink.outcomes
    assert [isinstance(outcomes[i], QueueFull) for i in range(5)] == [False] * 3 + [True] * 2
    assert stats["q"]["ready"] == 3
    assert len(committed_ids(db_path)) == 3


async def test_a_run_of_acks_with_a_stale_one_answers_each_on_its_own(db_path):
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit((spec(), spec())))
            first, second = await writer.execute(cmd.Claim(("q",), "w", 2, 30_000))
            sink = await one_batch(writer, [
                ("first", cmd.Ack(first.job_id, "w", first.token)),
                ("stale", cmd.Ack(second.job_id, "w", "0" * 32)),
                ("second", cmd.Ack(second.job_id, "w", second.token)),
            ])  # fmt: skip
            stats = await writer.execute(cmd.Stats())
    out = sink.outcomes
    assert out["first"] is None and out["second"] is None
    assert isinstance(out["stale"], StaleToken)
    assert stats["q"]["succeeded"] == 2


async def test_when_sqlite_rolls_back_the_transaction_nothing_of_the_batch_stands(db_path):
    store = SqliteStore.open(db_path)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 40}")  # a nearly full disk
    big = SubmitSpec("q", '"' + "x" * 400_000 + '"')
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            sink = await one_batch(writer, [
                ("before", cmd.Submit((spec(),))),
                ("refused", cmd.Ack("job_0000000000000001", "w", "t")),
                ("full", cmd.Submit((big,))),
                ("after", cmd.Submit((spec(),))),
            ])  # fmt: skip
            stats = await writer.execute(cmd.Stats())
    outcomes = sink.outcomes
    # A full disk: every write is answered unavailable; the refusal, which writes nothing,
    # still gets its own answer.
    assert isinstance(outcomes.pop("refused"), JobNotFound)
    assert all(isinstance(o, Unavailable) for o in outcomes.values()), outcomes
    assert committed_ids(db_path) == set()
    assert stats == {}


async def test_the_writer_exit_keeps_its_deadline_when_the_thread_is_stuck(db_path):
    import time

    @attrs.frozen
    class Stuck:
        def apply(self, store: SqliteStore, now: int) -> None:
            time.sleep(3)  # a disk that does not answer

    store = SqliteStore.open(db_path)
    sink = Collect(1)
    started = trio.current_time()
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock(), shutdown_timeout=0.3) as writer:
            await writer.send(Stuck(), sink)
    assert trio.current_time() - started < 2.0


# -- ack_batch: one command, an outcome per ack ------------------------------------------------


def committed_states(path: str) -> dict[int, str]:
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT id, state FROM jobs"))


def kinds(outcomes: list[Any]) -> list[type | None]:
    return [None if outcome is None else type(outcome) for outcome in outcomes]


async def test_an_ack_batch_answers_each_ack_and_commits_only_the_accepted_ones(db_path):
    store = SqliteStore.open(db_path)
    clock = FakeClock()
    unknown = "job_0000000000000001"
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=clock) as writer:
            await writer.execute(cmd.Submit(tuple(spec(payload=str(i)) for i in range(5))))
            a, b, c, d = await writer.execute(cmd.Claim(("q",), "w", 4, 30_000))
            (short,) = await writer.execute(cmd.Claim(("q",), "w", 1, 1_000))
            clock.now = T0 + 1_000  # the instant the short lease ends; the others hold on
            refused = [b.job_id, c.job_id, short.job_id]
            before = [await writer.execute(cmd.Inspect(job_id)) for job_id in refused]
            batch = cmd.AckBatch((
                (a.job_id, "w", a.token, '"a"'),
                (b.job_id, "w", "0" * 32, None),
                (c.job_id, "someone-else", c.token, None),
                (short.job_id, "w", short.token, None),
                (unknown, "w", a.token, None),
                (d.job_id, "w", d.token, '{"n":4}'),
            ))  # fmt: skip
            outcomes = await writer.execute(batch)
            after = [await writer.execute(cmd.Inspect(job_id)) for job_id in refused]
            done = [await writer.execute(cmd.Inspect(x.job_id)) for x in (a, d)]
            stats = await writer.execute(cmd.Stats())
            totals = await writer.execute(cmd.EventTotals())
    assert kinds(outcomes) == [None, StaleToken, StaleToken, LeaseExpired, JobNotFound, None]
    assert [outcomes[1].job_id, outcomes[2].job_id] == [b.job_id, c.job_id]
    assert (outcomes[3].job_id, outcomes[3].expired_at) == (short.job_id, T0 + 1_000)
    assert outcomes[4].job_id == unknown
    # The refused acks changed nothing; the accepted ones hold their own results.
    assert after == before
    assert [(i.state, i.result, i.finished_at, i.lease_expires_at) for i in done] == [
        (JobState.SUCCEEDED, '"a"', T0 + 1_000, None),
        (JobState.SUCCEEDED, '{"n":4}', T0 + 1_000, None),
    ]
    assert stats == {"q": {"pending": 0, "ready": 0, "leased": 3, "retrying": 0,
                           "succeeded": 2, "dead": 0, "cancelled": 0}}  # fmt: skip
    assert totals[("q", "acked")] == 2
    states = committed_states(db_path)
    assert {job_id: states[parse_job_id(job_id)] for job_id in (a.job_id, d.job_id, *refused)} == {
        a.job_id: "succeeded",
        d.job_id: "succeeded",
        b.job_id: "leased",
        c.job_id: "leased",
        short.job_id: "leased",
    }


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (("held", "w"), ("held", "w"), [None, None]),  # the second is a repeated ack
        (("wrong", "w"), ("held", "w"), [StaleToken, None]),
        (("held", "w"), ("wrong", "w"), [None, StaleToken]),
        (("held", "w"), ("held", "someone-else"), [None, StaleToken]),
    ],
)
async def test_a_job_twice_in_an_ack_batch_answers_as_two_acks_in_order(
    db_path, first, second, expected
):
    store = SqliteStore.open(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit((spec(), spec())))
            job, other = await writer.execute(cmd.Claim(("q",), "w", 2, 30_000))

            def ack(which: tuple[str, str], result: str) -> tuple[str, str, str, str]:
                token, worker = which
                return (job.job_id, worker, job.token if token == "held" else "0" * 32, result)

            batch = (ack(first, '"first"'), (other.job_id, "w", other.token, None),
                     ack(second, '"second"'))  # fmt: skip
            outcomes = await writer.execute(cmd.AckBatch(batch))
            info = await writer.execute(cmd.Inspect(job.job_id))
            stats = await writer.execute(cmd.Stats())
            totals = await writer.execute(cmd.EventTotals())
    assert kinds(outcomes) == [expected[0], None, expected[1]]
    assert info.state == JobState.SUCCEEDED
    # The ack that completed the job set the result; a repeat changes nothing.
    assert info.result == ('"first"' if expected[0] is None else '"second"')
    assert stats["q"]["succeeded"] == 2 and stats["q"]["leased"] == 0
    assert totals[("q", "acked")] == 2  # each job moved to succeeded exactly once


async def test_an_ack_batch_is_one_store_call_unless_a_job_is_in_it_twice(db_path):
    store = SqliteStore.open(db_path)
    calls: list[str] = []
    real_many, real_one = store.jobs_ack_many, store.jobs_ack

    def counting_many(acks, now):
        calls.append(f"many:{len(acks)}")
        return real_many(acks, now)

    def counting_one(*args):
        calls.append("one")
        return real_one(*args)

    store.jobs_ack_many = counting_many  # type: ignore[method-assign]
    store.jobs_ack = counting_one  # type: ignore[method-assign]
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit(tuple(spec() for _ in range(4))))
            leases = await writer.execute(cmd.Claim(("q",), "w", 4, 30_000))
            acks = [(lease.job_id, "w", lease.token, None) for lease in leases]
            assert await writer.execute(cmd.AckBatch(tuple(acks[:2]))) == [None] * 2
            assert calls == ["many:2"]
            # A refusal is answered in the same call (the last ack a repeat of an ack
            # of the first batch: ok).
            calls.clear()
            batch = (acks[2], (leases[3].job_id, "w", "0" * 32, None), acks[0])
            outcomes = await writer.execute(cmd.AckBatch(batch))
            assert calls == ["many:3"]
            # A job twice: nothing of the call stands; each ack on its own.
            calls.clear()
            twice = await writer.execute(cmd.AckBatch((acks[1], acks[1])))
            stats = await writer.execute(cmd.Stats())
            totals = await writer.execute(cmd.EventTotals())
    # (SQLite's jobs_ack is itself a run of one: "many:1" after each "one".)
    assert calls[:2] == ["many:2", "one"] and calls.count("one") == 2
    assert kinds(outcomes) == [None, StaleToken, None]
    assert kinds(twice) == [None, None]  # repeats of the completing ack
    assert (stats["q"]["succeeded"], stats["q"]["leased"]) == (3, 1)
    assert totals[("q", "acked")] == 3
    states = committed_states(db_path)
    assert [states[parse_job_id(lease.job_id)] for lease in leases] == ["succeeded"] * 3 + [
        "leased"
    ]


async def test_an_ack_batch_of_max_batch_acks_with_one_refused(db_path):
    store = SqliteStore.open(db_path)
    n = wire.Limits().max_batch
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            await writer.execute(cmd.Submit(tuple(spec() for _ in range(n))))
            leases = await writer.execute(cmd.Claim(("q",), "w", n, 30_000))
            acks = [(lease.job_id, "w", lease.token, None) for lease in leases]
            acks[n // 2] = (leases[n // 2].job_id, "w", "0" * 32, None)
            outcomes = await writer.execute(cmd.AckBatch(tuple(acks)))
            stats = await writer.execute(cmd.Stats())
    assert len(leases) == n
    assert kinds(outcomes) == [None] * (n // 2) + [StaleToken] + [None] * (n - n // 2 - 1)
    assert (stats["q"]["succeeded"], stats["q"]["leased"]) == (n - 1, 1)
    assert committed_states(db_path)[parse_job_id(leases[n // 2].job_id)] == "leased"
