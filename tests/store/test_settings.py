"""Queue settings on both stores: a paused queue accepts submits and promotes its due jobs,
but no claim leases from it; its leased jobs run to the end; resuming it reports its ready
jobs as made ready, so that parked leases wake. Durable, and (PostgreSQL) seen by every
server's next claim."""

from __future__ import annotations

import pytest

from relay.protocol.errors import TooManyQueues
from relay.protocol.model import Backoff, JobState, Rate, SubmitSpec
from relay.store import base
from relay.store.base import QueueSettings
from tests.conftest import T0
from tests.store.conformance import Store, Stores

LEASE_MS = 30_000


def submit(store: Store, queue: str = "q", now: int = T0, **kw) -> str:
    return store.jobs_submit([SubmitSpec(queue, '{"n": 1}', **kw)], now)[0].job_id


def claimed(store: Store, queues: list[str], now: int = T0, count: int = 10) -> list[str]:
    return [lease.job_id for lease in store.jobs_claim(queues, "w1", count, LEASE_MS, now)]


def test_a_paused_queues_ready_job_is_not_claimed(store: Store) -> None:
    job = submit(store)
    assert store.queue_pause("q", True, T0) is True
    assert claimed(store, ["q"]) == []
    assert store.job_inspect(job).state == JobState.READY
    assert store.queue_stats()["q"]["ready"] == 1


def test_a_claim_of_several_queues_skips_only_the_paused_one(store: Store) -> None:
    a, b, c = submit(store, "a"), submit(store, "b"), submit(store, "c")
    store.queue_pause("b", True, T0)
    assert sorted(claimed(store, ["a", "b", "c"])) == sorted([a, c])
    # Many claims at once, each seeing only the queues not paused.
    a2, b2 = submit(store, "a", T0 + 1), submit(store, "b", T0 + 1)
    outcomes = store.jobs_claim_many(
        [(["b"], "w1", 5, LEASE_MS, None), (["b", "a"], "w2", 5, LEASE_MS, None)], T0 + 2
    )
    assert [[lease.job_id for lease in leases] for leases in outcomes] == [[], [a2]]
    assert store.job_inspect(b).state == store.job_inspect(b2).state == JobState.READY


def test_resume_makes_the_queue_claimable_and_reports_its_ready_jobs(store: Store) -> None:
    jobs = [submit(store, "q", T0 + i) for i in range(3)]
    store.queue_pause("q", True, T0 + 10)
    assert claimed(store, ["q"], T0 + 11) == []
    store.take_changes()
    assert store.queue_pause("q", False, T0 + 12) is False
    changes = store.take_changes()
    assert changes.ready_counts == {"q": 3}
    assert "q" in changes.ready_queues
    assert claimed(store, ["q"], T0 + 13) == jobs


def test_resuming_a_queue_that_is_not_paused_wakes_nobody(store: Store) -> None:
    submit(store)
    store.take_changes()
    store.queue_pause("q", False, T0)
    assert store.take_changes().ready_counts == {}
    assert len(claimed(store, ["q"])) == 1


def test_submit_and_promotion_go_on_while_paused(store: Store) -> None:
    store.queue_pause("q", True, T0)
    ready = submit(store, "q", T0)
    delayed = submit(store, "q", T0, delay_ms=1_000)
    assert store.job_inspect(delayed).state == JobState.PENDING
    assert store.jobs_promote_due(T0 + 1_000, 100) == 1
    assert store.job_inspect(delayed).state == JobState.READY
    assert store.job_inspect(ready).state == JobState.READY
    assert claimed(store, ["q"], T0 + 1_001) == []
    store.queue_pause("q", False, T0 + 2_000)
    assert sorted(claimed(store, ["q"], T0 + 2_001)) == sorted([ready, delayed])


def test_a_job_leased_before_the_pause_runs_to_the_end(store: Store) -> None:
    first, second = submit(store, "q", T0), submit(store, "q", T0 + 1)
    one, two = store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0 + 2)
    store.queue_pause("q", True, T0 + 3)
    assert store.lease_renew(one.job_id, "w1", one.token, LEASE_MS, T0 + 4) == T0 + 4 + LEASE_MS
    store.jobs_ack(one.job_id, "w1", one.token, None, T0 + 5)
    assert store.job_inspect(first).state == JobState.SUCCEEDED
    outcome = store.jobs_fail(two.job_id, "w1", two.token, "e", True, T0 + 6)
    assert outcome.state == JobState.RETRYING
    # Retried while paused: promoted when due, but not leased.
    store.jobs_promote_due(outcome.retry_at, 10)
    assert store.job_inspect(second).state == JobState.READY
    assert claimed(store, ["q"], outcome.retry_at) == []


def test_pause_is_idempotent_and_a_queue_may_be_paused_before_it_has_jobs(
    store: Store,
) -> None:
    assert store.queue_pause("empty", True, T0) is True
    assert store.queue_pause("empty", True, T0 + 1) is True
    assert store.queue_settings(None, 10) == [QueueSettings("empty", True)]
    job = submit(store, "empty", T0 + 2)
    assert claimed(store, ["empty"], T0 + 3) == []
    store.queue_pause("empty", False, T0 + 4)
    store.queue_pause("empty", False, T0 + 5)
    # A queue resumed has only defaults left: no row.
    assert store.queue_settings(None, 10) == []
    assert claimed(store, ["empty"], T0 + 6) == [job]


def test_settings_read_a_page_at_a_time_in_name_order(store: Store) -> None:
    for queue in ("c", "a", "d", "b"):
        store.queue_pause(queue, True, T0)
    assert [s.queue for s in store.queue_settings(None, 3)] == ["a", "b", "c"]
    assert store.queue_settings("c", 3) == [QueueSettings("d", True)]
    assert store.queue_settings("d", 3) == []


def test_the_view_says_which_queues_are_paused_after_commit(store: Store) -> None:
    submit(store, "q")
    store.begin()
    store.queue_pause("q", True, T0)
    assert store.view.paused == frozenset()  # (not before the commit)
    store.commit()
    assert store.view.paused == frozenset({"q"})
    queues, _ready, _next, paused = store.view.page_json(None, 10)
    assert b'"q":{' in queues and b"paused" not in queues and paused == ["q"]
    store.queue_pause("q", False, T0 + 1)
    assert store.view.paused == frozenset()
    assert store.view.page_json(None, 10)[3] == []


def test_the_view_has_the_limits_of_the_queues_that_have_one_after_commit(store: Store) -> None:
    store.begin()
    store.queue_config("a", {"max_leased": 5, "default_retries": 2}, T0)
    store.queue_config("b", {"rate": Rate(100, 1000)}, T0)
    store.queue_config("c", {"default_timeout_ms": 10}, T0)  # (no limit: not there)
    assert store.view.limits == {}  # (not before the commit)
    store.commit()
    assert store.view.limits == {"a": (5, None), "b": (None, Rate(100, 1000))}
    store.queue_config("a", {"max_leased": None, "rate": Rate(1, 60_000)}, T0 + 1)
    store.queue_config("b", {"rate": None}, T0 + 1)
    assert store.view.limits == {"a": (None, Rate(1, 60_000))}
    store.begin()
    store.queue_config("a", {"rate": None}, T0 + 2)
    store.rollback()
    assert store.view.limits == {"a": (None, Rate(1, 60_000))}


def test_a_pause_rolled_back_changes_nothing(store: Store) -> None:
    job = submit(store, "q")
    store.begin()
    store.queue_pause("q", True, T0)
    store.rollback()
    assert store.view.paused == frozenset()
    assert store.queue_settings(None, 10) == []
    assert claimed(store, ["q"]) == [job]


def test_pause_survives_reopening_the_store(stores: Stores) -> None:
    store = stores.open("a")
    job = submit(store, "q")
    store.queue_pause("q", True, T0)
    store.close()
    store = stores.open("a")
    assert store.view.paused == frozenset({"q"})
    assert claimed(store, ["q"], T0 + 1) == []
    store.queue_pause("q", False, T0 + 2)
    store.close()
    store = stores.open("a")
    assert claimed(store, ["q"], T0 + 3) == [job]


def test_settings_are_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("relay.store.sqlite.settings", "relay.store.postgres.settings"):
        monkeypatch.setattr(f"{module}.MAX_QUEUE_SETTINGS", 2)
    store.queue_pause("a", True, T0)
    store.queue_pause("b", True, T0)
    with pytest.raises(TooManyQueues, match="2 queues have settings"):
        store.queue_pause("c", True, T0)
    store.queue_pause("a", True, T0)  # (one that has a row already)
    store.queue_pause("a", False, T0)
    store.queue_pause("c", True, T0)
    assert [s.queue for s in store.queue_settings(None, 10)] == ["b", "c"]
    assert base.MAX_QUEUE_SETTINGS == 10_000


@pytest.mark.parametrize("paused_before", [False, True])
def test_a_pause_or_resume_the_disk_refused_changes_nothing(
    store: Store, paused_before: bool
) -> None:
    # A batch whose commit the disk refused is run again item by item, each in a
    # savepoint; one that writes (a pause, a resume) is undone and answered unavailable.
    from relay.protocol.errors import Unavailable
    from relay.server.requests import ops
    from relay.store import passes

    store.jobs_submit([SubmitSpec("q", "1")], T0)
    if paused_before:
        store.queue_pause("q", True, T0)
    batch = [(ops.QUEUE_PAUSE, None, None, 0.0, ("q", not paused_before))]
    refused = Unavailable("disk full")
    [answer] = passes.apply_unwritten(store, batch, [(ops.QUEUE_PAUSE, [0])], T0 + 1, refused)
    assert answer is refused
    assert store.view.paused == ({"q"} if paused_before else frozenset())
    claimed = store.jobs_claim(["q"], "w", 1, 30_000, T0 + 2)
    assert len(claimed) == (0 if paused_before else 1)


def test_a_full_page_of_queues_says_that_more_follow(store: Store) -> None:
    # queue_list merges the queues with jobs and those with settings; a page of 1,000
    # names must know whether a 1,001st follows, even if only settings hold them.
    from relay.server.requests import ops

    names = [f"z{n:05d}" for n in range(base.SETTINGS_PAGE + 1)]
    store.begin()
    for name in names:
        store.queue_pause(name, True, T0)
    store.commit()
    queues, cursor = ops.QUEUE_LIST.run(store, T0, (None, base.SETTINGS_PAGE, None))
    assert [q["queue"] for q in queues] == names[:-1] and cursor == names[-2]
    queues, cursor = ops.QUEUE_LIST.run(store, T0, (cursor, base.SETTINGS_PAGE, None))
    assert [q["queue"] for q in queues] == names[-1:] and cursor is None


# -- queue_config: every setting -------------------------------------------------------------

FULL = {
    "max_leased": 3,
    "rate": Rate(10, 1_000),
    "default_timeout_ms": 60_000,
    "default_retries": 0,
    "default_backoff": Backoff.fixed(500),
}


def test_queue_config_sets_clears_and_keeps_settings_and_they_survive_reopening(
    stores: Stores,
) -> None:
    store = stores.open("a")
    assert store.queue_config("q", {}, T0) == QueueSettings("q")  # a read: nothing set
    assert store.queue_settings(None, 10) == []
    assert store.queue_config("q", FULL, T0) == QueueSettings("q", **FULL)
    changed = store.queue_config("q", {"max_leased": None, "paused": True}, T0 + 1)
    assert changed == QueueSettings("q", **{**FULL, "max_leased": None}, paused=True)
    store.close()
    store = stores.open("a")
    assert store.queue_settings(None, 10) == [changed]
    assert store.queue_config("q", {}, T0 + 2) == changed
    assert store.view.paused == frozenset({"q"})
    # Every setting cleared: the queue has none, and its row is gone.
    cleared = dict.fromkeys(FULL, None)
    assert store.queue_config("q", {**cleared, "paused": False}, T0 + 3) == QueueSettings("q")
    assert store.queue_settings(None, 10) == []


def test_queue_config_rolled_back_changes_nothing(store: Store) -> None:
    store.queue_config("q", {"max_leased": 2}, T0)
    store.begin()
    store.queue_config("q", {**FULL, "paused": True}, T0 + 1)
    store.rollback()
    assert store.queue_settings(None, 10) == [QueueSettings("q", max_leased=2)]
    assert store.view.paused == frozenset()


def test_the_settings_of_named_queues_are_read_at_once(store: Store) -> None:
    store.queue_config("a", {"max_leased": 2}, T0)
    store.queue_config("c", {"paused": True}, T0)
    assert sorted(store.queue_settings_of(["c", "b", "a"]), key=lambda s: s.queue) == [
        QueueSettings("a", max_leased=2),
        QueueSettings("c", paused=True),
    ]
    assert store.queue_settings_of([]) == []
