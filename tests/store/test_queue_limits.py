"""A queue's concurrency limit (``max_leased``) and rate limit (``rate``) on both stores:
a claim leases no more than they allow, inside its transaction; a lease's end (ack, fail,
expiry, cancel, release) makes room again and reports the queue as having ready jobs, so a
parked lease wakes; a full rate window's end is a due time the promoter wakes for, and
its pass reports the queue. Durable, and (PostgreSQL) held across servers."""

from __future__ import annotations

import time

import pytest

from relay.protocol.model import Rate, SubmitSpec
from relay.store.base import QueueSettings
from tests.conftest import T0
from tests.store.conformance import Store, Stores, postgres_only

LEASE_MS = 30_000


def submit(store: Store, queue: str = "q", n: int = 1, now: int = T0) -> list[str]:
    specs = [SubmitSpec(queue, f'{{"n": {i}}}') for i in range(n)]
    return [r.job_id for r in store.jobs_submit(specs, now)]


def claim(store: Store, queues: list[str], count: int = 10, now: int = T0, worker: str = "w1"):
    return store.jobs_claim(queues, worker, count, LEASE_MS, now)


def test_a_claim_leases_no_more_than_max_leased(store: Store) -> None:
    jobs = submit(store, n=5)
    store.queue_config("q", {"max_leased": 2}, T0)
    assert [lease.job_id for lease in claim(store, ["q"])] == jobs[:2]
    assert claim(store, ["q"], now=T0 + 1) == []
    # Many claims at once share the room; an unlimited queue beside it is not held back.
    other = submit(store, "other", 2)
    outcomes = store.jobs_claim_many(
        [(["q", "other"], "w2", 5, LEASE_MS, None), (["q"], "w3", 5, LEASE_MS, None)], T0 + 2
    )
    assert [[lease.job_id for lease in leases] for leases in outcomes] == [other, []]
    assert store.queue_stats()["q"]["leased"] == 2


@pytest.mark.parametrize("end", ["ack", "fail", "release", "expiry", "cancel"])
def test_a_lease_that_ends_makes_room_and_reports_the_queue(store: Store, end: str) -> None:
    jobs = submit(store, n=3)
    store.queue_config("q", {"max_leased": 1}, T0)
    [lease] = claim(store, ["q"])
    store.take_changes()
    now = T0 + 10
    if end == "ack":
        store.jobs_ack(lease.job_id, "w1", lease.token, None, now)
    elif end == "fail":
        store.jobs_fail(lease.job_id, "w1", lease.token, "boom", True, now)
    elif end == "release":
        store.jobs_release(lease.job_id, "w1", lease.token, now)
    elif end == "expiry":
        now = T0 + LEASE_MS
        store.leases_reap_expired(now, 100)
    else:
        store.job_cancel(lease.job_id, now, True)
    changes = store.take_changes()
    assert "q" in changes.ready_queues and changes.ready_counts["q"] >= 1
    [again] = claim(store, ["q"], now=now + 1)
    assert again.job_id in jobs
    assert claim(store, ["q"], now=now + 2) == []


def test_an_unlimited_queue_reports_nothing_when_a_lease_ends(store: Store) -> None:
    submit(store, n=2)
    [lease, _] = claim(store, ["q"])
    store.take_changes()
    store.jobs_ack(lease.job_id, "w1", lease.token, None, T0 + 1)
    assert "q" not in store.take_changes().ready_queues


def test_a_rate_window_leases_at_most_its_limit_until_it_closes(store: Store) -> None:
    jobs = submit(store, n=7)
    store.queue_config("q", {"rate": Rate(3, 1_000)}, T0)
    assert [lease.job_id for lease in claim(store, ["q"], 2, T0 + 100)] == jobs[:2]
    assert [lease.job_id for lease in claim(store, ["q"], 5, T0 + 200)] == jobs[2:3]
    store.take_changes()
    assert claim(store, ["q"], 5, T0 + 1_099) == []
    # The window (opened at T0 + 100) is full with ready jobs left: its end is due.
    assert store.take_changes().next_due_at == T0 + 1_100
    assert store.next_due_at() == T0 + 1_100
    # The promoter's pass at its end reports the queue; the next window opens.
    store.jobs_promote_due(T0 + 1_100, 100)
    changes = store.take_changes()
    assert changes.ready_counts["q"] == 3
    assert store.next_due_at() is None
    assert [lease.job_id for lease in claim(store, ["q"], 5, T0 + 1_100)] == jobs[3:6]
    assert claim(store, ["q"], 5, T0 + 2_099) == []
    assert [lease.job_id for lease in claim(store, ["q"], 5, T0 + 2_100)] == jobs[6:]


def test_both_limits_hold_at_once(store: Store) -> None:
    submit(store, n=6)
    store.queue_config("q", {"max_leased": 2, "rate": Rate(3, 1_000)}, T0)
    first = claim(store, ["q"], 5, T0)
    assert len(first) == 2
    store.jobs_ack(first[0].job_id, "w1", first[0].token, None, T0 + 1)
    assert len(claim(store, ["q"], 5, T0 + 2)) == 1  # room for 1: the window's third
    store.jobs_ack(first[1].job_id, "w1", first[1].token, None, T0 + 3)
    assert claim(store, ["q"], 5, T0 + 4) == []  # the window is full
    assert len(claim(store, ["q"], 5, T0 + 1_000)) == 1  # a new window; one leased still


def test_raising_or_removing_a_limit_reports_the_queue(store: Store) -> None:
    submit(store, n=3)
    store.queue_config("q", {"max_leased": 1}, T0)
    claim(store, ["q"])
    store.take_changes()
    store.queue_config("q", {"max_leased": 2}, T0 + 1)
    assert store.take_changes().ready_counts == {"q": 2}
    assert len(claim(store, ["q"], now=T0 + 2)) == 1
    store.queue_config("q", {"max_leased": None}, T0 + 3)
    assert store.take_changes().ready_counts == {"q": 1}
    assert len(claim(store, ["q"], now=T0 + 4)) == 1


def test_limits_and_their_window_survive_reopening(stores: Stores) -> None:
    store = stores.open("a")
    submit(store, n=6)
    store.queue_config("q", {"max_leased": 5, "rate": Rate(2, 60_000)}, T0)
    assert len(claim(store, ["q"], 5, T0)) == 2
    store.close()
    store = stores.open("a")
    assert store.queue_settings(None, 10) == [
        QueueSettings("q", max_leased=5, rate=Rate(2, 60_000))
    ]
    assert claim(store, ["q"], 5, T0 + 1) == []  # the window is still full
    assert len(claim(store, ["q"], 5, T0 + 60_000)) == 2


def test_a_limited_claim_rolled_back_leaves_the_window_as_it_was(store: Store) -> None:
    submit(store, n=4)
    store.queue_config("q", {"rate": Rate(2, 60_000)}, T0)
    store.begin()
    assert len(claim(store, ["q"], 5, T0)) == 2
    store.rollback()
    assert len(claim(store, ["q"], 5, T0 + 1)) == 2


def test_a_closed_full_window_is_no_due_time_while_max_leased_holds_the_queue(
    store: Store,
) -> None:
    # The window (T0 .. T0 + 1000) filled and closed; the one lease is still held. A claim
    # that leases nothing (max_leased) must not make the window's past end a due time,
    # or the promoter would wake at once, report the queue, wake the parked lease, and
    # its claim would do it again, as fast as the writer runs.
    submit(store, n=3)
    store.queue_config("q", {"max_leased": 1, "rate": Rate(1, 1_000)}, T0)
    [_held] = claim(store, ["q"], 5, T0)
    assert store.take_changes().next_due_at == T0 + 1_000  # (full, open, jobs waiting)
    store.jobs_promote_due(T0 + 1_000, 100)  # the promoter, at the window's end
    store.take_changes()
    for now in (T0 + 5_000, T0 + 5_001):
        assert claim(store, ["q"], 5, now) == []
        assert store.take_changes().next_due_at is None
        assert store.next_due_at() is None
        store.jobs_promote_due(now, 100)
        assert store.take_changes().ready_counts == {}


def _claims(queue: str, n: int) -> list:
    return [((queue,), "w", 1, LEASE_MS, None) for _ in range(n)]


@postgres_only
def test_a_claim_never_waits_for_a_limited_queue_another_server_holds(stores: Stores) -> None:
    # Two servers' transactions, each claiming both limited queues in pieces in the other
    # order, and one cancelling a ready job the other's claim may hold: none waits for
    # the other (a wait here deadlocked, or stalled the writer with no time limit).
    a, b = stores.open("shared"), stores.open("shared")
    a.jobs_submit([SubmitSpec(q, f'{{"n": {i}}}') for q in ("q1", "q2") for i in range(10)], T0)
    for queue in ("q1", "q2"):
        a.queue_config(queue, {"max_leased": 100}, T0)
    a.begin()
    b.begin()
    a.jobs_claim_many(_claims("q2", 2), T0 + 1)  # A holds q2's limits
    b.jobs_claim_many(_claims("q1", 2), T0 + 1)  # B holds q1's
    with trio_fail_after(5):
        # Each finds the other's queue held: it takes nothing from it, and does not wait.
        assert a.jobs_claim_many(_claims("q1", 1), T0 + 1) == [[]]
        assert b.jobs_claim_many(_claims("q2", 1), T0 + 1) == [[]]
    b.take_changes()
    b.commit()
    a.commit()
    # A claim that leaves a limited queue with room and ready jobs reports it, so that a
    # lease parked on another server (which found the queue held) wakes.
    a.take_changes()
    [leased] = a.jobs_claim_many([(("q1", "q2"), "w", 1, LEASE_MS, None)], T0 + 2)
    assert [lease.queue for lease in leased] == ["q1"]
    assert a.take_changes().ready_counts == {"q2": 1}


class trio_fail_after:  # (a plain timer: the stores are synchronous)
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self.started
        assert elapsed < self.seconds, f"a claim waited {elapsed:.1f} s"
