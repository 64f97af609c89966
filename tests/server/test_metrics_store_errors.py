"""``relay_store_errors_total{kind}`` on /metrics: transactions the disk refused."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from relay.histogram import Histogram
from relay.server.metrics import MetricsSnapshot, render


def snapshot(**store_errors: int) -> MetricsSnapshot:
    h = Histogram((1.0,)).snapshot()
    return MetricsSnapshot(
        queues={}, events={}, connections=0, durations={}, batch_sizes=h, commit_seconds=h,
        store_errors=store_errors,
    )  # fmt: skip


def test_store_errors_are_a_counter_per_kind():
    text = render(snapshot(full=3, ioerr=0)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["relay_store_errors"]
    assert family.type == "counter"
    values = {s.labels["kind"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert values == {"full": 3, "ioerr": 0}
    assert 'relay_store_errors_total{kind="full"} 3.0' in text
