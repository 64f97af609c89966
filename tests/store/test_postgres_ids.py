"""Job ids that a PostgreSQL insert draws itself (``jobs_submit_later``), as the writer's
submits do: the answers come with the transaction's next round trip, and must be those of
the rows made, in the batch's order, ordered across servers, and as fresh in their time
part as ids drawn first."""

from __future__ import annotations

import pytest

from relay.protocol.model import DEFAULT_MAX_ATTEMPTS, ID_SEQ_BITS, Backoff, SubmitSpec
from relay.store.postgres import jobs as jobs_sql
from relay.store.postgres import notify
from relay.store.postgres.jobs import ID_LAG_MS
from tests.conftest import T0
from tests.store.test_postgres import FAILING_NOTIFY, LEASE_MS, RoundTrips, specs


def _key(job_id: str) -> int:
    return int(job_id[4:], 16)


def _submit_later(store, batch, now):
    """``jobs_submit_later`` in a transaction of the writer's; (answers before the commit,
    answers after it)."""
    store.begin()
    later = store.jobs_submit_later(batch, now)
    before = later.results
    store.commit()
    return before, later.results


def test_an_insert_draws_the_ids_of_its_jobs_in_their_order_and_answers_with_the_commit(
    servers,
):
    store = servers()
    [first] = store.jobs_submit(specs(1), T0)  # (the sequence is seen: fresh for a while)
    batch = [SubmitSpec("q", f'{{"n": {i}}}') for i in range(500)]
    batch += [SubmitSpec("d", '"later"', delay_ms=5_000), SubmitSpec("b", "1", timeout_ms=9)]
    before, after = _submit_later(store, batch, T0 + 1)
    assert before is None  # (no round trip of their own)
    keys = [_key(result.job_id) for result in after]
    assert keys == sorted(set(keys)) and keys[0] > _key(first.job_id)
    assert [result.state.value for result in after] == ["ready"] * 500 + ["pending", "ready"]
    rows = dict(store._db.execute("SELECT id, payload FROM jobs WHERE id = ANY(%s)", (keys,)))
    assert [rows[key] for key in keys] == [spec.payload for spec in batch]
    info = store.job_inspect(after[-2].job_id)
    assert (info.queue, info.state.value, info.run_at) == ("d", "pending", T0 + 1 + 5_000)
    assert store.job_inspect(after[-1].job_id).timeout_ms == 9
    stats = store.queue_stats()
    assert (stats["q"]["ready"], stats["d"]["pending"]) == (501, 1)


def test_the_events_of_drawn_ids_keep_their_place_among_the_transactions_events(servers):
    store = servers()
    store.jobs_submit(specs(1, "a"), T0)
    [lease] = store.jobs_claim(["a"], "w", 1, LEASE_MS, T0)
    store.begin()
    store.recording = True
    store.jobs_ack(lease.job_id, "w", lease.token, None, T0 + 1)
    later = store.jobs_submit_later(specs(2), T0 + 1)
    [leased] = store.jobs_claim(["q"], "w", 1, LEASE_MS, T0 + 1)  # (a read: sends the insert)
    assert later.results is not None
    changes = store.commit()
    made = [result.job_id for result in later.results]
    assert [(event[0], event[2]) for event in changes.events] == [
        (lease.job_id, "succeeded"),
        (made[0], "ready"),
        (made[1], "ready"),
        (leased.job_id, "leased"),
    ]
    assert leased.job_id == made[0]


def test_drawn_ids_from_servers_whose_clocks_differ_are_distinct_and_in_order(servers):
    ahead, behind = servers(), servers()
    ahead.jobs_submit(specs(1), T0 + 60_000)
    behind.jobs_submit(specs(1), T0 - 60_000)
    ids = []
    for i in range(20):
        store, now = (ahead, T0 + 60_000) if i % 2 else (behind, T0 - 60_000)
        before, after = _submit_later(store, specs(3), now + i)
        assert before is None
        ids += [result.job_id for result in after]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_ids_are_read_first_once_the_sequence_may_have_fallen_behind(servers):
    """The sequence only counts: once its last id seen is ID_LAG_MS older than ``now``,
    a submit reads ids first (and moves the sequence up if it must), so that an id's time
    part is never more than ID_LAG_MS behind."""
    store = servers()
    store.jobs_submit(specs(1), T0)
    now = T0 + 10 * ID_LAG_MS
    before, after = _submit_later(store, specs(2), now)
    assert before == after  # (known at once: read first)
    assert _key(after[0].job_id) >> ID_SEQ_BITS >= now - ID_LAG_MS
    before, _ = _submit_later(store, specs(2), now + 1)
    assert before is None  # (and fresh again)


@pytest.mark.parametrize(
    "spec",
    [SubmitSpec("q", "1", idempotency_key="k"), SubmitSpec("q", "1", unique_key="u")],
    ids=["idempotency-key", "unique-key"],
)
def test_a_batch_with_a_key_reads_its_ids_first(servers, spec):
    store = servers()
    store.jobs_submit(specs(1), T0)
    before, after = _submit_later(store, [SubmitSpec("q", "0"), spec], T0 + 1)
    assert before is not None and before == after
    # (and a second one is its duplicate, answered without writing)
    _, again = _submit_later(store, [spec], T0 + 2)
    assert again[0].job_id == after[1].job_id and again[0].duplicate


def test_a_failed_transaction_leaves_drawn_answers_unknown_and_makes_nothing(servers):
    store = servers()
    store.jobs_submit(specs(1), T0)
    store.begin()
    later = store.jobs_submit_later([SubmitSpec("q", "1", backoff=Backoff("fixed", 1, 1))], T0)
    store._write_later("SELECT 1 / 0")
    with pytest.raises(Exception, match="division by zero"):
        store.commit()
    store.rollback()
    assert later.results is None
    assert store.queue_stats()["q"]["ready"] == 1
    assert store._db.execute("SELECT count(*) FROM jobs").fetchone() == (1,)


def test_a_drawn_submit_takes_one_round_trip_with_its_commit(servers, monkeypatch):
    store = servers()
    store.jobs_submit(specs(1), T0)
    trips = RoundTrips(store, monkeypatch)
    for n in (1, 64):
        before = trips.n
        assert _submit_later(store, specs(n), T0 + 1)[0] is None
        assert trips.n - before == 1  # (BEGIN, the insert, the counts, COMMIT)


def test_a_drawn_submit_is_answered_when_only_its_notification_fails(servers, monkeypatch, caplog):
    store, other = servers(), servers()
    other.waiters_put(["q"], [], T0 + 60_000, T0)  # (so that the commit notifies)
    store.jobs_submit(specs(1), T0)
    monkeypatch.setattr(notify, "NOTIFY_IF_WAITED", FAILING_NOTIFY["as-it-runs"])
    before, after = _submit_later(store, specs(2), T0 + 1)
    assert before is None and "a commit's notification could not be sent" in caplog.text
    assert [store.job_inspect(result.job_id).payload for result in after] == [
        spec.payload for spec in specs(2)
    ]


def test_a_committed_batch_stands_when_taking_a_result_fails(servers, caplog):
    """A ``then`` that raises once the commit has gone through (a bug) is logged; the
    commit is not reported as failed, and the other results are still handed over."""
    store = servers()
    store.jobs_submit(specs(1), T0)
    store.begin()

    def broken(result: object) -> None:
        raise RuntimeError("a bug")

    store._write_later("SELECT 1", None, broken)
    later = store.jobs_submit_later(specs(2), T0 + 1)
    store.commit()
    assert "taking the result of a committed write failed" in caplog.text
    assert later.results is not None and len(later.results) == 2
    assert store.queue_stats()["q"]["ready"] == 3


_ROW = (
    "SELECT queue, state, priority, payload, attempt, max_attempts, backoff_kind, "
    "backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at, run_at, "
    "idempotency_key, timeout_ms FROM jobs WHERE id = %s"
)


@pytest.mark.parametrize("given", [False, True], ids=["left-out", "given"])
def test_a_job_submitted_alone_is_the_row_a_batch_would_make_with_its_queues_defaults(
    servers, monkeypatch, given
):
    """A submit of one job takes an insert of its own (four values, not arrays): its row
    is the one the batch's insert makes of the same spec, its queue's defaults, as this
    transaction sees them, and the protocol's included; its id is answered and fresh."""
    store = servers()
    store.jobs_submit(specs(1), T0)
    store.queue_config(
        "set",
        {"default_retries": 6, "default_backoff": Backoff("fixed", 250, 250, False),
         "default_timeout_ms": 9_000},
        T0,
    )  # fmt: skip
    trips = RoundTrips(store, monkeypatch)
    rows = []
    for queue in ("set", "unset"):
        spec = SubmitSpec(queue, '{"n": 1}', priority=2, max_attempts=4 if given else None)
        before = trips.n
        (alone,) = _submit_later(store, [spec], T0 + 5)[1]
        assert trips.n - before == 1  # (BEGIN, the insert, the counts, COMMIT)
        pair = _submit_later(store, [spec, spec], T0 + 5)[1]
        assert _key(pair[0].job_id) > _key(alone.job_id)
        made = [store._db.execute(_ROW, (_key(r.job_id),)).fetchone() for r in (alone, *pair)]
        assert made[0] == made[1] == made[2]
        rows.append(made[0])
    (_, _, _, _, _, attempts, kind, base, top, jitter, *_, timeout), unset = rows
    assert (attempts, kind, base, top, jitter, timeout) == (
        4 if given else 7,
        "fixed",
        250,
        250,
        False,
        9_000,
    )
    assert unset[5] == (4 if given else DEFAULT_MAX_ATTEMPTS) and unset[-1] is None
    assert store.queue_stats()["set"]["ready"] == 3 == store.queue_stats()["unset"]["ready"]
    # (The one-job insert made the first of each, the batch's the others.)
    assert (jobs_sql._INSERT_ONE, False) in store._pipe._statements
