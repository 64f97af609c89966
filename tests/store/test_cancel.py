"""Cancel, on both stores: one job (``job_cancel``) and a queue's (``job_cancel_queue``).

Driven synchronously with explicit ``now`` values, as tests/store/test_sqlite.py is. What is
checked comes from the rules (docs/protocol.md, "cancel"): a job that has not finished
becomes cancelled, a terminal state; a leased one's lease is void, so its token is answered
``Cancelled`` and changes nothing, while any other token stays stale; a finished job cannot
be cancelled; the time-driven passes never touch a cancelled job, and retention prunes it.
"""

from __future__ import annotations

import pytest

from relay.protocol.errors import Cancelled, InvalidState, JobNotFound, StaleToken, Unauthorized
from relay.protocol.model import JobState, parse_job_id
from relay.store.base import StoreConfig
from relay.store.view import EVENTS, STATES
from tests.conftest import T0
from tests.store.conformance import Store, Stores, scalar
from tests.store.test_sqlite import (
    DAY,
    LEASE_MS,
    OPS,
    claim_one,
    make_dead,
    recount,
    snapshot,
    state,
    submit,
)

PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED, DEAD = JobState.RETRYING, JobState.SUCCEEDED, JobState.DEAD
CANCELLED = JobState.CANCELLED
NOT_STARTED = ("pending", "ready", "retrying")
EVERY_UNFINISHED = ("pending", "ready", "retrying", "leased")
# The order to make them in: a claim takes the ready job made before, so started ones first.
MAKING_ORDER = ("retrying", "leased", "ready", "pending")


def make(store: Store, wanted: str, now: int = T0, queue: str = "q") -> str:
    """A job of ``queue`` in state ``wanted`` (an unfinished one) at ``now``; a started one
    only while the queue has no other ready job (see MAKING_ORDER)."""
    if wanted == "pending":
        return submit(store, now, queue, delay_ms=DAY)
    job = submit(store, now, queue)
    if wanted == "ready":
        return job
    lease = claim_one(store, now, (queue,))
    assert lease.job_id == job
    if wanted == "retrying":
        store.jobs_fail(job, "w1", lease.token, "boom", True, now)
    assert state(store, job) == wanted
    return job


def cancelled_total(store: Store, queue: str = "q") -> int:
    return store.event_totals().get((queue, "cancelled"), 0)


# -- one job -----------------------------------------------------------------------------


@pytest.mark.parametrize("was", EVERY_UNFINISHED)
def test_an_unfinished_job_becomes_cancelled_and_the_counts_move(store, was):
    job = make(store, was)
    before = store.queue_stats()["q"]
    assert store.job_cancel(job, T0 + 5) == was
    info = store.job_inspect(job)
    assert (info.state, info.finished_at, info.lease_expires_at) == (CANCELLED, T0 + 5, None)
    after = store.queue_stats()["q"]
    assert after == {**before, was: before[was] - 1, "cancelled": before["cancelled"] + 1}
    assert store.queue_stats() == recount(store)
    assert cancelled_total(store) == 1
    store.take_changes()  # (what publishes to the view, outside a transaction)
    entry = store.view.get("q")
    assert entry[STATES.index("cancelled")] == 1
    assert entry[len(STATES) + EVENTS.index("cancelled")] == 1
    assert store.next_expiry_at() is None  # a cancelled lease is no lease to reap


def test_a_cancel_is_recorded_as_an_event_from_the_state_it_left(store):
    job = make(store, "leased")
    store.take_changes()
    store.recording = True
    store.job_cancel(job, T0 + 7)
    assert store.take_changes().events == [(job, "q", "cancelled", 1, T0 + 7, "leased")]


@pytest.mark.parametrize("op", ["renew", "ack", "fail", "release"])
def test_the_token_of_a_cancelled_lease_is_refused_as_cancelled_and_changes_nothing(store, op):
    job = make(store, "leased")
    token = rows_token(store, job)
    store.job_cancel(job, T0 + 1)
    before = snapshot(store, job)
    with pytest.raises(Cancelled) as exc:
        OPS[op](store, job, "w1", token, T0 + 2)
    assert exc.value.job_id == job and exc.value.code == "cancelled"
    assert snapshot(store, job) == before
    # Also after the lease would have expired, and again: the answer does not change.
    with pytest.raises(Cancelled):
        OPS[op](store, job, "w1", token, T0 + 2 * LEASE_MS)
    assert snapshot(store, job) == before


def rows_token(store: Store, job: str) -> str:
    """The token of the job's lease, as the row keeps it."""
    return scalar(store, "SELECT lease_token FROM jobs WHERE id = ?", parse_job_id(job))


def test_an_ack_batch_refuses_the_cancelled_lease_and_acks_the_others(store):
    cancelled, kept = submit(store, T0), submit(store, T0)
    leases = {lease.job_id: lease for lease in store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0)}
    store.job_cancel(cancelled, T0 + 1)
    outcomes = store.jobs_ack_many(
        [(job, "w1", leases[job].token, None) for job in (cancelled, kept)], T0 + 2
    )
    assert isinstance(outcomes[0], Cancelled) and outcomes[1] is None
    assert (state(store, cancelled), state(store, kept)) == (CANCELLED, SUCCEEDED)
    assert store.queue_stats()["q"]["cancelled"] == 1 == store.queue_stats()["q"]["succeeded"]
    assert store.queue_stats() == recount(store)


@pytest.mark.parametrize("op", ["renew", "ack", "fail"])
@pytest.mark.parametrize("wrong", ["token", "worker"])
def test_another_token_of_a_cancelled_lease_is_still_stale(store, op, wrong):
    job = make(store, "leased")
    token = rows_token(store, job)
    store.job_cancel(job, T0 + 1)
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        OPS[op](store, job, "w2" if wrong == "worker" else "w1",
                "0" * 32 if wrong == "token" else token, T0 + 2)  # fmt: skip
    assert snapshot(store, job) == before


@pytest.mark.parametrize("op", ["renew", "ack", "fail"])
def test_an_old_token_of_a_job_cancelled_while_retrying_is_stale(store, op):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "boom", True, T0 + 1)
    store.job_cancel(job, T0 + 2)
    with pytest.raises(StaleToken):
        OPS[op](store, job, "w1", lease.token, T0 + 3)
    assert store.job_inspect(job).worker_id == "w1"  # (who ran it last is still told)


@pytest.mark.parametrize("finished", ["succeeded", "dead", "cancelled"])
def test_cancelling_a_finished_job_names_its_state_and_changes_nothing(store, finished):
    if finished == "dead":
        job = make_dead(store, T0)
    else:
        job = submit(store, T0)
        if finished == "succeeded":
            lease = claim_one(store, T0)
            store.jobs_ack(job, "w1", lease.token, None, T0)
        else:
            store.job_cancel(job, T0)
    before = snapshot(store, job)
    with pytest.raises(InvalidState) as exc:
        store.job_cancel(job, T0 + 1)
    assert (exc.value.state, exc.value.operation) == (finished, "cancel")
    assert str(exc.value) == f"cannot cancel {job}: it is {finished}"
    assert snapshot(store, job) == before


@pytest.mark.parametrize("bad_id", ["job_0000000000000001", "job_XYZ", ""])
def test_cancelling_an_unknown_job_raises_not_found_and_changes_nothing(store, bad_id):
    job = make(store, "leased")
    before = snapshot(store, job)
    with pytest.raises(JobNotFound):
        store.job_cancel(bad_id, T0 + 1)
    assert snapshot(store, job) == before


def test_a_cancel_that_may_not_touch_a_lease_refuses_a_leased_job_only(store):
    leased, ready = make(store, "leased"), submit(store, T0)
    before = snapshot(store, leased)
    with pytest.raises(Unauthorized) as exc:
        store.job_cancel(leased, T0 + 1, leased_ok=False)
    assert "leased" in str(exc.value) and "\n" not in str(exc.value)
    assert snapshot(store, leased) == before
    assert store.job_cancel(ready, T0 + 1, leased_ok=False) == READY


# -- terminal: the time-driven passes and claims never touch a cancelled job ------------


def test_promote_reap_and_claim_never_touch_a_cancelled_job(store):
    jobs = {was: make(store, was) for was in MAKING_ORDER}
    for job in jobs.values():
        store.job_cancel(job, T0 + 1)
    later = T0 + 2 * DAY
    assert store.jobs_promote_due(later, 100) == 0
    assert store.leases_reap_expired(later, 100) == []
    assert store.jobs_claim(["q"], "w2", 10, LEASE_MS, later) == []
    assert store.next_due_at() is None and store.next_expiry_at() is None
    assert {job: state(store, job) for job in jobs.values()} == dict.fromkeys(
        jobs.values(), CANCELLED
    )
    assert store.queue_stats()["q"]["cancelled"] == 4
    assert store.queue_stats() == recount(store)


def test_cancelled_jobs_are_pruned_after_retention_as_succeeded_ones(stores: Stores):
    store = stores.open(config=StoreConfig(retention_ms=DAY))
    job, other = submit(store, T0), submit(store, T0, "other")
    store.job_cancel(job, T0 + 10)
    store.job_cancel(other, T0 + 20)
    assert store.jobs_prune(T0 + 10 + DAY, 100) == 0  # (strictly older than retention)
    assert state(store, job) == CANCELLED
    assert store.jobs_prune(T0 + 11 + DAY, 100) == 1
    with pytest.raises(JobNotFound):
        store.job_inspect(job)
    assert state(store, other) == CANCELLED
    assert store.queue_stats() == recount(store) == {"other": recount(store)["other"]}
    assert store.jobs_prune(T0 + 21 + DAY, 100) == 1
    assert store.queue_stats() == {}


def test_prune_takes_at_most_limit_jobs_of_both_states(store):
    for _ in range(3):
        job = submit(store, T0)
        store.jobs_ack(job, "w1", claim_one(store, T0).token, None, T0)
        store.job_cancel(submit(store, T0), T0)
    later = T0 + 30 * DAY
    assert [store.jobs_prune(later, 4), store.jobs_prune(later, 4)] == [4, 2]
    assert store.queue_stats() == {}


def test_a_cancelled_job_and_its_lease_survive_a_reopen(stores: Stores):
    store = stores.open("db")
    leased, ready = make(store, "leased"), submit(store, T0)
    token = rows_token(store, leased)
    store.job_cancel(leased, T0 + 1)
    store.job_cancel(ready, T0 + 1)
    store.close()
    store = stores.open("db")
    store.leases_recover(T0 + 2)
    assert (state(store, leased), state(store, ready)) == (CANCELLED, CANCELLED)
    assert store.queue_stats()["q"]["cancelled"] == 2
    with pytest.raises(Cancelled):
        store.jobs_ack(leased, "w1", token, None, T0 + 3)


# -- a whole queue -----------------------------------------------------------------------


def test_cancel_queue_takes_the_states_asked_in_pieces_of_at_most_limit(store):
    jobs = {was: [make(store, was) for _ in range(3)] for was in MAKING_ORDER}
    other = make(store, "ready", queue="other")
    store.take_changes()
    store.recording = True
    done = []
    while (n := store.job_cancel_queue("q", NOT_STARTED, T0 + 1, 4)) == 4:
        done.append(n)
    done.append(n)
    assert done == [4, 4, 1]
    stats = store.queue_stats()["q"]
    assert (stats["cancelled"], stats["leased"], stats["ready"]) == (9, 3, 0)
    assert all(state(store, job) == LEASED for job in jobs["leased"])
    assert state(store, other) == READY
    events = store.take_changes().events
    assert sorted((e[0], e[2], e[5]) for e in events) == sorted(
        (job, "cancelled", was) for was in NOT_STARTED for job in jobs[was]
    )
    assert cancelled_total(store) == 9
    assert store.job_cancel_queue("q", ("leased",), T0 + 2, 10) == 3
    assert store.job_cancel_queue("q", EVERY_UNFINISHED, T0 + 2, 10) == 0
    assert store.queue_stats() == recount(store)


def test_a_lease_cancelled_with_its_queue_answers_its_token_cancelled(store):
    job = make(store, "leased")
    token = rows_token(store, job)
    assert store.job_cancel_queue("q", ("leased",), T0 + 1, 10) == 1
    with pytest.raises(Cancelled):
        store.jobs_ack(job, "w1", token, None, T0 + 2)
    assert state(store, job) == CANCELLED


# -- several servers on one PostgreSQL database ------------------------------------------


@pytest.mark.parametrize("store_kind", ["postgres"])  # (one SQLite file has one server)
def test_a_cancel_through_one_server_voids_a_lease_another_server_granted(stores: Stores):
    one, other = stores.open("shared"), stores.open("shared")
    job = submit(one, T0)
    lease = claim_one(one, T0)
    assert other.job_cancel(job, T0 + 1) == LEASED
    with pytest.raises(Cancelled):
        one.jobs_ack(job, "w1", lease.token, None, T0 + 2)
    with pytest.raises(Cancelled):
        one.lease_renew(job, "w1", lease.token, LEASE_MS, T0 + 2)
    assert state(one, job) == CANCELLED
    assert one.queue_stats()["q"]["cancelled"] == 1 == other.queue_stats()["q"]["cancelled"]
    assert one.queue_stats()["q"]["leased"] == 0
    # Both servers' whole-queue cancels share a queue's jobs, none twice.
    jobs = [submit(one, T0 + 3) for _ in range(5)]
    assert (
        one.job_cancel_queue("q", NOT_STARTED, T0 + 4, 3)
        + other.job_cancel_queue("q", NOT_STARTED, T0 + 4, 3)
        == 5
    )
    assert {state(one, j) for j in jobs} == {CANCELLED}
    assert one.queue_stats()["q"]["cancelled"] == 6
