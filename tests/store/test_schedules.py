"""Schedules on both stores: a due slot's job is created in the transaction that moves
the schedule past it (never twice, never lost), the catch-up policies, pause and resume,
the bound on their number, and (PostgreSQL) several servers racing for the same slots."""

from __future__ import annotations

import calendar
import threading
from datetime import UTC, datetime

import pytest

from relay.protocol.errors import ScheduleNotFound, TooManySchedules
from relay.protocol.model import Backoff
from relay.store import commands as cmd
from relay.store.base import ScheduleSpec, StoreConfig
from tests.store.conformance import Store, Stores, postgres_only, rows

MINUTE = 60_000
HOUR = 60 * MINUTE


def ms(*args: int) -> int:
    return calendar.timegm(datetime(*args, tzinfo=UTC).timetuple()) * 1000


T = ms(2026, 3, 1, 12, 0)


def spec(name: str = "nightly", cron: str = "0 3 * * *", **kw) -> ScheduleSpec:
    fields = {"timezone": "UTC", "queue": "q", "payload": '{"report": 1}', **kw}
    return ScheduleSpec(name, cron, **fields)


def slots_of_jobs(store: Store, queue: str = "q") -> list[int]:
    return [
        r[0]
        for r in rows(store, "SELECT scheduled_for FROM jobs WHERE queue = ? ORDER BY id", queue)
    ]


def test_put_computes_the_next_slot_and_lists_it(store: Store) -> None:
    info = store.schedule_put(spec(), T)
    assert info.next_at == ms(2026, 3, 2, 3, 0)
    assert (info.last_slot, info.last_job_id, info.paused) == (None, None, False)
    assert store.next_schedule_at() == ms(2026, 3, 2, 3, 0)
    [listed] = store.schedule_list(None, 10)
    assert listed.spec == spec() and listed.created_at == T
    assert store.take_changes().next_schedule_at == ms(2026, 3, 2, 3, 0)


def test_a_due_slot_submits_one_job_carrying_its_slot(store: Store) -> None:
    store.schedule_put(spec(priority=2, max_attempts=2, timeout_ms=5000,
                            backoff=Backoff.fixed(10)), T)  # fmt: skip
    slot = ms(2026, 3, 2, 3, 0)
    assert store.schedules_run_due(slot - 1, 10) == []
    [run] = store.schedules_run_due(slot + 5, 10)
    assert (run.name, run.slot, run.error) == ("nightly", slot, None)
    job = store.job_inspect(run.job_id)
    assert (job.payload, job.priority, job.max_attempts, job.timeout_ms) == (
        '{"report": 1}', 2, 2, 5000,
    )  # fmt: skip
    assert job.scheduled_for == slot
    [lease] = store.jobs_claim(["q"], "w", 1, 30_000, slot + 6)
    assert lease.scheduled_for == slot and lease.job_id == run.job_id
    # Run again at the same time: nothing; the next slot is tomorrow's.
    assert store.schedules_run_due(slot + 7, 10) == []
    [info] = store.schedule_list(None, 10)
    assert (info.next_at, info.last_slot, info.last_job_id) == (slot + 86_400_000, slot, run.job_id)
    assert info.last_job_state == "leased"


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [
        ("latest", [ms(2026, 3, 1, 12, 50)]),
        ("none", []),
        ("all", [ms(2026, 3, 1, 12, m) for m in (30, 40, 50)]),  # at most 3: the latest
    ],
)
def test_missed_slots_follow_the_catch_up_policy(store: Store, catch_up, expected) -> None:
    store.schedule_put(spec(cron="*/10 * * * *", catch_up=catch_up, catch_up_max=3), T + 1)
    # Down from 12:00 until 12:55: slots 12:10 .. 12:50 were missed.
    runs = store.schedules_run_due(ms(2026, 3, 1, 12, 55), 10)
    assert [run.slot for run in runs] == expected
    assert slots_of_jobs(store) == expected
    [info] = store.schedule_list(None, 10)
    assert info.next_at == ms(2026, 3, 1, 13, 0)


def test_none_still_runs_a_slot_a_little_late(store: Store) -> None:
    store.schedule_put(spec(cron="*/10 * * * *", catch_up="none"), T + 1)
    [run] = store.schedules_run_due(ms(2026, 3, 1, 12, 10) + 30_000, 10)
    assert run.slot == ms(2026, 3, 1, 12, 10)


def test_a_slot_is_never_submitted_twice_across_a_replace_and_a_reopen(stores: Stores) -> None:
    store = stores.open("db")
    store.schedule_put(spec(cron="* * * * *"), T)
    store.schedules_run_due(T, 10)
    assert slots_of_jobs(store) == [T]
    # Replaced within the same minute: its next slot is still after the last one run.
    info = store.schedule_put(spec(cron="* * * * *", payload='{"v": 2}'), T + 1)
    assert info.next_at == T + MINUTE and info.last_slot == T
    store.close()
    store = stores.open("db")
    assert store.schedules_run_due(T + 2, 10) == []
    [run] = store.schedules_run_due(T + MINUTE, 10)
    assert store.job_inspect(run.job_id).payload == '{"v": 2}'
    assert slots_of_jobs(store) == [T, T + MINUTE]


def test_a_rolled_back_run_leaves_the_slot_due(store: Store) -> None:
    store.schedule_put(spec(cron="* * * * *"), T + 1)
    store.begin()
    [run] = store.schedules_run_due(T + MINUTE, 10)
    store.rollback()
    assert slots_of_jobs(store) == []
    [info] = store.schedule_list(None, 10)
    assert info.next_at == T + MINUTE and info.last_slot is None
    [again] = store.schedules_run_due(T + MINUTE, 10)
    assert again.slot == run.slot and slots_of_jobs(store) == [T + MINUTE]


def test_a_full_queue_passes_the_slot_with_its_error(stores: Stores) -> None:
    store = stores.open(config=StoreConfig(max_depth=1))
    store.schedule_put(spec(cron="* * * * *"), T)
    [first] = store.schedules_run_due(T, 10)
    [second] = store.schedules_run_due(T + MINUTE, 10)
    assert first.job_id is not None
    assert second.job_id is None and "max 1" in (second.error or "")
    [info] = store.schedule_list(None, 10)
    assert (info.last_slot, info.last_job_id) == (T + MINUTE, first.job_id)
    assert info.next_at == T + 2 * MINUTE
    # The list says the last slot made no job, and why; the gauge of the last slot that
    # made one keeps growing (an alert fires on a schedule that submits nothing).
    assert (info.last_job_slot, info.last_refusal) == (T, second.error)
    for minute in range(2, 24 * 60):
        [run] = store.schedules_run_due(T + minute * MINUTE, 10)
        assert run.job_id is None
    day = T + 24 * 60 * MINUTE
    assert cmd.ScheduleAges(10).apply(store, day) == {"nightly": day - T}
    [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, day)  # the queue has room again
    store.jobs_ack(lease.job_id, "w1", lease.token, None, day)
    [made] = store.schedules_run_due(day, 10)
    [info] = store.schedule_list(None, 10)
    assert (info.last_job_slot, info.last_refusal, info.last_job_id) == (day, None, made.job_id)
    assert cmd.ScheduleAges(10).apply(store, day + 1) == {"nightly": 1}


def test_a_put_of_the_same_expression_keeps_a_due_slot_and_its_catch_up(store: Store) -> None:
    """A deployment that puts every schedule at start, after a slot came due and before
    the scheduler ran it: the slot (and, with catch_up all, every missed one) still runs."""
    store.schedule_put(spec(cron="0 * * * *", catch_up="all"), T + 1)  # next: 13:00
    back = T + 5 * HOUR + 10 * MINUTE  # down from 12:00 to 17:10: 13:00 - 17:00 missed
    info = store.schedule_put(spec(cron="0 * * * *", catch_up="all", payload="2"), back)
    assert info.next_at == T + HOUR
    runs = store.schedules_run_due(back + 1, 10)
    assert [run.slot for run in runs] == [T + h * HOUR for h in range(1, 6)]
    assert store.job_inspect(runs[0].job_id).payload == "2"
    # A changed expression starts from its first slot from now.
    info = store.schedule_put(spec(cron="30 * * * *"), back + 2)
    assert (
        info.next_at == T + 5 * HOUR + 30 * MINUTE and store.schedules_run_due(back + 3, 10) == []
    )


@postgres_only
def test_two_servers_putting_new_schedules_keep_the_bound(stores: Stores) -> None:
    config = StoreConfig(max_schedules=2)
    a, b = stores.open("db", config=config), stores.open("db", config=config)
    a.schedule_put(spec("s0"), T)
    a.begin()
    a.schedule_put(spec("s1"), T)  # holds the count's lock until it commits
    done = threading.Event()
    refused: list[BaseException] = []

    def put_on_b() -> None:
        try:
            b.schedule_put(spec("s2"), T)
        except TooManySchedules as exc:
            refused.append(exc)
        done.set()

    thread = threading.Thread(target=put_on_b)
    thread.start()
    assert not done.wait(0.3)  # b waits for a's count
    a.commit()
    thread.join(10)
    assert refused and [s.spec.name for s in a.schedule_list(None, 10)] == ["s0", "s1"]


def test_pause_stops_its_slots_and_resume_starts_after_now(store: Store) -> None:
    store.schedule_put(spec(cron="*/10 * * * *"), T)
    info = store.schedule_pause("nightly", True, T + 1)
    assert info.paused and store.next_schedule_at() is None
    assert store.schedules_run_due(T + 3_600_000, 10) == []
    info = store.schedule_pause("nightly", False, ms(2026, 3, 1, 13, 5))
    assert not info.paused and info.next_at == ms(2026, 3, 1, 13, 10)
    assert store.schedules_run_due(ms(2026, 3, 1, 13, 9), 10) == []
    # Putting a paused schedule keeps it paused.
    store.schedule_pause("nightly", True, T + 2)
    assert store.schedule_put(spec(cron="*/5 * * * *"), T + 3).paused


def test_delete_and_unknown_names(store: Store) -> None:
    store.schedule_put(spec(), T)
    store.schedule_delete("nightly")
    assert store.schedule_list(None, 10) == []
    for call in (lambda: store.schedule_delete("nightly"),
                 lambda: store.schedule_pause("nightly", True, T)):  # fmt: skip
        with pytest.raises(ScheduleNotFound):
            call()


def test_the_number_of_schedules_is_bounded_and_pages_are_by_name(stores: Stores) -> None:
    store = stores.open(config=StoreConfig(max_schedules=3))
    for name in ("c", "a", "b"):
        store.schedule_put(spec(name), T)
    with pytest.raises(TooManySchedules):
        store.schedule_put(spec("d"), T)
    store.schedule_put(spec("a", cron="@hourly"), T)  # a replace is no new one
    assert [i.spec.name for i in store.schedule_list(None, 2)] == ["a", "b"]
    assert [i.spec.name for i in store.schedule_list("b", 2)] == ["c"]


def test_a_pruned_last_job_shows_no_state(store: Store) -> None:
    store.schedule_put(spec(cron="* * * * *"), T)
    [run] = store.schedules_run_due(T, 10)
    store.job_cancel(run.job_id, T + 1)
    store.jobs_prune(T + 10 * 86_400_000, 100)
    [info] = store.schedule_list(None, 10)
    assert info.last_job_id == run.job_id and info.last_job_state is None


@postgres_only
def test_several_servers_racing_submit_each_slot_once(stores: Stores) -> None:
    servers = [stores.open("db") for _ in range(3)]
    for i in range(20):
        servers[0].schedule_put(spec(f"s{i:02}", cron="* * * * *", catch_up="all"), T)
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def run(store: Store) -> None:
        try:
            for minute in range(5):
                barrier.wait()
                store.schedules_run_due(T + minute * MINUTE + 1, 100)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    got = rows(
        servers[0], "SELECT scheduled_for, count(*) FROM jobs GROUP BY scheduled_for ORDER BY 1"
    )
    assert got == [(T + m * MINUTE, 20) for m in range(5)]


def test_one_call_stops_taking_schedules_once_it_made_its_jobs(store: Store, monkeypatch) -> None:
    from relay.store.postgres import schedules as pg_schedules
    from relay.store.sqlite import schedules as sqlite_schedules

    for module in (pg_schedules, sqlite_schedules):
        monkeypatch.setattr(module, "RUN_JOBS", 4)
    for name in ("a", "b", "c"):
        store.schedule_put(spec(name, cron="* * * * *", catch_up="all"), T + 1)
    now = T + 5 * MINUTE  # five slots due for each
    first = store.schedules_run_due(now, 10)
    assert [(r.name, r.slot) for r in first] == [("a", T + m * MINUTE) for m in range(1, 6)]
    assert store.next_schedule_at() == T + MINUTE  # b and c are still due
    second = store.schedules_run_due(now, 10)
    assert {r.name for r in second} == {"b"}
    assert {r.name for r in store.schedules_run_due(now, 10)} == {"c"}
    assert store.schedules_run_due(now, 10) == []


def test_a_schedule_whose_slots_cannot_be_computed_stops_and_the_others_run(store: Store):
    store.schedule_put(spec("broken", cron="* * * * *"), T)
    store.schedule_put(spec("fine", cron="* * * * *"), T)
    # Its zone gone from the time zone data (or the row edited by hand).
    rows(store, "UPDATE schedules SET timezone = 'Gone/Away' WHERE name = 'broken' RETURNING name")
    runs = store.schedules_run_due(T + MINUTE, 10)
    by_name = {run.name: run for run in runs}
    assert by_name["fine"].job_id is not None
    assert by_name["broken"].job_id is None and "put it again" in (by_name["broken"].error or "")
    info = {i.spec.name: i for i in store.schedule_list(None, 10)}
    assert info["broken"].next_at is None and info["fine"].next_at == T + 2 * MINUTE
    assert store.next_schedule_at() == T + 2 * MINUTE
