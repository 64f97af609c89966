"""``relay_store_errors_total{kind}`` on /metrics: transactions the disk refused."""

from __future__ import annotations

import trio
from prometheus_client.parser import text_string_to_metric_families

from relay.protocol.errors import Unavailable
from relay.server.http.metrics import MetricsSnapshot, render, serve_metrics
from relay.util.histogram import Histogram
from tests.server.test_lifecycle import http_get


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


async def test_a_scrape_the_store_cannot_answer_is_503_and_the_endpoint_keeps_serving():
    calls = 0

    async def gather() -> MetricsSnapshot:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Unavailable("not committed: I/O error (SQLITE_IOERR); retry later")
        return snapshot(full=1)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_metrics, listeners, gather)
        status, body = await http_get(address, "/metrics")
        assert status == 503 and body == b"unavailable\n"  # no error text
        status, body = await http_get(address, "/metrics")
        assert status == 200 and b'relay_store_errors_total{kind="full"} 1.0' in body
        nursery.cancel_scope.cancel()
