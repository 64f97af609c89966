"""The /metrics exposition (relay/server/http/metrics.py), checked with prometheus_client's own
parser: the per-queue families are formatted by hand, so their text must parse."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from relay.protocol.errors import ShuttingDown
from relay.protocol.model import Rate
from relay.server.http.metrics import (
    EVENT_METRICS,
    MetricsSnapshot,
    RenderCache,
    render,
    snapshot_limits,
    snapshot_paused,
    snapshot_queues,
    snapshot_schedule_runs,
    snapshot_workers,
)
from relay.store.view import EVENTS, QueueView
from relay.store.view import STATES as VIEW_STATES
from relay.util.histogram import Histogram


def test_rendered_metrics_parse_with_every_queue_state_and_event():
    histogram = Histogram((0.1, 1.0))
    histogram.observe(0.05)
    snapshot = MetricsSnapshot(
        queues={"email": {"ready": 2, "dead": 1}, "a.b:c-d_e": {"leased": 5}},
        events={("email", "submitted"): 3, ("email", "dead"): 1, ("gone", "acked"): 7},
        connections=4,
        durations={"submit": histogram.snapshot()},
        batch_sizes=histogram.snapshot(),
        commit_seconds=histogram.snapshot(),
    )
    families = {f.name: f for f in text_string_to_metric_families(render(snapshot).decode())}

    for event, (metric, _) in EVENT_METRICS.items():
        family = families[metric]
        assert family.type == "counter"
        values = {s.labels["queue"]: s.value for s in family.samples}
        # Every queue that has jobs or counted events, zeros included.
        assert set(values) == {"email", "a.b:c-d_e", "gone"}
        for queue, value in values.items():
            assert value == snapshot.events.get((queue, event), 0), (metric, queue)

    jobs = families["relay_queue_jobs"]
    assert jobs.type == "gauge"
    values = {(s.labels["queue"], s.labels["state"]): s.value for s in jobs.samples}
    assert len(values) == 2 * 7  # (every state, cancelled included)
    assert values[("email", "ready")] == 2 and values[("email", "dead")] == 1
    assert values[("a.b:c-d_e", "leased")] == 5 and values[("email", "pending")] == 0
    assert families["relay_connections"].samples[0].value == 4
    durations = families["relay_request_duration_seconds"]
    assert durations.type == "histogram"
    assert {s.labels.get("op") for s in durations.samples} == {"submit"}


def test_every_event_the_store_counts_has_a_metric():
    assert set(EVENT_METRICS) == set(EVENTS)


async def test_scrapes_share_one_rendering_per_interval_and_never_make_two_at_once(
    autojump_clock,
):
    made: list[float] = []
    release = trio.Event()

    async def make() -> bytes:
        made.append(trio.current_time())
        await release.wait()
        return f"body {len(made)}".encode()

    cache = RenderCache(make, ttl_s=1.0)
    bodies: list[bytes] = []

    async def scrape() -> None:
        bodies.append(await cache.get())

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(scrape)
        await trio.testing.wait_all_tasks_blocked()
        assert len(made) == 1  # ten scrapes at once: one rendering under way
        release.set()
    assert bodies == [b"body 1"] * 10
    await trio.sleep(0.5)
    assert await cache.get() == b"body 1" and len(made) == 1  # within the interval
    await trio.sleep(0.6)
    assert await cache.get() == b"body 2" and len(made) == 2  # made anew after it


async def test_a_rendering_that_fails_is_made_again_by_the_next_scrape(autojump_clock):
    calls = 0

    async def make() -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ShuttingDown("stopping")
        return b"ok"

    cache = RenderCache(make, ttl_s=1.0)
    with pytest.raises(ShuttingDown):
        await cache.get()
    assert await cache.get() == b"ok" and calls == 2


def test_the_first_queues_have_series_and_the_others_are_summed_as_other():
    view = QueueView()
    width = len(VIEW_STATES) + len(EVENTS)

    # (state counts, then event totals: ready n, submitted n)
    def entry(n: int) -> tuple[int, ...]:
        values = [0] * width
        values[VIEW_STATES.index("ready")] = n
        values[len(VIEW_STATES) + EVENTS.index("submitted")] = n
        return tuple(values)

    view.publish([(name, entry(n)) for name, n in [("a", 1), ("b", 2), ("c", 3), ("d", 4)]])
    queues, events = snapshot_queues(view, 2)
    assert {q: c["ready"] for q, c in queues.items()} == {"a": 1, "b": 2, "_other": 7}
    assert events[("_other", "submitted")] == 7 and events[("a", "submitted")] == 1
    queues, _ = snapshot_queues(view, 4)
    assert set(queues) == {"a", "b", "c", "d"}  # all shown: no _other


def test_a_paused_queue_has_its_gauge_at_one_and_the_others_at_zero():
    view = QueueView()
    width = len(VIEW_STATES) + len(EVENTS)
    view.publish([(name, (1,) * width) for name in ("a", "b", "c", "d")])
    view.publish_paused(frozenset({"b", "d", "empty"}))  # ("empty": no jobs)
    queues, _ = snapshot_queues(view, 10)
    assert snapshot_paused(view, queues, 10) == {"a": 0, "b": 1, "c": 0, "d": 1, "empty": 1}
    # At most max_queues series: the rest paused counted under _other.
    queues, _ = snapshot_queues(view, 2)
    assert snapshot_paused(view, queues, 2) == {"a": 0, "b": 1, "_other": 2}
    histogram = Histogram((0.1,)).snapshot()
    snapshot = MetricsSnapshot(
        queues=queues, events={}, connections=0, durations={}, batch_sizes=histogram,
        commit_seconds=histogram, paused=snapshot_paused(view, queues, 2),
    )  # fmt: skip
    families = {f.name: f for f in text_string_to_metric_families(render(snapshot).decode())}
    gauge = families["relay_queue_paused"]
    assert gauge.type == "gauge"
    assert {s.labels["queue"]: s.value for s in gauge.samples} == {"a": 0, "b": 1, "_other": 2}


def test_a_queue_with_a_limit_has_its_gauges_and_the_others_none():
    view = QueueView()
    width = len(VIEW_STATES) + len(EVENTS)
    view.publish([(name, (1,) * width) for name in ("a", "b", "c", "d")])
    view.publish_paused(frozenset(), {
        "b": (5, None), "d": (None, Rate(10, 60_000)), "c": (2, Rate(100, 1000)),
        "empty": (7, None),  # (no jobs)
    })  # fmt: skip
    queues, _ = snapshot_queues(view, 10)
    max_leased, rate_limit = snapshot_limits(view, queues, 10)
    assert max_leased == {"b": 5, "c": 2, "empty": 7}
    assert rate_limit == {"c": 100.0, "d": pytest.approx(1 / 6)}
    # At most max_queues queues with series; no _other (a sum of limits means nothing).
    queues, _ = snapshot_queues(view, 2)
    assert snapshot_limits(view, queues, 2) == ({"b": 5}, {})
    queues, _ = snapshot_queues(view, 3)
    max_leased, rate_limit = snapshot_limits(view, queues, 3)
    histogram = Histogram((0.1,)).snapshot()
    snapshot = MetricsSnapshot(
        queues=queues, events={}, connections=0, durations={}, batch_sizes=histogram,
        commit_seconds=histogram, max_leased=max_leased, rate_limit=rate_limit,
    )  # fmt: skip
    text = render(snapshot).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["relay_queue_max_leased"].type == "gauge"
    assert {s.labels["queue"]: s.value for s in families["relay_queue_max_leased"].samples} == {
        "b": 5, "c": 2,
    }  # fmt: skip
    assert {s.labels["queue"]: s.value for s in families["relay_queue_rate_limit"].samples} == {
        "c": 100.0,
    }  # fmt: skip
    promtool = shutil.which("promtool")
    if promtool is not None:  # (the exposition's lint, where it is installed)
        done = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                              capture_output=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


def test_schedule_runs_are_bounded_as_queues_are_and_ages_render_in_seconds():
    runs = {"a": 3, "b": 1, "c": 2, "d": 5}
    assert snapshot_schedule_runs(runs, 10) == runs
    assert snapshot_schedule_runs(runs, 2) == {"a": 3, "b": 1, "_other": 7}
    histogram = Histogram((0.1,)).snapshot()
    snapshot = MetricsSnapshot(
        queues={}, events={}, connections=0, durations={}, batch_sizes=histogram,
        commit_seconds=histogram, schedule_runs=snapshot_schedule_runs(runs, 2),
        schedule_ages_ms={"a": 1_500, "b": 90_000},
    )  # fmt: skip
    families = {f.name: f for f in text_string_to_metric_families(render(snapshot).decode())}
    counter = families["relay_schedule_runs"]
    assert counter.type == "counter"
    assert {s.labels["schedule"]: s.value for s in counter.samples} == {
        "a": 3, "b": 1, "_other": 7,
    }  # fmt: skip
    gauge = families["relay_schedule_last_run_age_seconds"]
    assert gauge.type == "gauge"
    assert {s.labels["schedule"]: s.value for s in gauge.samples} == {"a": 1.5, "b": 90.0}


def test_workers_per_queue_are_bounded_as_queues_are_and_ages_render_in_seconds():
    queues = {"a": {"ready": 2}, "b": {"leased": 1}, "_other": {"ready": 5}}
    counts = {"a": 1, "c": 2, "d": 1}
    # Every queue shown with jobs has a series (0: no worker asks for it); past the bound,
    # the worker-queue pairs of the others are summed.
    assert snapshot_workers(counts, queues, 10) == {"a": 1, "b": 0, "c": 2, "d": 1, "_other": 0}
    assert snapshot_workers(counts, queues, 2) == {"a": 1, "b": 0, "_other": 3}
    assert snapshot_workers({}, {"a": {"ready": 1}}, 10) == {"a": 0}
    histogram = Histogram((0.1,)).snapshot()
    snapshot = MetricsSnapshot(
        queues={}, events={}, connections=0, durations={}, batch_sizes=histogram,
        commit_seconds=histogram, workers=snapshot_workers(counts, queues, 2),
        oldest_ready_ms={"a": 1500},
    )  # fmt: skip
    text = render(snapshot).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["relay_workers"].type == "gauge"
    assert {s.labels["queue"]: s.value for s in families["relay_workers"].samples} == {
        "a": 1, "b": 0, "_other": 3,
    }  # fmt: skip
    ages = families["relay_queue_oldest_ready_seconds"]
    assert ages.type == "gauge" and [(s.labels, s.value) for s in ages.samples] == [
        ({"queue": "a"}, 1.5),
    ]  # fmt: skip
    promtool = shutil.which("promtool")
    if promtool is not None:
        done = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                              capture_output=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


def test_job_time_histograms_render_per_queue_and_pass_promtool():
    from relay.store.history import BOUNDS_MS, N_BUCKETS, Histograms, QueueObserved

    def observed(run_ms: list[int], wait_ms: list[int]) -> QueueObserved:
        import bisect

        run, wait = [0] * N_BUCKETS, [0] * N_BUCKETS
        for ms in run_ms:
            run[bisect.bisect_left(BOUNDS_MS, ms)] += 1
        for ms in wait_ms:
            wait[bisect.bisect_left(BOUNDS_MS, ms)] += 1
        return QueueObserved(tuple(run), sum(run_ms), tuple(wait), sum(wait_ms))

    histograms = Histograms(2)
    histograms.add({"a": observed([5, 1_500], [0]), "b": observed([], [7_200_000])})
    histograms.add({"c": observed([20], [30]), "a": observed([6], [])})  # c: beyond 2 queues
    histogram = Histogram((0.1,)).snapshot()
    snapshot = MetricsSnapshot(
        queues={}, events={}, connections=0, durations={}, batch_sizes=histogram,
        commit_seconds=histogram, job_times=histograms.snapshot(),
    )  # fmt: skip
    text = render(snapshot).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    run = families["relay_job_run_seconds"]
    assert run.type == "histogram"
    samples = {(s.name, s.labels["queue"], s.labels.get("le")): s.value for s in run.samples}
    # 5 ms is in le="0.005" (bounds are inclusive), 6 ms in the next, 1.5 s under 2.5.
    assert samples[("relay_job_run_seconds_bucket", "a", "0.005")] == 1
    assert samples[("relay_job_run_seconds_bucket", "a", "0.01")] == 2
    assert samples[("relay_job_run_seconds_bucket", "a", "1.0")] == 2
    assert samples[("relay_job_run_seconds_bucket", "a", "2.5")] == 3
    assert samples[("relay_job_run_seconds_count", "a", None)] == 3
    assert samples[("relay_job_run_seconds_sum", "a", None)] == pytest.approx(1.511)
    assert {queue for _, queue, _ in samples} == {"a", "b", "_other"}  # at most 2 + _other
    wait = {(s.name, s.labels["queue"], s.labels.get("le")): s.value
            for s in families["relay_job_wait_seconds"].samples}  # fmt: skip
    assert wait[("relay_job_wait_seconds_bucket", "b", "3600.0")] == 0  # two hours: +Inf only
    assert wait[("relay_job_wait_seconds_bucket", "b", "+Inf")] == 1
    assert wait[("relay_job_wait_seconds_count", "_other", None)] == 1
    done = subprocess.run(["/usr/bin/promtool", "check", "metrics"], input=text.encode(),
                          capture_output=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
