"""The request ops (relay/server/ops.py) through a real writer thread: how a batch of them
runs, and the reply lines the writer makes."""

from __future__ import annotations

from typing import Any

import orjson
import trio

from relay.model import SubmitSpec, parse_job_id
from relay.server import ops
from relay.store import commands as cmd
from relay.store.sqlite import SqliteStore, StoreConfig
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


async def test_submits_and_leases_of_one_batch_run_submits_first(tmp_path):
    # A lease sent before a submit of the same batch still finds its job: every request of
    # a batch was sent before any of its replies, so any order of them is valid.
    db = str(tmp_path / "relay.db")
    lease = ops.PendingLease(
        connection=None, queues=("q",), worker_id="w", count=1, lease_ms=30_000,
        deadline=0.0, max_bytes=None,
    )  # fmt: skip
    replies, _, stats = await run_batch(db, [(ops.CLAIM, lease), (ops.SUBMIT, spec())])
    (job,) = decoded(replies[0])["jobs"]
    assert job["job_id"] == decoded(replies[1])["job_id"]
    assert stats["q"]["leased"] == 1


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
