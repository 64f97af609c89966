"""Execution timeouts on both stores: an attempt's lease, as granted and as renewed, never
runs past the attempt's start + ``timeout_ms`` + TIMEOUT_GRACE_MS, and a lease that reaches
that deadline is reaped with the error "timed out after N ms"."""

from __future__ import annotations

import pytest

from relay.protocol.errors import LeaseExpired
from relay.protocol.model import TIMEOUT_GRACE_MS, JobState, timeout_error
from tests.conftest import T0
from tests.store.conformance import Stores
from tests.store.test_sqlite import claim_one, spec, submit

READY, LEASED, DEAD = JobState.READY, JobState.LEASED, JobState.DEAD
TIMEOUT = 10_000
DEADLINE = T0 + TIMEOUT + TIMEOUT_GRACE_MS


def test_a_lease_ends_no_later_than_the_attempts_deadline(store):
    job = submit(store, timeout_ms=TIMEOUT)
    lease = claim_one(store, T0, lease_ms=60_000)
    assert (lease.job_id, lease.timeout_ms, lease.lease_expires_at) == (job, TIMEOUT, DEADLINE)
    assert store.next_expiry_at() == DEADLINE
    info = store.job_inspect(job)
    assert (info.timeout_ms, info.lease_expires_at) == (TIMEOUT, DEADLINE)


def test_a_shorter_lease_is_granted_as_asked_and_renewals_stop_at_the_deadline(store):
    job = submit(store, timeout_ms=TIMEOUT)
    lease = claim_one(store, T0, lease_ms=3_000)
    assert lease.lease_expires_at == T0 + 3_000
    assert store.lease_renew(job, "w1", lease.token, 3_000, T0 + 2_000) == T0 + 5_000
    # Renewed near the deadline: granted up to the deadline, not beyond.
    assert store.lease_renew(job, "w1", lease.token, 30_000, T0 + 4_000) == DEADLINE
    assert store.job_inspect(job).lease_expires_at == DEADLINE
    with pytest.raises(LeaseExpired):
        store.lease_renew(job, "w1", lease.token, 30_000, DEADLINE)


def test_a_job_without_a_timeout_keeps_the_lease_it_asks_for(store):
    job = submit(store)
    lease = claim_one(store, T0, lease_ms=600_000)
    assert (lease.timeout_ms, lease.lease_expires_at) == (None, T0 + 600_000)
    assert store.lease_renew(job, "w1", lease.token, 600_000, T0 + 1_000) == T0 + 601_000
    assert store.job_inspect(job).timeout_ms is None


def test_a_lease_that_reaches_its_deadline_is_reaped_as_timed_out(store):
    job = submit(store, timeout_ms=TIMEOUT, max_attempts=2)
    lease = claim_one(store, T0, lease_ms=60_000)
    assert store.leases_reap_expired(DEADLINE - 1, 10) == []
    [reaped] = store.leases_reap_expired(DEADLINE, 10)
    assert (reaped.job_id, reaped.state, reaped.attempt) == (job, READY, 1)
    info = store.job_inspect(job)
    assert info.last_error == timeout_error(TIMEOUT) == "timed out after 10000 ms"
    assert [(e.attempt, e.error) for e in info.errors] == [(1, "timed out after 10000 ms")]
    with pytest.raises(LeaseExpired):
        store.jobs_ack(job, "w1", lease.token, None, DEADLINE)
    # The next attempt has a deadline of its own; the last one that times out is dead.
    later = DEADLINE + 1_000
    second = claim_one(store, later, lease_ms=60_000)
    assert second.lease_expires_at == later + TIMEOUT + TIMEOUT_GRACE_MS
    [reaped] = store.leases_reap_expired(second.lease_expires_at, 10)
    assert reaped.state == DEAD
    assert store.job_inspect(job).last_error == "timed out after 10000 ms"


def test_a_lease_not_renewed_before_its_deadline_expires_as_usual(store):
    job = submit(store, timeout_ms=TIMEOUT)
    claim_one(store, T0, lease_ms=3_000)
    store.leases_reap_expired(T0 + 3_000, 10)
    assert store.job_inspect(job).last_error == "lease expired"


def test_a_batch_of_claims_caps_only_the_jobs_with_a_timeout(store):
    timed = submit(store, timeout_ms=TIMEOUT)
    plain = submit(store)
    leases = store.jobs_claim(["q"], "w1", 2, 60_000, T0)
    expiry = {lease.job_id: lease.lease_expires_at for lease in leases}
    assert expiry == {timed: DEADLINE, plain: T0 + 60_000}


def test_the_timeout_is_kept_across_a_restart(stores: Stores):
    store = stores.open("db")
    [result] = store.jobs_submit([spec(timeout_ms=TIMEOUT)], T0)
    store.close()
    store = stores.open("db")
    lease = claim_one(store, T0, lease_ms=60_000)
    assert (lease.job_id, lease.lease_expires_at) == (result.job_id, DEADLINE)
