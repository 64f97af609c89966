"""The request ops (relay/server/requests/ops.py) through a real writer thread: how a batch of them
runs, and the reply lines the writer makes."""

from __future__ import annotations

from typing import Any

import orjson
import trio

from relay.protocol.model import SubmitSpec, parse_job_id
from relay.server.requests import ops
from relay.server.requests.auth import Role
from relay.store import commands as cmd
from relay.store.base import StoreConfig
from relay.store.sqlite import SqliteStore
from relay.store.writer import open_writer
from tests.store.test_writer import BOUND_S, Collect, FakeClock, committed_ids, hold_writer


def spec(queue: str = "q", **kw: Any) -> SubmitSpec:
    return SubmitSpec(queue, kw.pop("payload", "{}"), **kw)


async def run_batch(db_path: str, items: list[tuple[Any, Any]], **config: Any):
    """Put ``items`` ((op, args) pairs) behind a held writer, so that they form one batch;
    their replies by position, the SQL statements the batch ran, and the counts after."""
    store = SqliteStore.open(db_path, StoreConfig(**config))
    statements: list[str] = []
    sink = Collect(len(items))
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            gate = await hold_writer(writer)
            store._db.set_trace_callback(statements.append)
            for i, (op, args) in enumerate(items):
                writer.put((op, sink, i, trio.current_time(), args))
            gate.release.set()
            await sink.done.wait()
            store._db.set_trace_callback(None)
            stats = await writer.execute(cmd.Stats())
    assert statements[0] == "COMMIT"  # the gate's own batch, which was open meanwhile
    return sink.outcomes, statements[1:], stats


class Live:
    """A connection whose client is there."""

    closed = False
    role = Role.WORKER

    def still_wanted(self) -> bool:
        return True


def decoded(reply: bytes) -> dict[str, Any]:
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1
    return orjson.loads(reply)


async def test_a_batch_of_plain_submits_is_one_statement_that_commits_alone(tmp_path):
    db = str(tmp_path / "relay.db")
    items = [(ops.SUBMIT, spec(payload=str(i))) for i in range(5)]
    replies, statements, stats = await run_batch(db, items)
    sql = [s for s in statements if not s.startswith("PRAGMA")]
    assert len(sql) == 1 and sql[0].startswith("INSERT INTO jobs")
    fields = [decoded(replies[i]) for i in range(5)]
    assert [f["id"] for f in fields] == list(range(5))
    assert all(f["ok"] and f["state"] == "ready" and f["duplicate"] is False for f in fields)
    assert committed_ids(db) == {parse_job_id(f["job_id"]) for f in fields}
    assert stats["q"]["ready"] == 5


async def test_a_batch_with_a_keyed_submit_runs_in_a_transaction(tmp_path):
    db = str(tmp_path / "relay.db")
    items = [
        (ops.SUBMIT, spec(idempotency_key="k")),
        (ops.SUBMIT, spec(idempotency_key="k")),
        (ops.SUBMIT, spec()),
    ]
    replies, statements, stats = await run_batch(db, items)
    assert statements[0] == "BEGIN IMMEDIATE" and statements[-1] == "COMMIT"
    first, second, third = (decoded(replies[i]) for i in range(3))
    assert second["job_id"] == first["job_id"] and second["duplicate"] is True
    assert third["job_id"] != first["job_id"] and stats["q"]["ready"] == 2


async def test_a_full_queue_answers_each_submit_of_a_plain_batch_on_its_own(tmp_path):
    db = str(tmp_path / "relay.db")
    items = [(ops.SUBMIT, spec()) for _ in range(5)]
    replies, _, stats = await run_batch(db, items, max_depth=3)
    codes = [decoded(replies[i]).get("error", {}).get("code") for i in range(5)]
    assert codes == [None] * 3 + ["queue_full"] * 2
    assert stats["q"]["ready"] == 3 and len(committed_ids(db)) == 3


async def test_submit_batches_alone_keep_each_request_s_results(tmp_path):
    db = str(tmp_path / "relay.db")
    items = [(ops.SUBMIT_BATCH, (spec(), spec())), (ops.SUBMIT_BATCH, (spec(queue="r"),))]
    replies, statements, stats = await run_batch(db, items)
    assert [s for s in statements if "BEGIN" in s] == []
    first, second = decoded(replies[0]), decoded(replies[1])
    assert len(first["results"]) == 2 and len(second["results"]) == 1
    assert stats["q"]["ready"] == 2 and stats["r"]["ready"] == 1


async def test_a_lease_claims_what_was_ready_before_its_batch(tmp_path):
    # Leases run first in a batch, whatever the order the requests came in (every request
    # of a batch was sent before any of its replies, so any order is valid): a lease does
    # not take the job that a submit of its own batch makes (a long-poll would park, and
    # that batch's commit would wake it), so one queued just before its client went takes
    # none of them.
    db = str(tmp_path / "relay.db")
    lease = ops.PendingLease(
        connection=Live(), queues=("q",), worker_id="w", count=1, lease_ms=30_000,
        deadline=0.0, max_bytes=None,
    )  # fmt: skip
    replies, _, stats = await run_batch(db, [(ops.SUBMIT, spec()), (ops.CLAIM, lease)])
    assert decoded(replies[1])["jobs"] == []
    assert stats["q"]["ready"] == 1


async def test_a_batch_of_more_plain_jobs_than_one_values_statement_is_still_one(tmp_path):
    db = str(tmp_path / "relay.db")
    texts = [
        orjson.dumps({"i": i, "s": 'quote " back \\ é ✓ \n tab\t'}).decode() for i in range(300)
    ]
    items = [(ops.SUBMIT_BATCH, tuple(spec(payload=t) for t in texts[:200])),
             (ops.SUBMIT_BATCH, tuple(spec(payload=t) for t in texts[200:]))]  # fmt: skip
    replies, statements, stats = await run_batch(db, items)
    sql = [s for s in statements if not s.startswith("PRAGMA")]
    assert len(sql) == 1 and "json_each" in sql[0]
    ids = [r["job_id"] for i in range(2) for r in decoded(replies[i])["results"]]
    assert len(ids) == 300 and ids == sorted(ids)
    store = SqliteStore.open(db)
    try:
        assert [store.job_inspect(job_id).payload for job_id in ids] == texts
    finally:
        store.close()
    assert stats["q"]["ready"] == 300


class Gone:
    """A connection whose client stopped sending (as Session.still_wanted tells it), not
    yet closed."""

    closed = False
    role = Role.WORKER

    def still_wanted(self) -> bool:
        return False


async def test_a_woken_long_poll_of_a_client_that_went_claims_nothing(tmp_path):
    db = str(tmp_path / "relay.db")
    store = SqliteStore.open(db)
    store.jobs_submit([spec(), spec()], 0)
    store.close()

    def lease(woken: bool) -> ops.PendingLease:
        return ops.PendingLease(
            connection=Gone(), queues=("q",), worker_id="w", count=1, lease_ms=30_000,
            deadline=1e9, max_bytes=None, woken=woken,
        )  # fmt: skip

    replies, _, stats = await run_batch(db, [(ops.CLAIM, lease(True)), (ops.CLAIM, lease(False))])
    assert replies[0] == []  # no jobs, left for the trio thread to answer
    assert len(decoded(replies[1])["jobs"]) == 1  # a first claim is not asked
    assert stats["q"]["leased"] == 1 and stats["q"]["ready"] == 1


async def test_a_batch_that_fails_after_its_statement_committed_is_not_run_again(
    tmp_path, monkeypatch
):
    db = str(tmp_path / "relay.db")
    real_move = SqliteStore._move
    failures = [ZeroDivisionError("after the insert")]

    def move_once_failing(self, queue, src, dst, n=1):
        if failures:
            raise failures.pop()
        real_move(self, queue, src, dst, n)

    monkeypatch.setattr(SqliteStore, "_move", move_once_failing)
    replies, _, stats = await run_batch(db, [(ops.SUBMIT, spec()) for _ in range(3)])
    assert [decoded(replies[i])["error"]["code"] for i in range(3)] == ["internal"] * 3
    assert len(committed_ids(db)) == 3  # made once, not again by the transaction's path
    assert stats["q"]["ready"] == 3  # and counted (again, from the table)


async def test_a_batch_of_plain_submits_over_a_frame_s_worth_runs_in_a_transaction(tmp_path):
    db = str(tmp_path / "relay.db")
    big = '"' + "x" * 200_000 + '"'
    _, statements, stats = await run_batch(db, [(ops.SUBMIT, spec(payload=big))] * 6)
    assert statements[0] == "BEGIN IMMEDIATE" and "json_each" not in " ".join(statements)
    assert stats["q"]["ready"] == 6 and len(committed_ids(db)) == 6


async def test_no_lease_claims_for_a_closed_connection(tmp_path):
    db = str(tmp_path / "relay.db")
    store = SqliteStore.open(db)
    store.jobs_submit([spec()], 0)
    store.close()
    closed = Live()
    closed.closed = True
    lease = ops.PendingLease(
        connection=closed, queues=("q",), worker_id="w", count=1, lease_ms=30_000,
        deadline=0.0, max_bytes=None,
    )  # fmt: skip
    replies, _, stats = await run_batch(db, [(ops.CLAIM, lease)])
    assert decoded(replies[0])["jobs"] == [] and stats["q"]["ready"] == 1
