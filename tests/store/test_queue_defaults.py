"""A queue's submit defaults on both stores: a submit that leaves out its retries, backoff
or timeout gets the queue's default (else the protocol's), resolved when the job is made
and kept with it; a field the submit gives always wins. On PostgreSQL, a default committed
by any server holds for every server's next submit."""

from __future__ import annotations

from typing import Any

import pytest

from relay.protocol.model import DEFAULT_BACKOFF, Backoff, JobState, SubmitSpec, parse_job_id
from tests.conftest import T0
from tests.store.conformance import Store, Stores, postgres_only, rows, sqlite_only

LEASE_MS = 30_000
DEFAULTS = {
    "default_retries": 0,
    "default_backoff": Backoff.fixed(500),
    "default_timeout_ms": 60_000,
}
# A job as its defaults leave it: (max_attempts, backoff, timeout_ms).
PROTOCOLS = (4, DEFAULT_BACKOFF, None)
QUEUES = (1, Backoff.fixed(500), 60_000)
GIVEN = {"max_attempts": 3, "backoff": Backoff("exponential", 20, 40, False), "timeout_ms": 5}
# The shapes a submit takes through the stores: plain (ready, no key), and the others.
SHAPES = {
    "plain": {},
    "delayed": {"delay_ms": 1_000},
    "keyed": {"idempotency_key": "k"},
    "unique": {"unique_key": "u"},
}


def spec(queue: str = "q", **kw: Any) -> SubmitSpec:
    return SubmitSpec(queue, '{"n": 1}', **kw)


def kept(store: Store, job_id: str) -> tuple[int, Backoff, int | None]:
    """What the job was made with: (max_attempts, backoff, timeout_ms), from its row."""
    [(attempts, kind, base, cap, jitter, timeout)] = rows(
        store,
        "SELECT max_attempts, backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, "
        "timeout_ms FROM jobs WHERE id = ?",
        parse_job_id(job_id),
    )
    return attempts, Backoff(kind, base, cap, bool(jitter)), timeout


def submitted(store: Store, *specs: SubmitSpec, now: int = T0) -> list[str]:
    return [result.job_id for result in store.jobs_submit(list(specs), now)]


def test_a_queue_without_defaults_gives_the_protocols(store: Store) -> None:
    [job] = submitted(store, spec())
    assert kept(store, job) == PROTOCOLS


@pytest.mark.parametrize("shape", SHAPES)
def test_each_default_applies_to_a_submit_that_leaves_its_field_out(
    store: Store, shape: str
) -> None:
    store.queue_config("q", DEFAULTS, T0)
    [job] = submitted(store, spec(**SHAPES[shape]))
    assert kept(store, job) == QUEUES


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("field", sorted(DEFAULTS))
def test_one_default_applies_alone_and_the_others_stay_the_protocols(
    store: Store, shape: str, field: str
) -> None:
    store.queue_config("q", {field: DEFAULTS[field]}, T0)
    [job] = submitted(store, spec(**SHAPES[shape]))
    which = ("default_retries", "default_backoff", "default_timeout_ms").index(field)
    expected = list(PROTOCOLS)
    expected[which] = QUEUES[which]
    assert kept(store, job) == tuple(expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_field_the_submit_gives_wins_over_the_default(store: Store, shape: str) -> None:
    store.queue_config("q", DEFAULTS, T0)
    [job] = submitted(store, spec(**SHAPES[shape], **GIVEN))
    assert kept(store, job) == (3, GIVEN["backoff"], 5)
    # Also a value that is the protocol's own default, given.
    [job] = submitted(store, spec(max_attempts=4, backoff=DEFAULT_BACKOFF))
    assert kept(store, job) == (4, DEFAULT_BACKOFF, 60_000)


def test_a_batch_over_several_queues_gives_each_job_its_queues_defaults(store: Store) -> None:
    store.queue_config("a", {"default_retries": 9}, T0)
    store.queue_config("b", {"default_backoff": Backoff.fixed(500), "default_timeout_ms": 7}, T0)
    jobs = submitted(
        store,
        spec("a"),
        spec("b"),
        spec("c"),
        spec("a", max_attempts=2),
        spec("b", delay_ms=10),
        spec("b", timeout_ms=3, idempotency_key="k"),
        spec("c", backoff=Backoff.fixed(1)),
        spec("a", unique_key="u"),
    )
    assert [kept(store, job) for job in jobs] == [
        (10, DEFAULT_BACKOFF, None),
        (4, Backoff.fixed(500), 7),
        PROTOCOLS,
        (2, DEFAULT_BACKOFF, None),
        (4, Backoff.fixed(500), 7),
        (4, Backoff.fixed(500), 3),
        (4, Backoff.fixed(1), None),
        (10, DEFAULT_BACKOFF, None),
    ]


def test_a_default_changed_later_leaves_the_jobs_made_before(store: Store) -> None:
    store.queue_config("q", DEFAULTS, T0)
    [before] = submitted(store, spec(), spec(delay_ms=5))[:1]
    store.queue_config("q", {"default_retries": 5, "default_timeout_ms": None}, T0 + 1)
    [after] = submitted(store, spec(), now=T0 + 2)
    assert kept(store, before) == QUEUES
    assert kept(store, after) == (6, Backoff.fixed(500), None)
    store.queue_config("q", dict.fromkeys(DEFAULTS), T0 + 3)
    [cleared] = submitted(store, spec(), now=T0 + 4)
    assert kept(store, cleared) == PROTOCOLS
    assert kept(store, before) == QUEUES


def test_a_lease_and_a_failure_follow_the_defaults_the_job_got(store: Store) -> None:
    store.queue_config("q", {**DEFAULTS, "default_retries": 1}, T0)
    [job] = submitted(store, spec())
    [lease] = store.jobs_claim(["q"], "w1", 1, LEASE_MS, T0)
    assert (lease.job_id, lease.max_attempts, lease.timeout_ms) == (job, 2, 60_000)
    outcome = store.jobs_fail(job, "w1", lease.token, "boom", True, T0 + 10)
    assert (outcome.state, outcome.retry_at) == (JobState.RETRYING, T0 + 10 + 500)
    info = store.job_inspect(job)
    assert (info.max_attempts, info.timeout_ms) == (2, 60_000)


def test_a_default_set_in_the_open_transaction_applies_to_its_submits(store: Store) -> None:
    store.begin()
    store.queue_config("q", DEFAULTS, T0)
    [job] = submitted(store, spec())
    store.commit()
    assert kept(store, job) == QUEUES
    store.begin()
    store.queue_config("q", {"default_retries": 7}, T0 + 1)
    store.rollback()
    [job] = submitted(store, spec(), now=T0 + 2)
    assert kept(store, job) == QUEUES


def test_defaults_survive_reopening_the_store(stores: Stores) -> None:
    store = stores.open("a")
    store.queue_config("q", DEFAULTS, T0)
    store.close()
    store = stores.open("a")
    [job] = submitted(store, spec())
    assert kept(store, job) == QUEUES


@sqlite_only  # (the writer's group commit of plain submits, one statement outside a transaction)
def test_a_plain_submit_alone_gets_the_default_retries(store: Store) -> None:
    store.queue_config("q", {"default_retries": 0}, T0)
    store.queue_config("b", {"default_backoff": Backoff.fixed(500)}, T0)
    [job] = [result.job_id for result in store.jobs_submit([spec()], T0, alone=True)]
    assert kept(store, job) == (1, DEFAULT_BACKOFF, None)
    # A default backoff makes the job more than the plain statement writes.
    assert store.jobs_submit([spec("b")], T0, alone=True) is None


@postgres_only
def test_a_default_set_through_another_server_applies_to_the_next_submit(
    stores: Stores,
) -> None:
    a, b = stores.open("db"), stores.open("db")
    [first] = submitted(b, spec())  # (the statements prepared before any setting)
    a.queue_config("q", DEFAULTS, T0)
    [job] = submitted(b, spec(), spec(delay_ms=5))[:1]
    assert kept(b, job) == QUEUES
    a.queue_config("q", {"default_retries": 2, "default_timeout_ms": None}, T0 + 1)
    [job] = submitted(b, spec(), now=T0 + 2)
    assert kept(b, job) == (3, Backoff.fixed(500), None)
    a.queue_config("q", dict.fromkeys(DEFAULTS), T0 + 3)
    [job] = submitted(b, spec(), now=T0 + 4)
    assert kept(b, job) == kept(b, first) == PROTOCOLS
