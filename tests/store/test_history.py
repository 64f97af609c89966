"""History per queue and minute on both stores: what transitions count, flushes that add
(also from several stores sharing a PostgreSQL database), rollbacks that take counts back,
the read per step, the bound on queues with rows of their own, the pruning."""

from __future__ import annotations

import pytest

from relay.protocol.model import SubmitSpec
from relay.store import history
from relay.store.base import StoreConfig
from relay.store.history import MINUTE_MS
from tests.store.conformance import Store, Stores, postgres_only, rows

T = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE_MS  # a minute's start


def submit(store: Store, queue: str, now: int, n: int = 1, **kw) -> list[str]:
    return [r[0] for r in store.jobs_submit([SubmitSpec(queue, "{}", **kw)] * n, now)]


def point(store: Store, queue: str | None, start: int, end: int | None = None) -> dict:
    [p] = store.history_read(queue, start, end or start + MINUTE_MS, MINUTE_MS)
    return p.as_fields()


def test_transitions_count_in_their_minutes_once_flushed(store: Store) -> None:
    submit(store, "q", T + 1_000, 3, max_attempts=1)
    leases = store.jobs_claim(["q"], "w", 3, 300_000, T + 1_500)  # waited 500 ms each
    assert store.history_read("q", T, T + MINUTE_MS, MINUTE_MS)[0].values == (0,) * 10
    store.jobs_ack(leases[0].job_id, "w", leases[0].token, None, T + 2_500)  # ran 1 s
    store.jobs_fail(leases[1].job_id, "w", leases[1].token, "x", True, T + MINUTE_MS + 3_500)
    flushed = store.history_flush(T + MINUTE_MS + 4_000)
    assert flushed.rows == 4  # each minute: the queue's row and every queue's
    assert point(store, "q", T) == {
        "at": T, "submitted": 3, "succeeded": 1, "failed": 0, "dead": 0,
        "run_count": 1, "run_sum_ms": 1_000, "run_max_ms": 1_000,
        "wait_count": 3, "wait_sum_ms": 1_500, "wait_max_ms": 500,
    }  # fmt: skip
    later = point(store, "q", T + MINUTE_MS)
    assert (later["failed"], later["dead"], later["run_count"], later["run_max_ms"]) == (
        1, 1, 1, MINUTE_MS + 2_000,
    )  # fmt: skip
    run = flushed.observed["q"]
    assert sum(run.run) == 2 and sum(run.wait) == 3 and run.wait_sum_ms == 1_500
    # 500 ms is in the bucket whose bound is 500 (le="0.5"): bounds are inclusive.
    assert run.wait[history.BOUNDS_MS.index(500)] == 3


def test_a_flush_adds_to_the_rows_there_and_counts_nothing_twice(store: Store) -> None:
    submit(store, "q", T, 2)
    store.history_flush(T + 5_000)
    submit(store, "q", T + 6_000, 1)
    assert store.history_flush(T + 10_000).rows == 2
    assert store.history_flush(T + 15_000).rows == 0  # nothing new
    assert point(store, "q", T)["submitted"] == 3
    assert store._history == {}  # flushed entries are dropped: memory stays bounded


def test_expiry_and_timeouts_count_as_failed_attempts(store: Store) -> None:
    submit(store, "q", T, 1, max_attempts=1)
    store.jobs_claim(["q"], "w", 1, 1_000, T)
    store.leases_reap_expired(T + 2_000, 10)
    store.history_flush(T + 3_000)
    p = point(store, "q", T)
    assert (p["failed"], p["dead"], p["succeeded"], p["run_count"]) == (1, 1, 0, 0)


def test_a_rolled_back_transaction_counts_nothing(store: Store) -> None:
    store.begin()
    submit(store, "q", T, 2)
    store.rollback()
    store.begin()
    with pytest.raises(RuntimeError), store.command():
        submit(store, "q", T, 5)
        raise RuntimeError
    submit(store, "q", T, 1)
    store.commit()
    store.history_flush(T + 1_000)
    assert point(store, "q", T)["submitted"] == 1


def test_a_flush_rolled_back_is_flushed_again(store: Store) -> None:
    submit(store, "q", T, 2)
    store.jobs_claim(["q"], "w", 1, 30_000, T + 700)
    store.begin()
    store.history_flush(T + 1_000)
    store.rollback()
    assert point(store, "q", T)["submitted"] == 0
    store.history_flush(T + 2_000)
    p = point(store, "q", T)
    assert (p["submitted"], p["wait_count"], p["wait_max_ms"]) == (2, 1, 700)


def test_the_read_sums_queues_and_steps_and_gives_every_step(store: Store) -> None:
    submit(store, "a", T, 1)
    submit(store, "b", T + 2 * MINUTE_MS, 2)
    submit(store, "a", T + 7 * MINUTE_MS, 4)
    store.history_flush(T + 8 * MINUTE_MS)
    got = store.history_read(None, T, T + 10 * MINUTE_MS, 5 * MINUTE_MS)
    assert [(p.at, p.as_fields()["submitted"]) for p in got] == [(T, 3), (T + 5 * MINUTE_MS, 4)]
    only_a = store.history_read("a", T, T + 10 * MINUTE_MS, 5 * MINUTE_MS)
    assert [p.values[0] for p in only_a] == [1, 4]
    assert [p.values[0] for p in store.history_read("c", T, T + 2 * MINUTE_MS, MINUTE_MS)] == [
        0, 0,
    ]  # fmt: skip


def test_queues_beyond_the_bound_are_summed_as_other(stores: Stores) -> None:
    store = stores.open(config=StoreConfig(history_max_queues=2))
    for queue in ("a", "b", "c", "d"):
        submit(store, queue, T, 1)
    store.history_flush(T + 1_000)
    queues = [r[0] for r in rows(store, "SELECT queue FROM history ORDER BY queue")]
    assert queues == ["*", "_other", "a", "b"]
    assert point(store, "_other", T)["submitted"] == 2
    assert point(store, None, T)["submitted"] == 4


def test_queues_made_later_cannot_push_a_queue_out_of_its_rows(stores: Stores) -> None:
    """The queues first counted keep their rows: a client making queues whose names sort
    first sends those to ``_other``, not the busy queue counted before them."""
    store = stores.open(config=StoreConfig(history_max_queues=2))
    submit(store, "orders", T, 5)
    store.history_flush(T + 1_000)
    later = T + MINUTE_MS
    submit(store, "orders", later, 5)
    for queue in ("0000", "0001", "0002"):
        submit(store, queue, later, 1)
    store.history_flush(later + 1_000)
    assert point(store, "orders", later)["submitted"] == 5
    assert point(store, "0000", later)["submitted"] == 1  # the one place left
    assert point(store, "_other", later)["submitted"] == 2


def test_pruning_deletes_rows_past_the_kept_period(store: Store) -> None:
    submit(store, "q", T, 1)
    submit(store, "q", T + MINUTE_MS, 1)
    store.history_flush(T + MINUTE_MS + 1)
    keep_until = T + history.HISTORY_KEEP_MS
    assert store.history_prune(keep_until, 100) == 0
    assert store.history_prune(keep_until + 1, 1) == 1  # (its limit: another is due)
    assert store.history_prune(keep_until + 1, 100) == 1  # the queue's and every queue's
    assert store.history_prune(keep_until + MINUTE_MS + 1, 100) == 2
    assert rows(store, "SELECT count(*) FROM history") == [(0,)]


def test_a_release_has_no_run_time_and_a_lease_from_before_a_restart_has_one(
    stores: Stores,
) -> None:
    store = stores.open("a")
    submit(store, "q", T, 2)
    first, second = store.jobs_claim(["q"], "w", 2, 30_000, T)
    store.jobs_release(first.job_id, "w", first.token, T + 100)
    store.close()
    store = stores.open("a")  # a restart (or another server): the lease's start is the row's
    store.jobs_ack(second.job_id, "w", second.token, None, T + 200)
    store.history_flush(T + 300)
    p = point(store, "q", T)
    assert (p["succeeded"], p["run_count"], p["run_max_ms"]) == (1, 1, 200)


@postgres_only
def test_servers_sharing_a_database_add_their_counts(stores: Stores) -> None:
    one, two = stores.open("shared"), stores.open("shared")
    submit(one, "q", T, 2)
    [lease] = one.jobs_claim(["q"], "w", 1, 30_000, T + 900)
    submit(two, "q", T + 10, 3)
    [other] = two.jobs_claim(["q"], "w", 1, 30_000, T + 400)
    one.history_flush(T + 1_000)
    two.history_flush(T + 1_000)
    p = point(one, "q", T)
    assert (p["submitted"], p["wait_count"], p["wait_max_ms"]) == (5, 2, 900)
    assert lease.job_id != other.job_id
