"""The /metrics exposition (relay/server/metrics.py), checked with prometheus_client's own
parser: the per-queue families are formatted by hand, so their text must parse."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from relay.histogram import Histogram
from relay.server.metrics import EVENT_METRICS, MetricsSnapshot, render
from relay.store.base import EVENTS


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
    assert len(values) == 2 * 6
    assert values[("email", "ready")] == 2 and values[("email", "dead")] == 1
    assert values[("a.b:c-d_e", "leased")] == 5 and values[("email", "pending")] == 0
    assert families["relay_connections"].samples[0].value == 4
    durations = families["relay_request_duration_seconds"]
    assert durations.type == "histogram"
    assert {s.labels.get("op") for s in durations.samples} == {"submit"}


def test_every_event_the_store_counts_has_a_metric():
    assert set(EVENT_METRICS) == set(EVENTS)
