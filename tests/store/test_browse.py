"""The job browser and its actions, on both stores: a page of any states' jobs
(``jobs_list``), a queue's bulk retry and purge by state (``dead_retry_queue``,
``dead_purge_queue`` with ``states``) and ``job_promote``.

What is checked comes from docs/protocol.md ("jobs_list", "dead_retry", "promote"): pages
by job id, newest first or oldest, that together give each job once; filters by queue,
state and search; items without payload; bounded pieces of bulk work; promote of a waiting
job only.
"""

from __future__ import annotations

import pytest

from relay.protocol.errors import BadRequest, InvalidState, JobNotFound, StaleToken
from relay.protocol.model import JobState
from relay.store import rows
from relay.store.base import SUMMARY_ERROR_CHARS
from tests.conftest import T0
from tests.store.conformance import Store
from tests.store.test_cancel import make
from tests.store.test_sqlite import DAY, claim_one, make_dead, recount, state, submit

EVERY = [str(s) for s in JobState]


def every_page(store: Store, limit: int, **kw) -> list[str]:
    """The job ids of every page of ``jobs_list`` with ``kw``, following its cursor."""
    args = {"queue": None, "states": EVERY, "search": None, "newest": True, **kw}
    ids, cursor = [], None
    for _ in range(100):
        jobs, cursor = store.jobs_list(
            args["queue"], args["states"], args["search"], cursor, limit, args["newest"]
        )
        assert len(jobs) <= limit
        ids += [job.job_id for job in jobs]
        if cursor is None:
            return ids
    raise AssertionError("no last page")


def mixed(store: Store) -> dict[str, list[str]]:
    """Jobs of every state in two queues; state -> ids, oldest first."""
    made: dict[str, list[str]] = {}
    for i, queue in enumerate(("a", "b", "a")):
        now = T0 + 10 * i
        for wanted in ("retrying", "leased"):
            made.setdefault(wanted, []).append(make(store, wanted, now, queue))
        made.setdefault("dead", []).append(make_dead(store, now, queue))
        done = submit(store, now, queue)
        lease = claim_one(store, now, (queue,))
        assert lease.job_id == done
        store.jobs_ack(done, "w1", lease.token, '{"r": 1}', now)
        made.setdefault("succeeded", []).append(done)
        gone = submit(store, now, queue)
        store.job_cancel(gone, now)
        made.setdefault("cancelled", []).append(gone)
    for i, queue in enumerate(("a", "b", "a")):  # (after: a ready job would be claimed)
        for wanted in ("ready", "pending"):
            made.setdefault(wanted, []).append(make(store, wanted, T0 + 100 + i, queue))
    return made


def test_pages_give_every_job_once_newest_first_or_oldest(store):
    made = mixed(store)
    everyone = sorted(j for ids in made.values() for j in ids)
    for limit in (1, 2, 5, 100):
        assert every_page(store, limit) == everyone[::-1]
        assert every_page(store, limit, newest=False) == everyone


def test_filters_by_queue_and_states(store):
    made = mixed(store)
    of_a = {j for ids in made.values() for j in ids if store.job_inspect(j).queue == "a"}
    assert sorted(every_page(store, 3, queue="a")) == sorted(of_a)
    for wanted in made:
        assert every_page(store, 2, states=[wanted], newest=False) == made[wanted]
    two = sorted(made["dead"] + made["cancelled"])
    assert every_page(store, 2, states=["dead", "cancelled"], newest=False) == two
    assert every_page(store, 2, queue="nope") == []
    assert every_page(store, 2, queue="b", states=["succeeded"]) == [made["succeeded"][1]]


def test_an_item_has_no_payload_result_or_errors_and_a_short_last_error(store):
    job = submit(store, T0, "q", max_attempts=1, payload='{"big": "' + "x" * 1000 + '"}')
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "e" * 5000, False, T0 + 1)
    [item], cursor = store.jobs_list("q", EVERY, None, None, 10, True)
    assert cursor is None
    assert (item.job_id, item.state, item.attempt, item.worker_id) == (job, "dead", 1, "w1")
    assert (item.payload, item.result, item.errors) == ("", None, ())
    assert item.last_error == "e" * SUMMARY_ERROR_CHARS
    assert (item.created_at, item.finished_at) == (T0, T0 + 1)


def test_search_by_id_prefix_and_by_key_prefix(store):
    a = submit(store, T0, "q", idempotency_key="order-17")
    b = submit(store, T0 + 1, "q", unique_key="order-18")
    c = submit(store, T0 + 2, "q", idempotency_key="invoice-1")
    other = submit(store, T0 + 3, "r", idempotency_key="order-19")
    assert every_page(store, 1, queue="q", search="order-") == [b, a]
    assert every_page(store, 10, queue="q", search="invoice") == [c]
    assert every_page(store, 10, queue="q", search="nothing") == []
    assert every_page(store, 10, queue="r", search="order") == [other]
    # A job id's start: one range of the key, with or without the queue.
    assert every_page(store, 10, search=a[:11]) == [other, c, b, a]
    assert every_page(store, 10, search=a) == [a]
    assert every_page(store, 10, search=a, queue="r") == []
    assert every_page(store, 10, search=a[:11], states=["pending"]) == []
    with pytest.raises(BadRequest, match=r"search: .*needs queue"):
        store.jobs_list(None, EVERY, "order-", None, 10, True)


def test_a_key_search_matching_too_many_keys_is_refused(store):
    from relay.store.rows import KEY_SEARCH_MAX

    specs = [f"k{i:05d}" for i in range(KEY_SEARCH_MAX + 1)]
    for key in specs:
        submit(store, T0, "q", idempotency_key=key)
    with pytest.raises(BadRequest, match="give more of it"):
        store.jobs_list("q", EVERY, "k", None, 10, True)
    assert len(every_page(store, 100, queue="q", search="k0000")) == 10


# -- what one page may cost ---------------------------------------------------------------


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of every queue past 2 (queue, state) held are read by id, 5 jobs at most."""
    monkeypatch.setattr(rows, "MERGED_RUNS_MAX", 2)
    monkeypatch.setattr(rows, "ROWS_EXAMINED_MAX", 5)


def test_pages_read_by_id_within_a_budget_give_what_merged_pages_give(store, monkeypatch):
    """Every queue's pages (and a search's by an id's start) are the same jobs, in the
    same order, whether merged from the index by (queue, state, id) or read by id a few
    jobs at a time, in any states; the ones read by id are short where their budget ran
    out, and their cursors go on."""
    made = mixed(store)
    first = made["retrying"][0]
    submit(store, T0 + 1_000, "b", idempotency_key=first[:11] + "-k")  # (found by its key)
    cases = [{"states": [wanted], "newest": newest} for wanted in made for newest in (True, False)]
    cases += [{"states": EVERY}, {"states": ["dead", "cancelled"], "newest": False}]
    cases += [{"search": first[:11]}, {"search": first[:11], "states": ["ready"]}]
    cases += [{"search": first[:11], "queue": "b", "newest": newest} for newest in (True, False)]
    merged = [every_page(store, 2, **case) for case in cases]
    monkeypatch.setattr(rows, "MERGED_RUNS_MAX", 1)
    monkeypatch.setattr(rows, "ROWS_EXAMINED_MAX", 5)
    assert [every_page(store, 2, **case) for case in cases] == merged
    # Ready jobs (of 2 queues) are the 6 newest: the first page of the oldest examines 5 jobs, finds
    # none, and says where to go on.
    jobs, cursor = store.jobs_list(None, ["ready"], None, None, 2, False)
    assert (jobs, cursor) == ([], every_page(store, 100, newest=False)[4])
    jobs, cursor = store.jobs_list(None, ["ready"], first[:11], None, 2, False)
    assert (jobs, cursor) == ([], every_page(store, 100, newest=False)[4])


def test_a_page_of_every_queues_dead_jobs_needs_no_budget(store, small_bounds):
    """Every queue's dead jobs have an index by id of their own: full pages."""
    made = mixed(store)
    for _ in range(10):
        submit(store, T0 + 1_000, "c")  # newer than all of them
    jobs, _ = store.jobs_list(None, ["dead"], None, None, 2, True)
    assert [job.job_id for job in jobs] == made["dead"][:-3:-1]
    assert every_page(store, 2, states=["dead"]) == made["dead"][::-1]


def test_a_page_counts_the_jobs_of_its_own_transaction(store, small_bounds):
    """A page read in the transaction that submitted jobs (the writer batches requests)
    lists them, merged or read by id."""
    store.begin()
    try:
        ids = [submit(store, T0, q) for q in ("x", "y")]
        assert every_page(store, 10, states=["ready"]) == ids[::-1]
        ids += [submit(store, T0, q) for q in ("z", "w")]
        assert every_page(store, 10, states=["ready"]) == ids[::-1]
    finally:
        store.rollback()


# -- bulk retry and purge by state ---------------------------------------------------------


def test_retry_a_queues_dead_and_cancelled_jobs_in_pieces(store):
    made = mixed(store)
    of_a = [j for j in made["dead"] + made["cancelled"] if store.job_inspect(j).queue == "a"]
    assert store.dead_retry_queue("a", T0 + 100, 3, ("dead", "cancelled")) == 3
    assert store.dead_retry_queue("a", T0 + 100, 3, ("dead", "cancelled")) == 1
    assert store.dead_retry_queue("a", T0 + 100, 3, ("dead", "cancelled")) == 0
    for job in of_a:
        info = store.job_inspect(job)
        assert (info.state, info.attempt, info.finished_at) == ("ready", 0, None)
    assert store.queue_stats()["b"]["dead"] == 1
    assert store.queue_stats() == recount(store)
    # The default is dead only, as before.
    assert store.dead_retry_queue("b", T0 + 100, 10) == 1
    assert store.queue_stats()["b"]["cancelled"] == 1


def test_a_cancelled_leased_job_retried_gets_a_fresh_lease(store):
    job = submit(store, T0)
    old = claim_one(store, T0)
    store.job_cancel(job, T0 + 1)
    assert store.dead_retry_queue("q", T0 + 2, 10, ("cancelled",)) == 1
    with pytest.raises(StaleToken):  # the old token holds nothing: stale, not cancelled
        store.jobs_ack(job, "w1", old.token, None, T0 + 2)
    lease = claim_one(store, T0 + 3)
    assert lease.job_id == job and lease.token != old.token
    store.jobs_ack(job, "w1", lease.token, None, T0 + 4)
    assert state(store, job) == "succeeded"


def test_purge_a_queues_finished_jobs_by_state(store):
    made = mixed(store)
    before = store.queue_stats()["a"]
    assert store.dead_purge_queue("a", 1000, ("succeeded",)) == 2
    assert store.dead_purge_queue("a", 3, ("dead", "cancelled")) == 3
    assert store.dead_purge_queue("a", 3, ("dead", "cancelled")) == 1
    after = store.queue_stats()["a"]
    assert (after["succeeded"], after["dead"], after["cancelled"]) == (0, 0, 0)
    assert after["ready"] == before["ready"]
    assert store.queue_stats() == recount(store)
    for job in made["succeeded"]:
        if job in every_page(store, 100, queue="b"):
            continue
        with pytest.raises(JobNotFound):
            store.job_inspect(job)


# -- promote -------------------------------------------------------------------------------


@pytest.mark.parametrize("was", ["pending", "retrying"])
def test_promote_makes_a_waiting_job_ready_now(store, was):
    job = make(store, was)
    assert store.job_promote(job, T0 + 7) == was
    info = store.job_inspect(job)
    assert (info.state, info.ready_at) == ("ready", T0 + 7)
    assert claim_one(store, T0 + 8).job_id == job
    assert store.queue_stats() == recount(store)


@pytest.mark.parametrize("wanted", ["ready", "leased", "succeeded", "dead", "cancelled"])
def test_promote_of_another_state_is_refused_and_changes_nothing(store, wanted):
    if wanted == "dead":
        job = make_dead(store)
    elif wanted == "succeeded":
        job = submit(store, T0)
        lease = claim_one(store, T0)
        store.jobs_ack(job, "w1", lease.token, None, T0)
    elif wanted == "cancelled":
        job = make(store, "leased")
        store.job_cancel(job, T0)
    else:
        job = make(store, wanted)
    before = store.job_inspect(job)
    with pytest.raises(InvalidState, match=f"cannot promote {job}: it is {wanted}"):
        store.job_promote(job, T0 + 1)
    assert store.job_inspect(job) == before
    with pytest.raises(JobNotFound):
        store.job_promote("job_0000000000000001", T0)
    with pytest.raises(JobNotFound):
        store.job_promote("nope", T0)


def test_a_delayed_job_promoted_is_not_promoted_again_by_the_clock(store):
    job = submit(store, T0, "q", delay_ms=DAY)
    store.job_promote(job, T0 + 1)
    assert store.jobs_promote_due(T0 + DAY + 1, 100) == 0
    assert state(store, job) == "ready"
