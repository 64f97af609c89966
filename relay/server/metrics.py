"""``GET /metrics`` (Prometheus text format), ``GET /healthz`` and the dashboard page
(``GET /``, relay/server/dashboard.py) over a small h11 handler.

This is the only module that imports prometheus_client. Core components expose frozen
``statistics()`` snapshots and the store answers counts; a scrape gathers them into a
``MetricsSnapshot`` and a one-shot collector renders it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator

import attrs
import h11
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from relay.errors import RelayError
from relay.histogram import HistogramSnapshot
from relay.log import event
from relay.model import JobState
from relay.server.dashboard import CONTENT_TYPE as PAGE_TYPE
from relay.server.dashboard import Dashboard
from relay.server.http import HEAD_TIMEOUT_S, serve_http
from relay.server.listener import peer_name

log = logging.getLogger("relay.metrics")

STATES = [str(state) for state in JobState]

# store event name -> (metric name without _total, help)
EVENT_METRICS = {
    "submitted": ("relay_jobs_submitted", "Jobs created by submit and submit_batch."),
    "leased": ("relay_jobs_leased", "Leases issued."),
    "acked": ("relay_jobs_acked", "Jobs completed by ack."),
    "failed": ("relay_jobs_failed", "Attempts reported failed by fail."),
    "retried": ("relay_jobs_retried", "Failed attempts scheduled for a retry."),
    "dead": ("relay_jobs_dead", "Jobs moved to the dead letters."),
    "expired": ("relay_leases_expired", "Leases that expired before ack, fail or release."),
}


@attrs.frozen
class MetricsSnapshot:
    queues: dict[str, dict[str, int]]  # queue -> state -> jobs
    events: dict[tuple[str, str], int]  # (queue, event) -> count
    connections: int
    durations: dict[str, HistogramSnapshot]  # op -> request durations (seconds)
    batch_sizes: HistogramSnapshot
    commit_seconds: HistogramSnapshot
    auth_failures: int = 0  # refused hellos and metrics requests without a valid token
    watchers: int = 0  # connections watching job events
    watch_buffered: int = 0  # events waiting in their buffers
    # Transactions the disk refused, by kind ("full", "ioerr"): WriterStatistics.store_errors
    store_errors: dict[str, int] = attrs.Factory(dict)


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    return [*((repr(float(b)), c) for b, c in zip(h.bounds, h.counts, strict=True)),
            ("+Inf", h.count)]  # fmt: skip


class _SnapshotCollector:
    def __init__(self, snapshot: MetricsSnapshot) -> None:
        self.s = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.s
        yield GaugeMetricFamily("relay_connections", "Open client connections.",
                                value=s.connections)  # fmt: skip
        yield GaugeMetricFamily("relay_watchers", "Connections watching job events.",
                                value=s.watchers)  # fmt: skip
        yield GaugeMetricFamily(
            "relay_watch_buffered_events", "Job events waiting to be sent to watchers.",
            value=s.watch_buffered,
        )  # fmt: skip
        yield CounterMetricFamily(
            "relay_auth_failures", "Refused hellos and metrics requests without a valid token.",
            value=s.auth_failures,
        )  # fmt: skip
        durations = HistogramMetricFamily(
            "relay_request_duration_seconds", "From a request read to its reply.", labels=["op"]
        )
        for op in sorted(s.durations):
            h = s.durations[op]
            durations.add_metric([op], _buckets(h), h.total)
        yield durations
        for name, text, h in (
            ("relay_store_batch_size", "Commands per committed transaction.", s.batch_sizes),
            ("relay_store_commit_seconds", "Time to run and commit one batch.", s.commit_seconds),
        ):
            yield HistogramMetricFamily(name, text, buckets=_buckets(h), sum_value=h.total)
        errors = CounterMetricFamily(
            "relay_store_errors",
            "Transactions not committed because the disk refused them (full: SQLITE_FULL, "
            "ioerr: SQLITE_IOERR); their requests were answered unavailable.",
            labels=["kind"],
        )
        for kind in sorted(s.store_errors):
            errors.add_metric([kind], s.store_errors[kind])
        yield errors


def _per_queue_text(s: MetricsSnapshot) -> bytes:
    """The families with a series per queue, formatted here rather than by
    prometheus_client: its generic path costs ~13 us a sample on a small VM, and with 5,000
    queues (65,000 samples) a scrape held the event loop, and every client, for ~0.8 s;
    these lines cost ~0.5 us each. The format is the same; queue names need no escaping
    (only ``[A-Za-z0-9._:-]``)."""
    queues = sorted(set(s.queues) | {queue for queue, _ in s.events})
    lines = []
    for name, (metric, text) in EVENT_METRICS.items():
        total = f"{metric}_total"
        lines.append(f"# HELP {total} {text}\n# TYPE {total} counter\n")
        lines += [f'{total}{{queue="{q}"}} {s.events.get((q, name), 0)}\n' for q in queues]
    lines.append(
        "# HELP relay_queue_jobs Jobs per queue and state.\n# TYPE relay_queue_jobs gauge\n"
    )
    for queue in sorted(s.queues):
        counts = s.queues[queue]
        lines += [
            f'relay_queue_jobs{{queue="{queue}",state="{state}"}} {counts.get(state, 0)}\n'
            for state in STATES
        ]
    return "".join(lines).encode()


def render(snapshot: MetricsSnapshot) -> bytes:
    """The Prometheus text exposition of ``snapshot``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))  # type: ignore[arg-type]
    return _per_queue_text(snapshot) + generate_latest(registry)


# Given the request's headers and the peer ("host:port"), whether to serve it (it may
# wait first: a peer failing again and again is slowed down).
Authorize = Callable[[list[tuple[bytes, bytes]], str], Awaitable[bool]]


async def serve_metrics(
    listeners: list[trio.SocketListener],
    gather: Callable[[], Awaitable[MetricsSnapshot]],
    authorize: Authorize | None = None,
    dashboard: Dashboard | None = None,
    *,
    head_timeout: float = HEAD_TIMEOUT_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics and /healthz, and with ``dashboard`` the page at /, until cancelled
    (one request per connection; who may connect, how long its request may take and, on
    loopback, which Host is answered: relay/server/http.py). With ``authorize``, a request
    it refuses gets 401 and nothing else; the page needs no authorization (it holds no
    data: see relay/server/dashboard.py)."""

    async def respond(stream: trio.SocketStream, conn: h11.Connection, incoming: h11.Request):
        await _exchange(stream, conn, incoming, gather, authorize, dashboard)

    await serve_http(listeners, respond, head_timeout=head_timeout, task_status=task_status)


async def _exchange(
    stream: trio.SocketStream,
    conn: h11.Connection,
    incoming: h11.Request,
    gather: Callable[[], Awaitable[MetricsSnapshot]],
    authorize: Authorize | None,
    dashboard: Dashboard | None,
) -> None:
    try:
        target = incoming.target.split(b"?", 1)[0]
        headers: list[tuple[bytes, bytes]] = []
        kind = b"text/plain"
        if target == b"/" and dashboard is not None and incoming.method in (b"GET", b"HEAD"):
            # No token, on any address: the page holds no data (its data comes over the
            # WebSocket, after a hello with the token of whoever opened it).
            local_host = stream.socket.getsockname()[0]
            status, kind = 200, PAGE_TYPE
            body, headers = dashboard.response(incoming.headers, local_host)
        elif authorize is not None and not await authorize(incoming.headers, peer_name(stream)):
            status, body = 401, b"unauthorized\n"
            headers = [(b"www-authenticate", b"Bearer")]
        elif incoming.method not in (b"GET", b"HEAD"):
            status, body = 405, b"method not allowed\n"
        elif target == b"/metrics":
            try:
                status, body, kind = 200, render(await gather()), CONTENT_TYPE_LATEST.encode()
            except RelayError as exc:  # the store cannot answer now (disk, shutdown)
                event(log, logging.WARNING, "metrics.unavailable", error=repr(exc))
                status, body = 503, b"unavailable\n"  # no error text
        elif target == b"/healthz":
            status, body = 200, b"ok\n"
        else:
            status, body = 404, b"not found\n"
        headers += [
            (b"content-type", kind),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        data = conn.send(h11.Response(status_code=status, headers=headers))
        if incoming.method != b"HEAD":
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        event(log, logging.DEBUG, "metrics.bad_exchange", error=repr(exc))
