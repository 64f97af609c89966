"""The store's record of job state changes (``SqliteStore.recording``, ``Changes.events``),
which the server's ``watch`` sends after each commit.

Driven synchronously with explicit ``now`` values. Outside a transaction each call commits
on its own and its events wait in ``store.changes`` until ``take_changes``; inside one, they
go with ``commit()`` and are dropped with what is rolled back. Every test that takes
``store`` runs on both stores (tests/store/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from relay.protocol.errors import RelayError
from relay.protocol.model import Backoff, JobState, SubmitSpec
from relay.store.base import JobEvent
from relay.store.sqlite import SqliteStore
from tests.conftest import T0
from tests.store.conformance import Store, recovers_on_start, sqlite_only

LEASE_MS = 30_000
NO_JITTER = Backoff("exponential", 1_000, 300_000, jitter=False)


def spec(queue: str = "q", **kw) -> SubmitSpec:
    kw.setdefault("payload", '{"n": 1}')
    return SubmitSpec(queue=queue, **kw)


def submit(store: Store, now: int = T0, queue: str = "q", **kw) -> str:
    return store.jobs_submit([spec(queue, **kw)], now)[0].job_id


def claim(store: Store, now: int, queue: str = "q", lease_ms: int = LEASE_MS):
    (lease,) = store.jobs_claim([queue], "w1", 1, lease_ms, now)
    return lease


def taken(store: Store) -> list[tuple]:
    """The events recorded since the last call, without the state each left (checked on
    its own: test_each_event_says_the_state_the_job_left)."""
    return [event[:5] for event in taken_whole(store)]


def taken_whole(store: Store) -> list[JobEvent]:
    return store.take_changes().events


@pytest.fixture
def rec(store: Store) -> Store:
    """The store, recording."""
    store.recording = True
    return store


# -- the life of a job --------------------------------------------------------------------


def test_each_event_says_the_state_the_job_left(rec):
    """A long life (retried, released, reaped, dead, revived, acked): each event's ``from``
    is the state of the one before it, and a job just made has none."""
    job = submit(rec, T0, max_attempts=3, backoff=NO_JITTER)
    lease = claim(rec, T0 + 1)
    retry_at = rec.jobs_fail(job, "w1", lease.token, "boom", True, T0 + 2).retry_at
    rec.jobs_promote_due(retry_at, 10)
    lease = claim(rec, retry_at)
    rec.jobs_release(job, "w1", lease.token, retry_at + 1)
    claim(rec, retry_at + 2, lease_ms=10)
    assert [r.state for r in rec.leases_reap_expired(retry_at + 20, 10)] == [JobState.READY]
    lease = claim(rec, retry_at + 30)
    rec.jobs_fail(job, "w1", lease.token, "boom", True, retry_at + 31)  # its last attempt
    rec.dead_retry(job, retry_at + 40)
    lease = claim(rec, retry_at + 41)
    rec.jobs_ack(job, "w1", lease.token, None, retry_at + 42)
    events = taken_whole(rec)
    states = [state for _, _, state, *_ in events]
    assert states == ["ready", "leased", "retrying", "ready", "leased", "ready", "leased",
                      "ready", "leased", "dead", "ready", "leased", "succeeded"]  # fmt: skip
    assert [event[5] for event in events] == [None, *states[:-1]]


def test_a_job_retried_then_acked_gives_each_state_it_went_through(rec):
    job = submit(rec, T0, max_attempts=3, backoff=NO_JITTER)
    first = claim(rec, T0 + 1)
    outcome = rec.jobs_fail(job, "w1", first.token, "boom", True, T0 + 2)
    retry_at = outcome.retry_at
    assert retry_at == T0 + 2 + 1_000
    assert rec.jobs_promote_due(retry_at, 10) == 1
    second = claim(rec, retry_at + 1)
    rec.jobs_ack(job, "w1", second.token, None, retry_at + 2)
    assert taken(rec) == [
        (job, "q", "ready", 0, T0),
        (job, "q", "leased", 1, T0 + 1),
        (job, "q", "retrying", 1, T0 + 2),
        (job, "q", "ready", 1, retry_at),
        (job, "q", "leased", 2, retry_at + 1),
        (job, "q", "succeeded", 2, retry_at + 2),
    ]


def test_a_dead_job_retried_is_ready_with_fresh_attempts(rec):
    job = submit(rec, T0, max_attempts=2)
    lease = claim(rec, T0 + 1)
    rec.jobs_fail(job, "w1", lease.token, "fatal", False, T0 + 2)
    assert rec.dead_retry(job, T0 + 3) == 1
    again = claim(rec, T0 + 4)
    assert taken(rec) == [
        (job, "q", "ready", 0, T0),
        (job, "q", "leased", 1, T0 + 1),
        (job, "q", "dead", 1, T0 + 2),
        (job, "q", "ready", 0, T0 + 3),
        (job, "q", "leased", 1, T0 + 4),
    ]
    assert again.attempt == 1


def test_a_job_whose_attempts_run_out_is_dead_at_its_last_attempt(rec):
    job = submit(rec, T0, max_attempts=2, backoff=NO_JITTER)
    lease = claim(rec, T0)
    retry_at = rec.jobs_fail(job, "w1", lease.token, "1", True, T0 + 1).retry_at
    rec.jobs_promote_due(retry_at, 10)
    lease = claim(rec, retry_at)
    rec.jobs_fail(job, "w1", lease.token, "2", True, retry_at + 1)
    assert [(state, attempt) for _, _, state, attempt, _ in taken(rec)] == [
        ("ready", 0),
        ("leased", 1),
        ("retrying", 1),
        ("ready", 1),
        ("leased", 2),
        ("dead", 2),
    ]


def test_dead_retry_of_a_queue_gives_one_ready_event_per_job(rec):
    jobs = []
    for i in range(3):
        jobs.append(submit(rec, T0 + i, "d", max_attempts=1))
        lease = claim(rec, T0 + i, "d")
        rec.jobs_fail(jobs[-1], "w1", lease.token, "x", True, T0 + i)
    submit(rec, T0, "other")
    taken(rec)
    assert rec.dead_retry_queue("d", T0 + 10, 100) == 3
    assert taken(rec) == [(job, "d", "ready", 0, T0 + 10) for job in jobs]


# -- pending and promotion ----------------------------------------------------------------


@pytest.mark.parametrize("when", [{"delay_ms": 10}, {"run_at": T0 + 10}])
def test_a_delayed_job_is_pending_then_ready_when_promoted(rec, when):
    job = submit(rec, T0, **when)
    assert rec.jobs_promote_due(T0 + 9, 10) == 0
    assert taken(rec) == [(job, "q", "pending", 0, T0)]
    assert rec.jobs_promote_due(T0 + 10, 10) == 1
    assert taken(rec) == [(job, "q", "ready", 0, T0 + 10)]


def test_promote_gives_the_jobs_in_the_order_they_fell_due(rec):
    late = submit(rec, T0, "a", delay_ms=20)
    early = submit(rec, T0, "b", delay_ms=10)
    taken(rec)
    assert rec.jobs_promote_due(T0 + 30, 10) == 2
    assert taken(rec) == [(early, "b", "ready", 0, T0 + 30), (late, "a", "ready", 0, T0 + 30)]


# -- release, reap, recover ---------------------------------------------------------------


def test_release_makes_the_job_ready_with_its_attempt_given_back(rec):
    job = submit(rec, T0)
    lease = claim(rec, T0 + 1)
    rec.jobs_release(job, "w1", lease.token, T0 + 2)
    assert taken(rec)[1:] == [(job, "q", "leased", 1, T0 + 1), (job, "q", "ready", 0, T0 + 2)]


def test_reap_of_an_expired_lease_with_attempts_left_makes_it_ready(rec):
    job = submit(rec, T0, max_attempts=2)
    claim(rec, T0, lease_ms=1_000)
    taken(rec)
    assert rec.leases_reap_expired(T0 + 999, 10) == []
    assert taken(rec) == []
    (reaped,) = rec.leases_reap_expired(T0 + 1_000, 10)
    assert taken(rec) == [(job, "q", "ready", 1, T0 + 1_000)]
    assert (reaped.state, reaped.attempt) == ("ready", 1)


def test_reap_of_an_expired_lease_on_the_last_attempt_makes_it_dead(rec):
    job = submit(rec, T0, max_attempts=1)
    claim(rec, T0, lease_ms=1_000)
    taken(rec)
    rec.leases_reap_expired(T0 + 5_000, 10)
    assert taken(rec) == [(job, "q", "dead", 1, T0 + 5_000)]


def test_reap_of_several_gives_each_its_own_outcome(rec):
    spent = submit(rec, T0, "a", max_attempts=1)
    left = submit(rec, T0, "b", max_attempts=3)
    claim(rec, T0, "a", lease_ms=1_000)
    claim(rec, T0, "b", lease_ms=2_000)
    taken(rec)
    assert len(rec.leases_reap_expired(T0 + 3_000, 10)) == 2
    assert taken(rec) == [(spent, "a", "dead", 1, T0 + 3_000), (left, "b", "ready", 1, T0 + 3_000)]


def test_recover_makes_every_leased_job_ready_with_its_attempt_given_back(rec):
    a, b, c = (submit(rec, T0) for _ in range(3))
    rec.jobs_claim(["q"], "w1", 2, LEASE_MS, T0 + 1)
    taken(rec)
    if not recovers_on_start(rec):  # leases are left to expire: no change, no event
        assert rec.leases_recover(T0 + 2) == 0
        assert taken(rec) == []
        return
    assert rec.leases_recover(T0 + 2) == 2
    assert sorted(taken(rec)) == [(a, "q", "ready", 0, T0 + 2), (b, "q", "ready", 0, T0 + 2)]
    assert c  # (still ready: no event)


# -- runs of many -------------------------------------------------------------------------


def test_a_claim_of_several_jobs_gives_one_leased_event_each_in_lease_order(rec):
    jobs = [submit(rec, T0 + i) for i in range(3)]
    leases = rec.jobs_claim(["q"], "w1", 3, LEASE_MS, T0 + 5)
    assert [lease.job_id for lease in leases] == jobs
    assert taken(rec)[3:] == [(job, "q", "leased", 1, T0 + 5) for job in jobs]


def test_claim_many_gives_the_events_claim_by_claim(rec):
    a, b, c = (submit(rec, T0, queue) for queue in ("x", "y", "x"))
    taken(rec)
    outcome = rec.jobs_claim_many(
        [
            (["x"], "w1", 1, LEASE_MS, None),
            (["y"], "w2", 5, LEASE_MS, None),
            (["x"], "w3", 1, LEASE_MS, None),
        ],
        T0 + 1,
    )
    assert [[lease.job_id for lease in leases] for leases in outcome] == [[a], [b], [c]]
    assert taken(rec) == [
        (a, "x", "leased", 1, T0 + 1),
        (b, "y", "leased", 1, T0 + 1),
        (c, "x", "leased", 1, T0 + 1),
    ]


def test_ack_many_gives_the_events_in_the_order_of_the_acks(rec):
    jobs = [submit(rec, T0) for _ in range(3)]
    leases = {lease.job_id: lease for lease in rec.jobs_claim(["q"], "w1", 3, LEASE_MS, T0)}
    taken(rec)
    order = [jobs[2], jobs[0], jobs[1]]
    rec.jobs_ack_many([(job, "w1", leases[job].token, None) for job in order], T0 + 7)
    assert taken(rec) == [(job, "q", "succeeded", 1, T0 + 7) for job in order]


def test_a_repeated_ack_changes_no_state_and_gives_no_event(rec):
    job = submit(rec, T0)
    lease = claim(rec, T0)
    rec.jobs_ack(job, "w1", lease.token, None, T0 + 1)
    taken(rec)
    rec.jobs_ack(job, "w1", lease.token, None, T0 + 2)
    rec.jobs_ack_many([(job, "w1", lease.token, None)], T0 + 3)
    assert taken(rec) == []


# -- submits ------------------------------------------------------------------------------


def test_a_submit_of_many_gives_the_events_in_the_order_of_its_jobs(rec):
    specs = [spec("a"), spec("b", delay_ms=5), spec("c", idempotency_key="k"), spec("a")]
    results = rec.jobs_submit(specs, T0)
    states = ["ready", "pending", "ready", "ready"]
    assert taken(rec) == [
        (result.job_id, s.queue, state, 0, T0)
        for result, s, state in zip(results, specs, states, strict=True)
    ]


def test_a_duplicate_idempotent_submit_gives_no_event(rec):
    first = submit(rec, T0, idempotency_key="k")
    assert taken(rec) == [(first, "q", "ready", 0, T0)]
    results = rec.jobs_submit([spec(idempotency_key="k"), spec(idempotency_key="n")], T0 + 1)
    assert results[0].duplicate and not results[1].duplicate
    assert taken(rec) == [(results[1].job_id, "q", "ready", 0, T0 + 1)]


def test_duplicates_within_one_submit_give_one_event(rec):
    results = rec.jobs_submit([spec(idempotency_key="k")] * 3, T0)
    assert [r.duplicate for r in results] == [False, True, True]
    assert taken(rec) == [(results[0].job_id, "q", "ready", 0, T0)]


@sqlite_only  # (the one-statement submit is SQLite's; PostgreSQL never submits alone)
@pytest.mark.parametrize("n", [3, 300])  # one VALUES statement; json_each beyond 128 rows
def test_the_one_statement_submit_records_its_jobs(rec, n):
    assert not rec.in_transaction
    results = rec.jobs_submit([spec(f"q{i % 2}") for i in range(n)], T0, alone=True)
    assert results is not None and len(results) == n
    assert taken(rec) == [(r.job_id, f"q{i % 2}", "ready", 0, T0) for i, r in enumerate(results)]


def test_a_submit_that_cannot_go_alone_records_nothing(rec):
    assert rec.jobs_submit([spec(delay_ms=5)], T0, alone=True) is None
    assert taken(rec) == []


# -- what changes no state ----------------------------------------------------------------


def test_renew_purge_prune_and_reads_give_no_event(rec):
    kept = submit(rec, T0)
    lease = claim(rec, T0)
    dead = submit(rec, T0, max_attempts=1)
    rec.jobs_fail(dead, "w1", claim(rec, T0).token, "x", False, T0)
    acked = submit(rec, T0)
    rec.jobs_ack(acked, "w1", claim(rec, T0).token, None, T0)
    taken(rec)
    rec.lease_renew(kept, "w1", lease.token, LEASE_MS, T0 + 1)
    rec.job_inspect(kept)
    rec.queue_stats()
    rec.dead_list(None, 10, None)
    assert rec.dead_purge(dead) == 1
    assert rec.jobs_prune(T0 + 30 * 24 * 3600 * 1000, 10) == 1
    assert rec.jobs_claim(["q"], "w1", 1, LEASE_MS, T0 + 2) == []
    assert rec.jobs_promote_due(T0 + 3, 10) == 0
    if not recovers_on_start(rec):
        assert rec.leases_recover(T0 + 4) == 0
        assert taken(rec) == []
        return
    assert rec.leases_recover(T0 + 4) == 1  # (kept: this one is a change)
    assert taken(rec) == [(kept, "q", "ready", 0, T0 + 4)]


def test_a_refused_transition_gives_no_event(rec):
    job = submit(rec, T0)
    lease = claim(rec, T0, lease_ms=1_000)
    taken(rec)
    for attempt in (
        lambda: rec.jobs_ack(job, "w1", "wrong", None, T0 + 1),
        lambda: rec.jobs_fail(job, "w1", lease.token, "x", True, T0 + 1_000),
        lambda: rec.jobs_release(job, "w2", lease.token, T0 + 1),
        lambda: rec.dead_retry(job, T0 + 1),
    ):
        with pytest.raises(RelayError):
            attempt()
    (refusal,) = rec.jobs_ack_many([(job, "w1", "wrong", None)], T0 + 1)
    assert isinstance(refusal, RelayError)
    assert taken(rec) == []


# -- transactions -------------------------------------------------------------------------


def test_a_command_rolled_back_to_its_savepoint_leaves_no_events_of_its_own(rec):
    rec.begin()
    with rec.command():
        first = submit(rec, T0)
    with pytest.raises(ZeroDivisionError), rec.command():
        submit(rec, T0, "gone")
        claim(rec, T0)  # the first job: its lease is undone too
        raise ZeroDivisionError
    with rec.command():
        lease = claim(rec, T0 + 1)
    changes = rec.commit()
    assert changes.events == [
        (first, "q", "ready", 0, T0, None),
        (first, "q", "leased", 1, T0 + 1, "ready"),
    ]
    assert lease.attempt == 1


def test_a_command_that_fails_first_leaves_the_events_before_it(rec):
    rec.begin()
    first = submit(rec, T0)
    with pytest.raises(ZeroDivisionError), rec.command():
        raise ZeroDivisionError
    assert rec.commit().events == [(first, "q", "ready", 0, T0, None)]


def test_a_rolled_back_transaction_leaves_no_events(rec):
    rec.begin()
    submit(rec, T0)
    claim(rec, T0)
    rec.rollback()
    assert rec.changes.events == []
    rec.begin()
    assert rec.commit().events == []


def test_commit_hands_over_the_events_and_starts_afresh(rec):
    rec.begin()
    job = submit(rec, T0)
    assert rec.commit().events == [(job, "q", "ready", 0, T0, None)]
    rec.begin()
    claim(rec, T0 + 1)
    assert rec.commit().events == [(job, "q", "leased", 1, T0 + 1, "ready")]


# -- not recording ------------------------------------------------------------------------


def _life(store: Store) -> int:
    """Every kind of transition once at least; returns the store calls it made."""
    calls = LIFE_CALLS
    job = submit(store, T0, max_attempts=2, backoff=NO_JITTER)
    submit(store, T0, "p", delay_ms=10)
    if store.jobs_submit([spec("alone")] * 3, T0, alone=True) is None:
        # Declined, having written nothing (PostgreSQL); the writer then runs them in its
        # transaction.
        store.jobs_submit([spec("alone")] * 3, T0)
        calls += 1
    lease = claim(store, T0)
    retry_at = store.jobs_fail(job, "w1", lease.token, "x", True, T0).retry_at
    store.jobs_promote_due(retry_at, 10)
    lease = claim(store, retry_at)
    store.jobs_release(job, "w1", lease.token, retry_at)
    lease = claim(store, retry_at, lease_ms=1_000)
    store.leases_reap_expired(retry_at + 1_000, 10)  # the last attempt: dead
    store.dead_retry(job, retry_at + 2_000)
    leases = store.jobs_claim(["alone"], "w1", 3, LEASE_MS, retry_at + 2_000)
    store.jobs_ack(leases[0].job_id, "w1", leases[0].token, None, retry_at + 2_001)
    store.jobs_ack_many([(x.job_id, "w1", x.token, None) for x in leases[1:]], retry_at + 2_001)
    lease = claim(store, retry_at + 2_002)
    if recovers_on_start(store):
        store.leases_recover(retry_at + 2_003)
    else:  # (a lease is given back the same way, attempt and all)
        store.jobs_release(lease.job_id, "w1", lease.token, retry_at + 2_003)
    lease = claim(store, retry_at + 2_004)
    store.jobs_fail(job, "w1", lease.token, "x", False, retry_at + 2_005)
    store.dead_retry_queue("q", retry_at + 2_006, 10)
    return calls


# (queue, state, attempt) of each change _life makes, in order.
LIFE = [
    ("q", "ready", 0), ("p", "pending", 0),
    ("alone", "ready", 0), ("alone", "ready", 0), ("alone", "ready", 0),
    ("q", "leased", 1), ("q", "retrying", 1),
    ("p", "ready", 0), ("q", "ready", 1),  # promoted in the order they fell due
    ("q", "leased", 2), ("q", "ready", 1),  # released: the attempt given back
    ("q", "leased", 2), ("q", "dead", 2),  # reaped on its last attempt
    ("q", "ready", 0),  # dead_retry
    ("alone", "leased", 1), ("alone", "leased", 1), ("alone", "leased", 1),
    ("alone", "succeeded", 1), ("alone", "succeeded", 1), ("alone", "succeeded", 1),
    ("q", "leased", 1), ("q", "ready", 0),  # recovered (or released)
    ("q", "leased", 1), ("q", "dead", 1), ("q", "ready", 0),  # dead_retry_queue
]  # fmt: skip
LIFE_CALLS = 19  # the store calls _life makes (one more where a submit alone is declined)


def test_recording_gives_every_transition_of_a_life(rec):
    _life(rec)
    events = taken(rec)
    assert [(queue, state, attempt) for _, queue, state, attempt, _ in events] == LIFE
    # Each job's events are its own, and the times are those of the calls that made them.
    assert {job for job, queue, *_ in events if queue == "q"} == {events[0][0]}
    assert [at for *_, at in events] == sorted(at for *_, at in events)


class Checked:
    """The store, checking after each call that it recorded no event."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls = 0

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self.store, name)
        if not callable(method):  # (recovers_on_start)
            return method

        def call(*args: object, **kw: object) -> object:
            result = method(*args, **kw)
            self.calls += 1
            assert self.store.changes.events == [], name
            return result

        return call


def test_not_recording_leaves_events_empty_after_every_transition(store):
    assert store.recording is False
    checked = Checked(store)
    calls = _life(checked)  # type: ignore[arg-type]
    assert checked.calls == calls
    assert store.take_changes().events == []
    store.begin()
    _life(store)
    assert store.commit().events == []


def test_recording_adds_no_statement():  # (SQLite's statements, through its trace callback)
    def statements(recording: bool) -> list[str]:
        fresh = SqliteStore.open(":memory:")
        fresh.recording = recording
        traced: list[str] = []
        fresh._db.set_trace_callback(traced.append)
        _life(fresh)
        fresh._db.set_trace_callback(None)
        fresh.close()
        # (Each statement by its start: the rest holds values, lease tokens among them.)
        return [sql[:60] for sql in traced]

    off, on = statements(False), statements(True)
    assert len(on) == len(off)
    # The one difference: promote's read of the due rows takes their attempts too.
    differ = [(a, b) for a, b in zip(off, on, strict=True) if a != b]
    assert differ == [
        (
            "SELECT json_group_array(json_array(id, queue, state)) FROM (",
            "SELECT json_group_array(json_array(id, queue, state, attempt",
        )
    ]
