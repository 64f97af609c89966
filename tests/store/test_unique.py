"""Unique jobs on both stores: a job submitted with a ``unique_key`` is answered as the
duplicate of the queue's job holding that key, while the holder is in the key's scope
(``unique_for``: "unfinished", or "queued": not yet leased), and changes nothing."""

from __future__ import annotations

import threading

import pytest

from relay.protocol.model import JobState
from relay.store.postgres import PostgresStore
from tests.conftest import T0
from tests.store.conformance import Store, Stores, postgres_only, rows, scalar
from tests.store.test_sqlite import DAY, LEASE_MS, claim_one, dump, make_dead, spec, submit

PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED = JobState.RETRYING, JobState.SUCCEEDED


def unique_dump(store: Store) -> tuple:
    return (dump(store), rows(store, "SELECT * FROM unique_keys ORDER BY 1, 2"))


def jobs_in(store: Store, queue: str = "q") -> int:
    return scalar(store, "SELECT count(*) FROM jobs WHERE queue = ?", queue)


def test_a_second_submit_with_the_key_answers_the_first_job_and_changes_nothing(store):
    [first] = store.jobs_submit([spec(unique_key="u1")], T0)
    assert (first.state, first.duplicate) == (READY, False)
    stats, totals, before = store.queue_stats(), store.event_totals(), unique_dump(store)
    [again] = store.jobs_submit([spec(payload='"other"', unique_key="u1")], T0 + 1_000)
    assert (again.job_id, again.state, again.duplicate) == (first.job_id, READY, True)
    assert (store.queue_stats(), store.event_totals(), unique_dump(store)) == (
        stats,
        totals,
        before,
    )
    assert store.job_inspect(first.job_id).payload == '{"n": 1}'


def test_keys_are_per_queue_and_other_keys_are_free(store):
    a = submit(store, queue="a", unique_key="u1")
    b = submit(store, queue="b", unique_key="u1")
    c = submit(store, queue="a", unique_key="u2")
    assert len({a, b, c}) == 3
    assert jobs_in(store, "a") == 2 and jobs_in(store, "b") == 1


def test_the_same_key_twice_in_one_batch_makes_one_job(store):
    results = store.jobs_submit(
        [spec(unique_key="u1"), spec(unique_key="u2"), spec(unique_key="u1")], T0
    )
    assert [r.duplicate for r in results] == [False, False, True]
    assert results[2].job_id == results[0].job_id
    assert jobs_in(store) == 2


@pytest.mark.parametrize("unique_for", ["unfinished", "queued"])
def test_a_pending_job_holds_its_key_in_either_scope(store, unique_for):
    job = submit(store, delay_ms=60_000, unique_key="u", unique_for=unique_for)
    [again] = store.jobs_submit([spec(unique_key="u", unique_for=unique_for)], T0)
    assert (again.job_id, again.state, again.duplicate) == (job, PENDING, True)


def test_unfinished_holds_the_key_while_leased_and_retrying_and_frees_it_once_succeeded(store):
    job = submit(store, unique_key="u", max_attempts=3)
    lease = claim_one(store, T0)
    assert store.jobs_submit([spec(unique_key="u")], T0)[0][:3] == (job, LEASED, True)
    store.jobs_fail(job, "w1", lease.token, "boom", True, T0)
    assert store.jobs_submit([spec(unique_key="u")], T0)[0][:3] == (job, RETRYING, True)
    store.jobs_promote_due(T0 + DAY, 100)
    lease = claim_one(store, T0 + DAY)
    store.jobs_ack(job, "w1", lease.token, None, T0 + DAY)
    [fresh] = store.jobs_submit([spec(unique_key="u")], T0 + DAY)
    assert fresh.job_id != job and (fresh.state, fresh.duplicate) == (READY, False)
    # The key is the new job's now: a third submit answers it.
    assert store.jobs_submit([spec(unique_key="u")], T0 + DAY)[0][:3] == (
        fresh.job_id,
        READY,
        True,
    )


def test_a_dead_job_frees_its_key(store):
    job = make_dead(store, unique_key="u")
    [fresh] = store.jobs_submit([spec(unique_key="u")], T0)
    assert fresh.job_id != job and not fresh.duplicate


def test_queued_frees_the_key_once_the_job_is_leased_and_not_on_its_retry(store):
    job = submit(store, unique_key="u", unique_for="queued", max_attempts=3)
    lease = claim_one(store, T0)
    [second] = store.jobs_submit([spec(unique_key="u", unique_for="queued")], T0)
    assert second.job_id != job and not second.duplicate
    # The first job's retry does not take the key back: the second one holds it.
    store.jobs_fail(job, "w1", lease.token, "boom", True, T0)
    store.jobs_promote_due(T0 + DAY, 100)
    [third] = store.jobs_submit([spec(unique_key="u", unique_for="queued")], T0 + DAY)
    assert (third.job_id, third.duplicate) == (second.job_id, True)


def test_a_released_job_is_queued_again_and_holds_its_key(store):
    job = submit(store, unique_key="u", unique_for="queued")
    lease = claim_one(store, T0)
    store.jobs_release(job, "w1", lease.token, T0)
    [again] = store.jobs_submit([spec(unique_key="u", unique_for="queued")], T0)
    assert (again.job_id, again.state, again.duplicate) == (job, READY, True)


def test_a_purged_holder_takes_its_key_row_with_it(store):
    job = make_dead(store, unique_key="u")
    assert store.dead_purge(job) == 1
    assert rows(store, "SELECT * FROM unique_keys") == []
    assert not store.jobs_submit([spec(unique_key="u")], T0)[0].duplicate


def test_a_pruned_holder_takes_its_key_row_with_it(store):
    job = submit(store, unique_key="u")
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, None, T0)
    store.jobs_prune(T0 + 30 * DAY, 100)
    assert rows(store, "SELECT * FROM unique_keys") == []


def test_an_idempotency_key_answers_before_the_unique_key(store):
    first = submit(store, idempotency_key="i", unique_key="u1")
    [again] = store.jobs_submit([spec(idempotency_key="i", unique_key="u2")], T0)
    assert (again.job_id, again.duplicate) == (first, True)
    assert jobs_in(store) == 1


def test_the_key_holds_across_a_restart(stores: Stores):
    store = stores.open("db")
    job = submit(store, unique_key="u")
    store.close()
    store = stores.open("db")
    assert store.jobs_submit([spec(unique_key="u")], T0)[0][:3] == (job, READY, True)


def test_a_key_held_in_a_batch_that_rolls_back_is_not_held(store):
    store.begin()
    store.jobs_submit([spec(unique_key="u")], T0)
    store.rollback()
    [fresh] = store.jobs_submit([spec(unique_key="u")], T0)
    assert not fresh.duplicate and jobs_in(store) == 1


@postgres_only
def test_another_server_sees_the_key(stores: Stores):
    a, b = stores.open("db"), stores.open("db")
    job = submit(a, unique_key="u")
    assert b.jobs_submit([spec(unique_key="u")], T0)[0][:3] == (job, READY, True)
    lease = b.jobs_claim(["q"], "w1", 1, LEASE_MS, T0)[0]
    b.jobs_ack(job, "w1", lease.token, None, T0)
    [fresh] = a.jobs_submit([spec(unique_key="u")], T0)
    assert not fresh.duplicate


@postgres_only
def test_servers_submitting_one_key_at_once_make_one_job(stores: Stores):
    servers = [stores.open("db") for _ in range(3)]
    rounds = 20
    barrier = threading.Barrier(len(servers))
    answers: list[list[tuple[str, bool]]] = [[] for _ in servers]
    errors: list[BaseException] = []

    def run(n: int, store: PostgresStore) -> None:
        try:
            for key in range(rounds):
                barrier.wait(timeout=30)
                store.begin()
                [result] = store.jobs_submit([spec(unique_key=f"u{key}")], T0)
                store.commit()
                answers[n].append((result.job_id, result.duplicate))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n, s)) for n, s in enumerate(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    for key in range(rounds):
        got = [answers[n][key] for n in range(len(servers))]
        assert len({job for job, _ in got}) == 1, got  # one job, answered to all
        assert sorted(duplicate for _, duplicate in got) == [False, True, True]
    assert jobs_in(servers[0]) == rounds
