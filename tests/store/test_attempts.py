"""A job's attempt history on both stores: every attempt with its start, end, worker,
outcome, error and traceback, as ``job_inspect`` gives it; and its bound, ATTEMPTS_KEPT
ended attempts per job, in rows as well as in what is shown.

Each end of an attempt is here: ack, fail (with and without a traceback), lease expiry,
execution timeout, release, cancel while leased, and the recovery of leases at start.
"""

from __future__ import annotations

import pytest

from relay.protocol.model import (
    TIMEOUT_GRACE_MS,
    AttemptEntry,
    AttemptOutcome,
    Backoff,
    ErrorEntry,
    JobState,
    timeout_error,
)
from relay.store.base import ATTEMPTS_KEPT, LEASE_EXPIRED_ERROR, RESTART_ERROR
from tests.conftest import T0
from tests.store.conformance import recovers_on_start, scalar
from tests.store.test_sqlite import claim_one, submit

Out = AttemptOutcome
TRACEBACK = 'Traceback (most recent call last):\n  File "jobs.py", line 3\nValueError: 7'


def history_rows(store, job: str) -> int:
    return scalar(store, "SELECT count(*) FROM job_errors WHERE job_id = ?", int(job[4:], 16))


def test_every_end_of_an_attempt_is_in_the_history_with_its_start_worker_and_end(store):
    timeout = 10_000
    job = submit(store, max_attempts=10, backoff=Backoff.fixed(0), timeout_ms=timeout)
    # 1: failed, with a traceback, on w1.
    lease = claim_one(store, T0, worker="w1")
    store.jobs_fail(job, "w1", lease.token, "ValueError: 7", True, T0 + 5, TRACEBACK)
    store.jobs_promote_due(T0 + 5, 10)
    # 2: its lease expired on w2 (a lease shorter than the timeout).
    claim_one(store, T0 + 10, worker="w2", lease_ms=100)
    store.leases_reap_expired(T0 + 110, 10)
    # 3: timed out on w3 (its lease reaches the attempt's deadline).
    claim_one(store, T0 + 200, worker="w3", lease_ms=60_000)
    deadline = T0 + 200 + timeout + TIMEOUT_GRACE_MS
    store.leases_reap_expired(deadline, 10)
    # 4: released by w4: the attempt number is given back and used again by w5.
    lease = claim_one(store, deadline + 1, worker="w4")
    store.jobs_release(job, "w4", lease.token, deadline + 3)
    lease = claim_one(store, deadline + 4, worker="w5")
    running = store.job_inspect(job)
    assert running.attempts[-1] == AttemptEntry(4, Out.RUNNING, deadline + 4, None, "w5")
    store.jobs_ack(job, "w5", lease.token, None, deadline + 9)

    info = store.job_inspect(job)
    assert info.attempts == (
        AttemptEntry(1, Out.FAILED, T0, T0 + 5, "w1", "ValueError: 7", TRACEBACK),
        AttemptEntry(2, Out.EXPIRED, T0 + 10, T0 + 110, "w2", LEASE_EXPIRED_ERROR),
        AttemptEntry(3, Out.TIMED_OUT, T0 + 200, deadline, "w3", timeout_error(timeout)),
        AttemptEntry(4, Out.RELEASED, deadline + 1, deadline + 3, "w4"),
        AttemptEntry(4, Out.SUCCEEDED, deadline + 4, deadline + 9, "w5"),
    )
    assert info.attempts_dropped == 0
    # ``errors`` is as it was: the erring attempts only, without the release.
    assert info.errors == (
        ErrorEntry(1, "ValueError: 7", T0 + 5, TRACEBACK),
        ErrorEntry(2, LEASE_EXPIRED_ERROR, T0 + 110),
        ErrorEntry(3, timeout_error(timeout), deadline),
    )
    # The running and the succeeded attempt are the job row's: only ended ones have rows.
    assert history_rows(store, job) == 4


def test_a_job_never_leased_has_no_attempts_and_a_dead_one_ends_failed(store):
    job = submit(store, max_attempts=1)
    assert store.job_inspect(job).attempts == ()
    lease = claim_one(store, T0 + 1, worker="w1")
    store.jobs_fail(job, "w1", lease.token, "boom", False, T0 + 2)
    info = store.job_inspect(job)
    assert info.state == JobState.DEAD
    assert info.attempts == (AttemptEntry(1, Out.FAILED, T0 + 1, T0 + 2, "w1", "boom"),)
    # A dead job retried starts its attempts again; its history stays.
    store.dead_retry(job, T0 + 3)
    lease = claim_one(store, T0 + 4, worker="w2")
    assert store.job_inspect(job).attempts[-1] == AttemptEntry(1, Out.RUNNING, T0 + 4, None, "w2")
    assert len(store.job_inspect(job).attempts) == 2


def test_a_job_cancelled_while_leased_ends_its_attempt_cancelled(store):
    job = submit(store)
    claim_one(store, T0 + 1, worker="w1")
    store.job_cancel(job, T0 + 7)
    info = store.job_inspect(job)
    assert info.attempts == (AttemptEntry(1, Out.CANCELLED, T0 + 1, T0 + 7, "w1"),)
    assert info.errors == ()
    # A whole queue's cancel as well; a job cancelled before it started has no attempt.
    leased, ready = submit(store, T0 + 8), submit(store, T0 + 9)
    claim_one(store, T0 + 10, worker="w2")
    assert store.job_cancel_queue("q", ["ready", "leased"], T0 + 11, 100) == 2
    assert store.job_inspect(leased).attempts == (
        AttemptEntry(1, Out.CANCELLED, T0 + 10, T0 + 11, "w2"),
    )
    assert store.job_inspect(ready).attempts == ()


def test_a_lease_recovered_at_start_ends_its_attempt_interrupted(store):
    job = submit(store)
    claim_one(store, T0 + 1, worker="w1", lease_ms=1_000_000)
    if not recovers_on_start(store):
        pytest.skip("PostgreSQL leaves leases to expire: nothing is recovered")
    assert store.leases_recover(T0 + 50) == 1
    info = store.job_inspect(job)
    interrupted = AttemptEntry(1, Out.INTERRUPTED, T0 + 1, T0 + 50, "w1", RESTART_ERROR)
    assert info.attempts == (interrupted,)
    assert info.errors == (ErrorEntry(1, RESTART_ERROR, T0 + 50),)


@pytest.mark.parametrize("end", ["fail", "expire", "release"])
def test_a_job_keeps_at_most_attempts_kept_ended_attempts_and_says_how_many_went(store, end):
    n = ATTEMPTS_KEPT + 8
    job = submit(store, max_attempts=1000, backoff=Backoff.fixed(0))
    now = T0
    for i in range(n):
        lease = claim_one(store, now, worker=f"w{i}", lease_ms=10)
        if end == "fail":
            store.jobs_fail(job, f"w{i}", lease.token, f"failure {i}", True, now + 1)
            store.jobs_promote_due(now + 1, 10)
        elif end == "expire":
            store.leases_reap_expired(now + 10, 10)
        else:
            store.jobs_release(job, f"w{i}", lease.token, now + 1)
        assert history_rows(store, job) == min(i + 1, ATTEMPTS_KEPT)
        now += 20
    info = store.job_inspect(job)
    assert len(info.attempts) == ATTEMPTS_KEPT
    assert info.attempts_dropped == n - ATTEMPTS_KEPT
    assert [a.worker_id for a in info.attempts] == [f"w{i}" for i in range(8, n)]
    if end == "fail":
        assert [e.error for e in info.errors] == [f"failure {i}" for i in range(8, n)]
    # The attempt running now comes on top of the ended ones kept.
    claim_one(store, now, worker="last")
    info = store.job_inspect(job)
    assert len(info.attempts) == ATTEMPTS_KEPT + 1
    assert info.attempts[-1].outcome == Out.RUNNING
    assert info.attempts_dropped == n - ATTEMPTS_KEPT


def test_the_attempts_of_a_dead_list_page_are_those_of_inspect(store):
    job = submit(store, max_attempts=1)
    lease = claim_one(store, T0, worker="w1")
    store.jobs_fail(job, "w1", lease.token, "boom", True, T0 + 1, TRACEBACK)
    [info], _ = store.dead_list("q", 10, None)
    assert info.attempts == store.job_inspect(job).attempts
