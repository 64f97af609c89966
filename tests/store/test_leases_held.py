"""``leases_held`` on both stores: the unexpired leases of some workers (what ``workers_list``
shows as a connection's jobs), by job id, bounded by ``limit``; an acked, failed, released
or expired lease is not held, and another worker's is not listed."""

from __future__ import annotations

from relay.protocol.model import SubmitSpec
from tests.conftest import T0
from tests.store.conformance import Store

LEASE_MS = 30_000


def submit(store: Store, queue: str, n: int) -> list[str]:
    specs = [SubmitSpec(queue, f'{{"n": {i}}}') for i in range(n)]
    return [r.job_id for r in store.jobs_submit(specs, T0)]


def test_the_leases_of_the_workers_asked_for_and_no_others(store: Store) -> None:
    a = submit(store, "a", 3)
    b = submit(store, "b", 2)
    mine = store.jobs_claim(["a"], "w1", 3, LEASE_MS, T0)
    theirs = store.jobs_claim(["b"], "w2", 1, LEASE_MS, T0)
    mine_too = store.jobs_claim(["b"], "w3", 1, 1_000, T0)
    assert [lease.job_id for lease in mine] == a
    held = store.leases_held(["w1", "w3"], T0 + 1, 100)
    expires = T0 + LEASE_MS
    assert held == [
        (a[0], "a", "w1", expires, T0), (a[1], "a", "w1", expires, T0),
        (a[2], "a", "w1", expires, T0), (b[1], "b", "w3", T0 + 1_000, T0),
    ]  # fmt: skip
    assert [job_id for job_id, *_ in store.leases_held(["w2"], T0 + 1, 100)] == [b[0]]
    assert theirs[0].job_id == b[0] and mine_too[0].job_id == b[1]
    # Bounded, by job id.
    assert [job_id for job_id, *_ in store.leases_held(["w1", "w3"], T0 + 1, 2)] == a[:2]
    assert store.leases_held([], T0, 100) == []
    assert store.leases_held(["nobody"], T0, 100) == []


def test_an_ended_or_expired_lease_is_not_held(store: Store) -> None:
    jobs = submit(store, "q", 4)
    leases = store.jobs_claim(["q"], "w1", 4, LEASE_MS, T0)
    assert [lease.job_id for lease in leases] == jobs
    store.jobs_ack(jobs[0], "w1", leases[0].token, None, T0 + 1)
    store.jobs_fail(jobs[1], "w1", leases[1].token, "boom", True, T0 + 1)
    store.jobs_release(jobs[2], "w1", leases[2].token, T0 + 1)
    assert [job_id for job_id, *_ in store.leases_held(["w1"], T0 + 2, 100)] == [jobs[3]]
    # Past its expiry (not yet reaped), a lease is held by nobody.
    assert store.leases_held(["w1"], T0 + LEASE_MS, 100) == []


def test_worker_ids_of_any_text_are_found_as_given(store: Store) -> None:
    """A worker id with a NUL or the PostgreSQL store's escape character (both stored
    escaped there) is looked up and answered as the worker gave it."""
    [job] = submit(store, "q", 1)
    odd = "w\x00x\x01y"
    [lease] = store.jobs_claim(["q"], odd, 1, LEASE_MS, T0)
    assert store.leases_held([odd, "other"], T0 + 1, 100) == [(job, "q", odd, T0 + LEASE_MS, T0)]
    assert lease.job_id == job
