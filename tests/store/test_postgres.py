"""Several PostgreSQL stores on one database, as several servers run them: each store is
one server's writer (its own connection, its own transactions), here two stores in one
test, in two threads where they must run at once.

What the conformance suite cannot show with one store: two servers never lease one job and
never wait for each other's claims; a token is refused through any server; the counts are
every server's; the time-driven passes split the work; an idempotency key submitted through
two servers at once makes one job.
"""

from __future__ import annotations

import functools
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest
from hypothesis import given, strategies
from psycopg import sql

from relay.protocol.errors import LeaseExpired, QueueFull, StaleToken
from relay.protocol.model import ID_MAX as MAX_JOB_KEY
from relay.protocol.model import Backoff, JobState, Rate, SubmitResult, SubmitSpec
from relay.store.base import StoreConfig
from relay.store.postgres import PostgresStore, notify
from relay.store.postgres import browse as browse_sql
from relay.store.postgres import cancel as cancel_sql
from relay.store.postgres import dead as dead_sql
from relay.store.postgres import leases as leases_sql
from relay.store.postgres import maintenance as maintenance_sql
from relay.store.postgres import reads as reads_sql
from relay.store.postgres.sql import decode_text, encode_text
from tests.conftest import T0

LEASE_MS = 30_000


def specs(n: int, queue: str = "q", **kw: object) -> list[SubmitSpec]:
    return [SubmitSpec(queue, f'{{"n": {i}}}', **kw) for i in range(n)]  # type: ignore[arg-type]


def recount(store: PostgresStore) -> dict[str, dict[str, int]]:
    stats: dict[str, dict[str, int]] = {}
    for queue, state, n in store._db.execute(
        "SELECT queue, state, count(*) FROM jobs GROUP BY 1, 2"
    ):
        stats.setdefault(queue, {str(s): 0 for s in JobState})[state] = n
    return stats


def run_together(*bodies: Callable[[], object], timeout: float = 60) -> list[object]:
    """Run each body in a thread of its own, started at once; their results, or raise the
    first failure."""
    start = threading.Barrier(len(bodies))
    results: list[object] = [None] * len(bodies)
    errors: list[BaseException] = []

    def run(i: int, body: Callable[[], object]) -> None:
        try:
            start.wait()
            results[i] = body()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


# -- claims ------------------------------------------------------------------------------


def test_a_claim_skips_the_jobs_another_server_is_leasing_without_waiting(servers):
    a, b = servers(), servers()
    jobs = [r.job_id for r in a.jobs_submit(specs(6), T0)]
    a.begin()
    first = a.jobs_claim(["q"], "wa", 3, LEASE_MS, T0 + 1)  # locked until a commits
    b.begin()
    # Waiting for a's locks would never end (a commits after b): lock_timeout would fail it.
    second = b.jobs_claim(["q"], "wb", 3, LEASE_MS, T0 + 1)
    b.commit()
    a.commit()
    assert [lease.job_id for lease in first] == jobs[:3]
    assert [lease.job_id for lease in second] == jobs[3:]
    assert b.jobs_claim(["q"], "wb", 3, LEASE_MS, T0 + 2) == []


def test_a_claim_after_another_servers_commit_does_not_take_its_jobs_again(servers):
    a, b = servers(), servers()
    a.jobs_submit(specs(2), T0)
    b.begin()
    b.queue_stats()  # (a statement of b's transaction before a's claim commits)
    a.jobs_claim(["q"], "wa", 1, LEASE_MS, T0 + 1)
    leases = b.jobs_claim(["q"], "wb", 5, LEASE_MS, T0 + 1)
    b.commit()
    assert len(leases) == 1
    assert recount(a)["q"] == {**dict.fromkeys(map(str, JobState), 0), "leased": 2}


def test_two_servers_claiming_at_once_never_lease_one_job_twice(servers):
    a, b = servers(), servers()
    total = 300
    a.jobs_submit(specs(total // 3, "x") + specs(total // 3, "y"), T0)
    b.jobs_submit(specs(total // 3, "x", priority=2), T0)

    def claimer(store: PostgresStore, worker: str) -> list[str]:
        rng = random.Random(worker)
        leased: list[str] = []
        idle = 0
        while idle < 3:
            claims = [
                (rng.choice([["x"], ["y"], ["x", "y"]]), worker, rng.randint(1, 7), LEASE_MS, None)
                for _ in range(rng.randint(1, 3))
            ]
            store.begin()
            got = store.jobs_claim_many(claims, T0 + 1)
            if rng.random() < 0.5:
                time.sleep(0.001)  # hold the locks a little: the other must skip them
            store.commit()
            ids = [lease.job_id for leases in got for lease in leases]
            leased += ids
            idle = 0 if ids else idle + 1
        return leased

    first, second = run_together(lambda: claimer(a, "wa"), lambda: claimer(b, "wb"))
    assert isinstance(first, list) and isinstance(second, list)
    assert len(first) + len(second) == total
    assert set(first).isdisjoint(second)
    assert len(set(first) | set(second)) == total
    assert first and second, "both servers should have leased some"
    for store, worker, leased in ((a, "wa", first), (b, "wb", second)):
        for job_id in leased[:20]:
            assert store.job_inspect(job_id).worker_id == worker
    assert a.queue_stats() == b.queue_stats() == recount(a)


# -- the held-lease rule across servers -------------------------------------------------------


def test_a_token_is_refused_through_another_server_once_its_lease_has_ended(servers):
    a, b = servers(), servers()
    [job] = a.jobs_submit(specs(1, max_attempts=3), T0)
    [lease] = a.jobs_claim(["q"], "w1", 1, 1_000, T0)
    # Through the other server: a wrong token or worker is refused, the right one holds.
    with pytest.raises(StaleToken):
        b.jobs_ack(job.job_id, "w1", "0" * 32, None, T0 + 1)
    with pytest.raises(StaleToken):
        b.jobs_ack(job.job_id, "w2", lease.token, None, T0 + 1)
    assert b.lease_renew(job.job_id, "w1", lease.token, 1_000, T0 + 500) == T0 + 1_500
    # b's reaper ends it at the expiry renewed through b; a late ack through a is refused.
    assert [r.job_id for r in b.leases_reap_expired(T0 + 1_500, 10)] == [job.job_id]
    with pytest.raises(LeaseExpired):
        a.jobs_ack(job.job_id, "w1", lease.token, None, T0 + 1_600)
    # Leased again through a: the old token is stale through either server.
    [again] = a.jobs_claim(["q"], "w2", 1, LEASE_MS, T0 + 2_000)
    for store in (a, b):
        with pytest.raises(StaleToken):
            store.jobs_fail(job.job_id, "w1", lease.token, "late", True, T0 + 2_001)
    b.jobs_ack(job.job_id, "w2", again.token, '"done"', T0 + 2_002)
    a.jobs_ack(job.job_id, "w2", again.token, '"again"', T0 + 2_003)  # a repeat: ok
    info = a.job_inspect(job.job_id)
    assert (info.state, info.result, info.attempt) == (JobState.SUCCEEDED, '"done"', 2)


def test_a_reaper_skips_a_lease_another_server_is_acking_and_never_ends_it_after(servers):
    a, b = servers(), servers()
    [job] = a.jobs_submit(specs(1), T0)
    [lease] = a.jobs_claim(["q"], "w1", 1, 1_000, T0)
    a.begin()
    a.jobs_ack(job.job_id, "w1", lease.token, None, T0 + 999)  # row locked until commit
    assert b.leases_reap_expired(T0 + 5_000, 10) == []  # skipped, not waited for
    a.commit()
    assert b.leases_reap_expired(T0 + 5_000, 10) == []  # acked: nothing to reap
    assert b.job_inspect(job.job_id).state == JobState.SUCCEEDED


def test_an_ack_waits_for_a_reap_in_flight_and_then_answers_lease_expired(servers):
    a, b = servers(), servers()
    [job] = a.jobs_submit(specs(1, max_attempts=2), T0)
    [lease] = a.jobs_claim(["q"], "w1", 1, 1_000, T0)
    b.begin()
    assert len(b.leases_reap_expired(T0 + 1_000, 10)) == 1

    def late_ack() -> object:
        try:
            # This server's clock is behind: for it the lease has not expired yet.
            a.jobs_ack(job.job_id, "w1", lease.token, None, T0 + 999)
        except LeaseExpired as exc:
            return exc
        return None

    def reaper_commits() -> None:
        time.sleep(0.1)  # while the ack waits for the row
        b.commit()

    refused, _ = run_together(late_ack, reaper_commits)
    assert isinstance(refused, LeaseExpired) and refused.expired_at == T0 + 1_000
    assert a.job_inspect(job.job_id).state == JobState.READY


def test_a_database_whose_default_isolation_is_repeatable_read_still_reads_committed(servers):
    # The rules above rely on READ COMMITTED: a row locked after a wait is read as it is
    # now, and checked again. A database (or role) whose default_transaction_isolation is
    # stricter must not turn that wait into a serialization failure.
    a, b = servers(), servers()
    [job] = a.jobs_submit(specs(1, max_attempts=2), T0)
    [lease] = a.jobs_claim(["q"], "w1", 1, 1_000, T0)
    a._db.execute("SET default_transaction_isolation = 'repeatable read'")
    b.begin()
    assert len(b.leases_reap_expired(T0 + 1_000, 10)) == 1

    def late_ack() -> object:
        try:
            a.jobs_ack(job.job_id, "w1", lease.token, None, T0 + 999)
        except LeaseExpired as exc:
            return exc
        return None

    def reaper_commits() -> None:
        time.sleep(0.1)  # while the ack waits for the row
        b.commit()

    refused, _ = run_together(late_ack, reaper_commits)
    assert isinstance(refused, LeaseExpired)
    assert a.job_inspect(job.job_id).state == JobState.READY


# -- counts ------------------------------------------------------------------------------------


def test_every_server_counts_every_servers_jobs(servers):
    a, b = servers(slot=1), servers(slot=2)
    a.jobs_submit(specs(10, backoff=Backoff.fixed(10)), T0)
    leases = b.jobs_claim(["q"], "w", 6, LEASE_MS, T0)
    for lease in leases[:2]:
        a.jobs_ack(lease.job_id, "w", lease.token, None, T0 + 1)
    b.jobs_fail(leases[2].job_id, "w", leases[2].token, "e", True, T0 + 1)
    a.jobs_fail(leases[3].job_id, "w", leases[3].token, "e", False, T0 + 1)
    a.jobs_promote_due(T0 + 100, 10)
    b.dead_purge(leases[3].job_id)
    expected = {**dict.fromkeys(map(str, JobState), 0), "ready": 5, "leased": 2, "succeeded": 2}
    assert a.queue_stats() == b.queue_stats() == recount(a) == {"q": expected}
    # Each server's own rows hold its own moves, less the (queue, state) groups that the
    # purge found adding up to zero and dropped (here dead and retrying, one job each
    # way); the sum is the count.
    slots = dict(
        a._db.execute("SELECT slot, sum(n)::bigint FROM job_counts GROUP BY slot").fetchall()
    )
    assert slots == {1: 10, 2: -1}  # a made ten jobs, b purged one
    # Event totals are each server's own (Prometheus sums them over the servers).
    assert a.event_totals()[("q", "submitted")] == 10
    assert ("q", "submitted") not in b.event_totals()
    assert b.event_totals()[("q", "leased")] == 6


def test_a_depth_limit_counts_the_jobs_other_servers_submitted(servers):
    config = StoreConfig(max_depth=5)
    a, b = servers(config=config), servers(config=config)
    a.jobs_submit(specs(4), T0)
    with pytest.raises(QueueFull):
        b.jobs_submit(specs(2), T0)
    b.jobs_submit(specs(1), T0)


def test_servers_sharing_a_count_slot_commit_together_without_deadlock(servers):
    a, b = servers(slot=7), servers(slot=7)
    queues = [f"q{i}" for i in range(6)]

    def submitter(store: PostgresStore, order: list[str]) -> None:
        for round_ in range(40):
            store.begin()
            for queue in order:  # every transaction touches every (queue, state) row
                store.jobs_submit(specs(1, queue), T0 + round_)
            store.commit()

    run_together(lambda: submitter(a, queues), lambda: submitter(b, queues[::-1]))
    stats = a.queue_stats()
    assert stats == recount(a)
    assert {queue: by_state["ready"] for queue, by_state in stats.items()} == dict.fromkeys(
        queues, 80
    )


def test_a_queue_emptied_through_other_servers_leaves_no_count(servers):
    a, b = servers(slot=1), servers(slot=2)
    [job] = a.jobs_submit(specs(1, max_attempts=1), T0)
    [lease] = b.jobs_claim(["q"], "w", 1, LEASE_MS, T0)
    b.jobs_fail(job.job_id, "w", lease.token, "x", False, T0)
    a.dead_purge_queue("q", 10)
    assert a.queue_stats() == b.queue_stats() == {}


def test_a_queue_emptied_through_several_slots_leaves_no_count_rows(servers):
    # Each server (and each run of one) adds to a slot of its own: a queue's job moved
    # through two slots leaves rows of opposite sums. Once the queue is empty they must
    # go, or job_counts (read whole by every stats) keeps rows for every queue name ever
    # used, which clients choose freely.
    a, b = servers(slot=1), servers(slot=2)
    for i in range(5):
        queue = f"tenant-{i}"
        [job] = a.jobs_submit(specs(1, queue), T0)
        [lease] = b.jobs_claim([queue], "w", 1, LEASE_MS, T0)
        a.jobs_ack(job.job_id, "w", lease.token, None, T0)
    b.jobs_prune(T0 + 30 * 24 * 3600 * 1000, 100)
    assert a.queue_stats() == b.queue_stats() == {}
    assert a._db.execute("SELECT count(*) FROM job_counts").fetchone() == (0,)


# -- time-driven passes and dead letters --------------------------------------------------------


@pytest.mark.parametrize("kind", ["promote", "reap", "prune", "dead_retry", "dead_purge"])
def test_two_servers_passing_at_once_split_the_rows_between_them(servers, kind):
    a, b = servers(), servers()
    n = 10
    if kind == "promote":
        a.jobs_submit(specs(n, delay_ms=10), T0)
    else:
        a.jobs_submit(specs(n, max_attempts=1), T0)
        leases = a.jobs_claim(["q"], "w", n, 1_000, T0)
        for lease in leases:
            if kind == "prune":
                a.jobs_ack(lease.job_id, "w", lease.token, None, T0)
            elif kind.startswith("dead"):
                a.jobs_fail(lease.job_id, "w", lease.token, "x", False, T0)
    far = T0 + 30 * 24 * 3600 * 1000

    def run(store: PostgresStore, limit: int) -> int:
        if kind == "promote":
            return store.jobs_promote_due(T0 + 10, limit)
        if kind == "reap":
            return len(store.leases_reap_expired(T0 + 1_000, limit))
        if kind == "prune":
            return store.jobs_prune(far, limit)
        if kind == "dead_retry":
            return store.dead_retry_queue("q", T0 + 1, limit)
        return store.dead_purge_queue("q", limit)

    a.begin()
    first = run(a, 4)  # its rows locked until it commits
    second = run(b, n)  # the rest, at once
    a.commit()
    assert (first, second) == (4, n - 4)
    assert run(b, n) == 0
    assert a.queue_stats() == b.queue_stats() == recount(a)


# -- idempotency keys ----------------------------------------------------------------------------


def test_one_key_submitted_through_two_servers_at_once_makes_one_job(servers):
    a, b = servers(), servers()
    b._db.execute("SET lock_timeout = 0")  # it waits for a's key, as long as a takes
    a.begin()
    [first] = a.jobs_submit([SubmitSpec("q", "1", idempotency_key="k")], T0)

    def other_server() -> object:
        # Through b while a's key is in flight: b waits for a's commit, then answers a's job.
        return b.jobs_submit(
            [SubmitSpec("q", "2", idempotency_key="k"), SubmitSpec("q", "3")], T0 + 1
        )

    def commit_later() -> None:
        time.sleep(0.2)
        a.commit()

    results, _ = run_together(other_server, commit_later)
    assert isinstance(results, list)
    assert (results[0].job_id, results[0].duplicate) == (first.job_id, True)
    assert results[1].duplicate is False
    assert recount(a) == a.queue_stats() == b.queue_stats()
    assert a.queue_stats()["q"]["ready"] == 2
    assert b.job_inspect(first.job_id).payload == "1"


def test_a_key_whose_window_passed_is_taken_over_through_another_server(servers):
    config = StoreConfig(idempotency_window_ms=1_000)
    a, b = servers(config=config), servers(config=config)
    [first] = a.jobs_submit([SubmitSpec("q", "1", idempotency_key="k")], T0)
    [second] = b.jobs_submit([SubmitSpec("q", "2", idempotency_key="k")], T0 + 1_000)
    assert second.duplicate is False and second.job_id != first.job_id
    [third] = a.jobs_submit([SubmitSpec("q", "3", idempotency_key="k")], T0 + 1_001)
    assert (third.job_id, third.duplicate) == (second.job_id, True)


# -- job ids --------------------------------------------------------------------------------------


def test_ids_from_servers_whose_clocks_differ_are_distinct_and_in_order(servers):
    ahead, behind = servers(), servers()
    ids = []
    for i in range(20):
        store, now = (ahead, T0 + 60_000) if i % 2 else (behind, T0 - 60_000)
        ids += [r.job_id for r in store.jobs_submit(specs(3), now + i)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # Their time part follows the fastest clock, at most a second behind it.
    assert int(ids[-1][4:], 16) >> 21 >= T0 + 60_000 - 1_000


# -- texts PostgreSQL cannot hold as given ---------------------------------------------------------


@given(strategies.text(alphabet=strategies.sampled_from("\x00\x01AB\\x\u00e9"), max_size=12))
def test_stored_texts_read_back_as_given_and_stay_distinct(text):
    encoded = encode_text(text)
    assert "\x00" not in encoded
    assert decode_text(encoded) == text


def test_nul_in_worker_ids_errors_and_keys_round_trips_and_keys_stay_distinct(servers):
    store = servers()
    results = store.jobs_submit(
        [
            SubmitSpec("q", "1", idempotency_key="k\x00"),
            SubmitSpec("q", "2", idempotency_key="k\x01B"),  # what "k\x00" is stored as
            SubmitSpec("q", "3", idempotency_key="k\x00"),
        ],
        T0,
    )
    assert [r.duplicate for r in results] == [False, False, True]
    assert results[0].job_id != results[1].job_id
    leases = store.jobs_claim(["q"], "w\x00", 2, LEASE_MS, T0)
    with pytest.raises(StaleToken):
        store.jobs_ack(leases[0].job_id, "w\x01B", leases[0].token, None, T0)
    store.jobs_fail(leases[0].job_id, "w\x00", leases[0].token, "bad\x00byte", True, T0)
    info = store.job_inspect(leases[0].job_id)
    assert (info.worker_id, info.last_error) == ("w\x00", "bad\x00byte")
    assert info.idempotency_key == "k\x00"
    assert info.errors[0].error == "bad\x00byte"
    assert Counter(r.job_id for r in results)[results[0].job_id] == 2


# -- query plans -------------------------------------------------------------------------------


# Runs of a prepared statement before the plan that PostgreSQL's plan cache settles on is
# the one to check: it plans the first five with their values, then compares.
PREPARED_RUNS = 10


def _plan(conn: psycopg.Connection, statement: str, params: tuple | dict, prepared: bool) -> str:
    """EXPLAIN of ``statement`` as the store runs it: with its values (its first runs), or
    prepared, as psycopg runs it from its sixth run on, after PREPARED_RUNS runs (in a
    transaction rolled back afterwards). ``conn``: a connection of the test's own."""
    if not prepared:
        return "\n".join(row[0] for row in conn.execute("EXPLAIN " + statement, params))
    if isinstance(params, dict):
        names: list[str] = []

        def number(match: re.Match) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        text = re.sub(r"%\((\w+)\)[sb]", number, statement)
        values = [params[name] for name in names]
    else:
        count = iter(range(1, 100))
        text = re.sub("%[sb]", lambda _: f"${next(count)}", statement)
        values = list(params)
    arguments = f"({', '.join(sql.quote(value) for value in values)})" if values else ""
    # (prepare=False throughout: psycopg must not prepare these statements in turn.)
    run = functools.partial(conn.execute, prepare=False)
    run("PREPARE planned AS " + text)
    run("BEGIN")
    try:
        for _ in range(PREPARED_RUNS):
            run(f"EXECUTE planned{arguments}")
        return "\n".join(row[0] for row in run(f"EXPLAIN EXECUTE planned{arguments}"))
    finally:
        run("ROLLBACK")
        run("DEALLOCATE ALL")


def test_the_statements_of_every_batch_keep_one_plan_and_are_not_planned_per_run(servers):
    """A prepared statement whose plans with its values look cheaper than its generic plan
    (an array's length, a LIMIT, known only then) is planned anew on every run for as long
    as the connection lives: 0.2-0.4 ms of the database's CPU each time, a claim's most.
    The statements of submits, claims and acks, run as the writer runs them, with batches
    of every size, settle on their generic plan once prepared (at their first run)."""
    store, other = servers(), servers()
    # Another server waits on many queues: each submit's notification looks among them.
    other.waiters_put([f"w{i}" for i in range(300)] + ["q2"], [], T0 + 60_000, T0)
    sizes = [1, 64, 2, 40, 3, 17, 8, 100, 5, 33, 1, 64, 7, 50]
    now = T0
    for size in sizes:
        now += 1
        store.begin()
        more = [spec for i in range(size % 6) for spec in specs(1, f"w{i}")]
        # (ids read first, and drawn by the insert: the writer's submits)
        submit = store.jobs_submit if size % 2 else store.jobs_submit_later
        submit(specs(size) + specs(size, "q2") + more, now)
        store.commit()
        store.begin()
        store.jobs_submit_later(specs(1, f"w{size % 6}"), now)  # (one job: its own insert)
        store.commit()
        store.begin()
        leases = store.jobs_claim_many(
            [(["q"], "w", size, LEASE_MS, None), (["q", "q2"], "v", size, LEASE_MS, None)], now
        )
        store.commit()
        store.begin()
        store.jobs_ack_many(
            [
                (x.job_id, worker, x.token, None)
                for leased, worker in zip(leases, "wv", strict=True)
                for x in leased
            ],
            now,
        )
        store.commit()
    plans = store._db.execute(
        "SELECT custom_plans, generic_plans, statement FROM pg_prepared_statements"
    ).fetchall()
    hot = ("FROM jobs WHERE state = 'ready'", "UPDATE jobs SET state = 'leased'",
           "UPDATE jobs SET state = 'succeeded'", "INSERT INTO jobs", "nextval",
           "AS max_attempts) t", "pg_notify")  # fmt: skip
    for fragment in hot:
        assert any(fragment in statement for *_, statement in plans), (fragment, plans)
    replanned = [(custom, statement[:80]) for custom, _, statement in plans if custom > 5]
    assert not replanned


@pytest.mark.parametrize("prepared", [False, True], ids=["first-runs", "prepared"])
def test_every_pass_scans_only_its_state_through_a_partial_index(servers, url, prepared):
    store = servers()
    for minute in range(4):
        store.jobs_submit(
            [SubmitSpec(f"q{i % 3}", "{}", priority=i % 4) for i in range(1_000)]
            + specs(500, "later", delay_ms=3_600_000),
            T0 + minute * 60_000,
        )
    leases = store.jobs_claim(["q0", "q1"], "w", 600, LEASE_MS, T0 + 300_000)
    store.jobs_ack_many([(x.job_id, "w", x.token, None) for x in leases[:200]], T0 + 300_001)
    for lease in leases[200:300]:
        store.jobs_fail(lease.job_id, "w", lease.token, "x", False, T0 + 300_001)
    store._db.execute("ANALYZE")
    now = T0 + 300_002
    with psycopg.connect(url, autocommit=True) as conn:
        for statement, params, index in [
            (leases_sql._CANDIDATES, (["q0", "q2"], 10), "jobs_ready"),
            # A claim's update and an ack's: each job by its key, whatever the batch.
            (
                leases_sql._CLAIM,
                (now, now, [1, 2], ["t", "t"], ["w", "w"], [now, now]),
                "jobs_pkey",
            ),
            (
                leases_sql._ACK_HELD,
                (now, [1, 2], ["w", "w"], ["t", "t"], ["r", "r"], now),
                "jobs_pkey",
            ),
            (maintenance_sql._PROMOTE, (now, 100), "jobs_due"),
            (maintenance_sql._REAP, {"now": now, "limit": 100, "error": "e"}, "jobs_leased"),
            (maintenance_sql._PRUNE_JOBS, (now, 100), "jobs_succeeded"),
            (maintenance_sql._PRUNE_CANCELLED, (now, 100), "jobs_cancelled"),
            (cancel_sql._CANCEL_GROUP[0][0], ("q0", ["ready"], 10, now), "jobs_ready"),
            (cancel_sql._CANCEL_GROUP[1][0], ("q0", ["pending"], 10, now), "jobs_due_queue"),
            ("SELECT min(run_at) FROM jobs WHERE state IN ('pending', 'retrying')", (), "jobs_due"),
            ("SELECT min(lease_expires_at) FROM jobs WHERE state = 'leased'", (), "jobs_leased"),
            (reads_sql._DEAD, (-1, 10), "jobs_dead"),
            (reads_sql._DEAD_OF_QUEUE, ("q0", -1, 10), "jobs_dead_queue"),
            (reads_sql._DEAD_NEWEST, (MAX_JOB_KEY, 10), "jobs_dead"),
            (reads_sql._DEAD_OF_QUEUE_NEWEST, ("q0", MAX_JOB_KEY, 10), "jobs_dead_queue"),
            (dead_sql._PURGE_QUEUE, ("q0", 10), "jobs_dead_queue"),
            # A page of the job browser: each (queue, state)'s run from the index.
            (
                browse_sql._RUNS[True],
                (["q0"], ["succeeded"], MAX_JOB_KEY, 51, 51),
                "jobs_queue_state",
            ),
            # An abbreviated id (inspect with prefix): a range of the key, whatever the jobs.
            (reads_sql._PREFIX_KEYS, (T0 << 21, (T0 + 60_000) << 21), "jobs_pkey"),
            # short_ids: each id's nearest keys below and above, whatever the jobs.
            (reads_sql._NEIGHBOURS, ([T0 << 21, (T0 + 60_000) << 21],), "jobs_pkey"),
        ]:
            plan = _plan(conn, statement, params, prepared)
            assert f"using {index} on jobs" in plan, plan
            assert "Seq Scan on jobs" not in plan, plan
            if index == "jobs_ready":  # each class's oldest first, in the index's order
                assert "Sort" not in plan, plan
            if statement in reads_sql._DEAD_PAGES.values():  # either order: the index's
                assert "Sort" not in plan, plan
        # A queue's leased jobs to cancel: read from jobs_leased (every lease held, a number
        # the workers' slots bound), a bitmap scan of it or a plain one; or from the job
        # browser's index (queue, state, id), which holds exactly that queue's leased jobs.
        plan = _plan(conn, cancel_sql._CANCEL_GROUP[2][0], ("q0", ["leased"], 10, now), prepared)
        assert any(
            f"Scan on {index}" in plan or f"using {index}" in plan
            for index in ("jobs_leased", "jobs_queue_state")
        ), plan
        assert "Seq Scan on jobs" not in plan, plan


# -- queue settings ----------------------------------------------------------------------


def test_a_pause_through_one_server_stops_the_next_claim_of_every_server(servers):
    a, b = servers(), servers()
    jobs = [r.job_id for r in a.jobs_submit(specs(3) + specs(1, "other"), T0)]
    a.queue_pause("q", True, T0)
    # Server b never heard of it: its next claim reads the setting in its own statement.
    assert [lease.job_id for lease in b.jobs_claim(["q", "other"], "w", 10, LEASE_MS, T0)] == [
        jobs[3]
    ]
    assert b.jobs_claim(["q"], "w", 10, LEASE_MS, T0) == []
    # Resumed through b: a's next claim takes them, and b's commit told the others.
    b.take_changes()
    b.queue_pause("q", False, T0 + 1)
    assert b.take_changes().ready_counts == {"q": 3}
    assert [lease.job_id for lease in a.jobs_claim(["q"], "w", 10, LEASE_MS, T0 + 2)] == jobs[:3]


def test_a_resume_notifies_the_other_servers_of_its_ready_jobs(servers, url):
    from relay.store.postgres import notify

    a, b = servers(), servers()
    a.jobs_submit(specs(2), T0)
    a.queue_pause("q", True, T0)
    b.waiters_put(["q"], [], T0 + 60_000, T0)  # (b has long-polls parked on q)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        a.take_changes()  # (what the submit made ready: a writer takes it at its commit)
        a.begin()
        a.queue_pause("q", False, T0 + 1)
        a.commit()
        notes = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    [changes] = [notify.parse(note, "another server") for note in notes]
    assert changes.ready_counts == {"q": 2}


def test_a_server_learns_of_another_servers_pause_as_it_refreshes_its_counts(servers):
    a, b = servers(), servers()
    a.jobs_submit(specs(1), T0)
    a.queue_pause("q", True, T0)
    assert a.view.paused == {"q"}
    assert b.view.paused == frozenset()
    assert b.counts_refresh(None, 100) is None
    assert b.view.paused == {"q"}
    a.queue_pause("q", False, T0)
    b.counts_refresh(None, 100)
    assert b.view.paused == frozenset()


def test_a_server_learns_of_another_servers_limits_as_it_refreshes_its_counts(servers):
    a, b = servers(), servers()
    a.jobs_submit(specs(1), T0)
    a.queue_config("q", {"max_leased": 3, "rate": Rate(10, 1000)}, T0)
    a.queue_config("later", {"max_leased": 1}, T0)  # (no jobs)
    assert b.view.limits == {}
    assert b.counts_refresh(None, 100) is None
    assert b.view.limits == {"later": (1, None), "q": (3, Rate(10, 1000))}
    a.queue_config("q", {"max_leased": None, "rate": None}, T0)
    b.counts_refresh(None, 100)
    assert b.view.limits == {"later": (1, None)}
    assert servers().view.limits == {"later": (1, None)}  # (as a server opens)


# -- keys across servers ---------------------------------------------------------------------


def test_a_job_that_loses_its_unique_key_to_another_server_leaves_no_idempotency_key(servers):
    """A submit whose job took its idempotency key and then lost its unique key to another
    server's job (committed while it waited) is answered as that job's duplicate, as on
    SQLite, and records no key: the next submit with the key makes a job. (The lost job's
    key once stayed, pointing at no job, and refused the key for its whole window.)"""
    a, b = servers(), servers()
    a.begin()
    [held] = a.jobs_submit(specs(1, unique_key="u"), T0)  # holds the unique row
    done = threading.Event()
    answers: list[object] = []

    def submit_on_b() -> None:
        b.begin()
        answers.extend(b.jobs_submit(specs(1, unique_key="u", idempotency_key="k"), T0))
        b.commit()
        done.set()

    thread = threading.Thread(target=submit_on_b)
    thread.start()
    assert not done.wait(0.3)  # b waits for a's unique key
    a.commit()
    thread.join(10)
    assert done.is_set() and answers == [SubmitResult(held.job_id, held.state, duplicate=True)]
    [again] = b.jobs_submit(specs(1, idempotency_key="k"), T0 + 1)
    assert not again.duplicate and again.job_id != held.job_id
    [repeat] = a.jobs_submit(specs(1, idempotency_key="k"), T0 + 2)
    assert repeat == SubmitResult(again.job_id, again.state, duplicate=True)


# -- round trips -------------------------------------------------------------------------


class RoundTrips:
    """Counts the round trips of a store's connection: a statement run by the connection
    itself is one, and so is each pipeline of the store's ``Pipe`` (its statements go out
    together, their results come back together)."""

    def __init__(self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self._direct = 0
        self._pipe = store._pipe
        self._start = self._pipe.round_trips
        conn = store._db
        execute = conn.execute

        def counted_execute(*args: object, **kwargs: object) -> object:
            self._direct += 1
            return execute(*args, **kwargs)

        monkeypatch.setattr(conn, "execute", counted_execute)

    @property
    def n(self) -> int:
        return self._direct + self._pipe.round_trips - self._start


def test_a_batch_takes_the_same_few_round_trips_whatever_its_size(servers, monkeypatch):
    a = servers()
    a.jobs_submit(specs(1, queue="first"), T0)  # (the first moves the id sequence up)
    trips = RoundTrips(a, monkeypatch)
    for n in (1, 40):
        before = trips.n
        a.begin()
        a.jobs_submit(specs(2 * n), T0)
        a.commit()
        assert trips.n - before == 2  # (BEGIN, the ids), (the insert, the counts, COMMIT)
        claims = [(("q",), f"w{i}", 1, LEASE_MS, None) for i in range(n)]
        before = trips.n
        a.begin()
        leases = [lease for mine in a.jobs_claim_many(claims, T0 + 1) for lease in mine]
        a.commit()
        assert len(leases) == n and trips.n - before == 2  # (candidates), (update, COMMIT)
        acks = [(lease.job_id, f"w{i}", lease.token, None) for i, lease in enumerate(leases)]
        claims = [(("q",), f"v{i}", 1, LEASE_MS, None) for i in range(n)]
        before = trips.n
        a.begin()
        more = a.jobs_claim_many(claims, T0 + 2)
        assert a.jobs_ack_many(acks, T0 + 2) == [None] * n
        a.commit()
        # (BEGIN, candidates), (the claim's update, the acks' update), (counts, COMMIT)
        assert trips.n - before == 3
        assert all(len(mine) == 1 for mine in more)
    assert recount(a)["q"]["succeeded"] == 41 and recount(a)["q"]["leased"] == 41


# A notification that fails as it runs, and one that fails at its own transaction's
# commit (as PostgreSQL refuses one over a full notification queue): after the COMMIT,
# in the same round trip. (With the values of NOTIFY_IF_WAITED: the payload, the queues,
# the origin.)
_WAITED = "WHERE %s::text > '' AND %s::text[] IS NOT NULL AND %s::text > ''"
FAILING_NOTIFY = {
    "as-it-runs": f"SELECT 1 / 0 {_WAITED}",
    "at-its-commit": f"INSERT INTO later SELECT 1 FROM (VALUES (1), (1)) v {_WAITED}",
}


@pytest.mark.parametrize("failing", FAILING_NOTIFY)
def test_a_commit_stands_when_only_its_notification_fails(servers, monkeypatch, caplog, failing):
    a = servers()
    a._db.execute("CREATE TABLE later (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    monkeypatch.setattr(notify, "NOTIFY_IF_WAITED", FAILING_NOTIFY[failing])
    a.begin()
    a.jobs_submit(specs(2), T0)
    a.commit()
    assert "a commit's notification could not be sent" in caplog.text
    assert recount(a)["q"]["ready"] == 2 == a.queue_stats()["q"]["ready"]
    a.begin()  # (and the connection is ready for the next transaction)
    a.jobs_submit(specs(1), T0 + 1)
    a.commit()
    assert recount(a)["q"]["ready"] == 3


def test_a_failed_commit_raises_its_own_error(servers):
    a = servers()
    a._db.execute("CREATE TABLE later (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    a.begin()
    a._write_later("INSERT INTO later VALUES (1), (1)")  # (refused at the COMMIT only)
    a._flush()
    with pytest.raises(psycopg.errors.UniqueViolation):
        a.commit()  # (the COMMIT alone: no counts moved)
    a.rollback()
    assert a._db.execute("SELECT count(*) FROM later").fetchone() == (0,)


def test_a_claim_reads_its_leases_with_the_candidates_also_a_large_payload(servers):
    a = servers()
    large = "x" * (leases_sql.SMALL_PAYLOAD + 1)
    a.jobs_submit([SubmitSpec("q", large), SubmitSpec("q", '"small"')], T0)
    a.jobs_submit([SubmitSpec("q", '"retried"', max_attempts=3)], T0)
    leases = a.jobs_claim(["q"], "w", 3, LEASE_MS, T0 + 1)
    assert [lease.payload for lease in leases] == [large, '"small"', '"retried"']
    assert [lease.attempt for lease in leases] == [1, 1, 1]
    assert [lease.max_attempts for lease in leases][2] == 3
    a.jobs_fail(leases[2].job_id, "w", leases[2].token, "no", True, T0 + 2)
    a._db.execute("UPDATE jobs SET state = 'ready', run_at = NULL WHERE state = 'retrying'")
    [again] = a.jobs_claim(["q"], "w", 1, LEASE_MS, T0 + 3)
    assert (again.payload, again.attempt) == ('"retried"', 2)
    row = a._db.execute(
        "SELECT state, attempt, lease_token, leased_at FROM jobs WHERE payload = %s",
        ('"retried"',),
    ).fetchone()
    assert row == ("leased", 2, again.token, T0 + 3)


def test_a_write_sent_later_that_fails_fails_its_own_command_only(servers):
    a = servers()
    a.jobs_submit(specs(2), T0)
    [one, two] = a.jobs_claim(["q"], "w", 2, LEASE_MS, T0)
    a.begin()
    with a.command():
        a.jobs_ack(one.job_id, "w", one.token, None, T0 + 1)
    with pytest.raises(psycopg.errors.DivisionByZero), a.command():
        a.jobs_ack(two.job_id, "w", two.token, None, T0 + 1)
        a._write_later("SELECT 1 / 0")  # (fails as it is sent: at the command's end)
    a.commit()
    assert recount(a)["q"] == {**recount(a)["q"], "succeeded": 1, "leased": 1}
    assert a.queue_stats()["q"]["succeeded"] == 1


def test_a_command_that_raises_drops_its_writes_not_sent_yet(servers):
    a = servers()
    a.jobs_submit(specs(1), T0)
    [lease] = a.jobs_claim(["q"], "w", 1, LEASE_MS, T0)
    a.begin()
    with pytest.raises(ValueError), a.command():
        a._write_later("SELECT 1 / 0")  # (would fail the transaction if it were sent)
        raise ValueError("refused")
    a.jobs_ack(lease.job_id, "w", lease.token, None, T0 + 1)
    a.commit()
    assert recount(a)["q"]["succeeded"] == 1


def test_a_commit_whose_notification_fails_stands_and_one_that_fails_sends_none(
    servers, url, monkeypatch
):
    from relay.store.postgres import notify

    a, b = servers(), servers()
    b.waiters_put(["q", "x", "r"], [], T0 + 60_000, T0)  # (b waits on them: a tells b)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        a.begin()
        a.jobs_submit(specs(1), T0)
        a._write_later("SELECT 1 / 0")
        with pytest.raises(psycopg.errors.DivisionByZero):
            a.commit()
        a.rollback()
        assert recount(a) == {}
        with monkeypatch.context() as failing:
            failing.setattr(notify, "NOTIFY_IF_WAITED", "SELECT 1 / 0, %s, %s, %s")
            a.begin()
            a.jobs_submit(specs(1, queue="x"), T0)
            a.commit()  # (logged, not raised)
        assert recount(a)["x"]["ready"] == 1
        a.begin()
        a.jobs_submit(specs(1, queue="r"), T0)
        a.commit()
        notes = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    heard = [notify.parse(note, "another server") for note in notes]
    assert [changes.ready_counts for changes in heard] == [{"r": 1}]


def test_a_lease_expiry_is_told_once_until_it_has_passed(servers, url):
    from relay.store.postgres import notify

    a, b = servers(), servers()
    a.jobs_submit(specs(4), T0)
    b.waiters_put(["r"], [], T0 + 60_000, T0)  # (b waits on r: a tells b of r's job)
    heard = []
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        for at in (T0 + 1, T0 + 2, T0 + LEASE_MS + 1, T0 + LEASE_MS + 2):
            a.take_changes()
            a.jobs_claim(["q"], "w", 1, LEASE_MS, at)
        a.begin()
        a.jobs_submit(specs(1, queue="r"), T0 + LEASE_MS + 3)  # (the last one: a queue)
        a.commit()
        for note in listener.notifies(timeout=5):
            heard.append(notify.parse(note.payload, "another server"))
            if heard[-1].ready_queues:
                break
    assert [c.next_expiry_at for c in heard] == [T0 + 1 + LEASE_MS, T0 + 2 * LEASE_MS + 1, None]
