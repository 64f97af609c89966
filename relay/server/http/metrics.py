"""``GET /metrics`` (Prometheus text format), ``GET /healthz`` (ready), ``GET /livez``
(alive) and the dashboard page (``GET /``, relay/server/http/dashboard.py) over a small h11
handler.

This is the only module that imports prometheus_client. Core components expose frozen
``statistics()`` snapshots and the store publishes its counts per queue (``QueueView``,
relay/store/view.py); a scrape gathers them into a ``MetricsSnapshot`` (``snapshot_queues``
takes the first ``max_queues`` queues and sums the others into ``queue="_other"``) and a
one-shot collector renders it. One rendering serves every scrape for a while
(``RenderCache``): however many scrapes come, the text is made at most once per interval,
and never twice at once.
"""

from __future__ import annotations

import logging
import math
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

from relay.protocol.errors import RelayError
from relay.protocol.model import JobState
from relay.server.connections.listener import peer_name
from relay.server.http.admission import HEAD_TIMEOUT_S, serve_http
from relay.server.http.dashboard import CONTENT_TYPE as PAGE_TYPE
from relay.server.http.dashboard import Dashboard
from relay.server.requests.oldest import OldestReady
from relay.store import commands as cmd
from relay.store.history import BOUNDS_MS
from relay.store.view import EVENTS, QueueView
from relay.store.view import STATES as VIEW_STATES
from relay.store.writer import Writer
from relay.util.histogram import HistogramSnapshot
from relay.util.log import event

log = logging.getLogger("relay.metrics")

STATES = [str(state) for state in JobState]

# One rendering of /metrics serves the scrapes of this long (ServerConfig.metrics_cache_ms).
DEFAULT_CACHE_S = 1.0

# The series that sums every queue not shown on its own (beyond --metrics-max-queues). A
# queue really named so is summed into it too, so the label means one thing.
OTHER_QUEUES = "_other"

# store event name -> (metric name without _total, help)
EVENT_METRICS = {
    "submitted": ("relay_jobs_submitted", "Jobs created by submit and submit_batch."),
    "leased": ("relay_jobs_leased", "Leases issued."),
    "acked": ("relay_jobs_acked", "Jobs completed by ack."),
    "failed": ("relay_jobs_failed", "Attempts reported failed by fail."),
    "retried": ("relay_jobs_retried", "Failed attempts scheduled for a retry."),
    "dead": ("relay_jobs_dead", "Jobs moved to the dead letters."),
    "expired": ("relay_leases_expired", "Leases that expired before ack, fail or release."),
    "cancelled": ("relay_jobs_cancelled", "Jobs cancelled by cancel."),
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
    # queue -> 1 if paused, else 0 (``snapshot_paused``)
    paused: dict[str, int] = attrs.Factory(dict)
    # queue -> its max_leased, and its rate in leases per second, for the queues that have
    # one (``snapshot_limits``)
    max_leased: dict[str, int] = attrs.Factory(dict)
    rate_limit: dict[str, float] = attrs.Factory(dict)
    # Slots this server's scheduler passed, and of them those refused by their queue, per
    # schedule (``snapshot_schedule_runs``), and per schedule the ms since the last slot
    # that made a job, by any server (the store's).
    schedule_runs: dict[str, int] = attrs.Factory(dict)
    schedule_refused: dict[str, int] = attrs.Factory(dict)
    schedule_ages_ms: dict[str, int] = attrs.Factory(dict)
    # queue -> ms its oldest ready job has waited, of the queues shown with ready jobs
    # (``oldest_ready``); queue -> this server's connected workers asking for it
    # (``snapshot_workers``)
    oldest_ready_ms: dict[str, int] = attrs.Factory(dict)
    workers: dict[str, int] = attrs.Factory(dict)
    # Per queue, this server's jobs' run times and wait times as the history flushes them:
    # (run buckets, run sum ms, wait buckets, wait sum ms), buckets not cumulative, the
    # last above every bound (``Histograms.snapshot``, relay/store/history.py).
    job_times: dict[str, tuple[tuple[int, ...], int, tuple[int, ...], int]] = attrs.Factory(dict)


async def schedule_ages(writer: Writer, max_series: int) -> dict[str, int]:
    """``relay_schedule_last_run_age_seconds``'s series: a read of the first ``max_series``
    schedules' last jobs' slots (name and slot, no payload: an index range), one turn in the
    writer per rendering. Empty while the store cannot answer (a scrape still answers)."""
    try:
        return await writer.execute(cmd.ScheduleAges(max_series))
    except RelayError:
        return {}


async def oldest_ready(oldest: OldestReady, queues: dict[str, dict[str, int]]) -> dict[str, int]:
    """``relay_queue_oldest_ready_seconds``'s series: of the queues ``snapshot_queues``
    shows on their own that have ready jobs (so at most ``max_queues``), how long the oldest
    has waited, read through ``OldestReady`` (at most once a second per queue, whoever
    asks: stats shares the reads). No ``OTHER_QUEUES`` series (an age is no sum). Empty
    while the store cannot answer (a scrape still answers)."""
    ready = [q for q, counts in queues.items() if q != OTHER_QUEUES and counts.get("ready")]
    if not ready:
        return {}
    try:
        return await oldest.ages(ready)
    except RelayError:
        return {}


def snapshot_workers(
    counts: dict[str, int], queues: dict[str, dict[str, int]], max_queues: int
) -> dict[str, int]:
    """``relay_workers``'s series: per queue, this server's connected workers asking for
    it (``WorkerBook.queue_counts``), 0 for a queue shown with jobs that none asks for (the
    alert "ready jobs and no worker"). The first ``max_queues`` names of both by name, the
    rest summed under ``OTHER_QUEUES`` (worker-queue pairs), as the per-queue series are."""
    names = sorted((set(queues) | set(counts)) - {OTHER_QUEUES})
    series = {name: counts.get(name, 0) for name in names[:max_queues]}
    rest = sum(n for name, n in counts.items() if name not in series)
    if rest or OTHER_QUEUES in queues or len(names) > max_queues:
        series[OTHER_QUEUES] = rest
    return series


def snapshot_schedule_runs(runs: dict[str, int], max_series: int) -> dict[str, int]:
    """``relay_schedule_runs_total``'s series: the first ``max_series`` schedules by name,
    the others summed as ``OTHER_QUEUES``, as the per-queue series are."""
    names = sorted(runs)
    series = {name: runs[name] for name in names[:max_series] if name != OTHER_QUEUES}
    rest = sum(runs[name] for name in names if name not in series)
    if rest:
        series[OTHER_QUEUES] = rest
    return series


def snapshot_queues(
    view: QueueView, max_queues: int
) -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], int]]:
    """The jobs per queue and state, and the events per queue, of the first ``max_queues``
    queues by name (stable from scrape to scrape), and the sums of all the others as
    queue ``OTHER_QUEUES``: ``MetricsSnapshot``'s ``queues`` and ``events``. Costs
    O(max_queues), whatever the number of queues."""
    rows, sums = view.top(max_queues + 1)  # (one more, in case one is named _other)
    shown = [(queue, entry) for queue, entry in rows if queue != OTHER_QUEUES][:max_queues]
    rest = list(sums)
    for _queue, entry in shown:
        for i, n in enumerate(entry):
            rest[i] -= n
    rest = [max(0, n) for n in rest]  # (a sum read as the writer published: see QueueView)
    queues: dict[str, dict[str, int]] = {}
    events: dict[tuple[str, str], int] = {}
    n_states = len(VIEW_STATES)
    for queue, entry in shown:
        queues[queue] = dict(zip(VIEW_STATES, entry[:n_states], strict=False))
        for name, n in zip(EVENTS, entry[n_states:], strict=True):
            events[(queue, name)] = n
    if len(view) > len(shown):
        queues[OTHER_QUEUES] = dict(zip(VIEW_STATES, rest[:n_states], strict=False))
        for name, n in zip(EVENTS, rest[n_states:], strict=True):
            events[(OTHER_QUEUES, name)] = n
    return queues, events


def snapshot_paused(
    view: QueueView, queues: dict[str, dict[str, int]], max_queues: int
) -> dict[str, int]:
    """``relay_queue_paused``'s series: 0 or 1 for each queue ``snapshot_queues`` shows on
    its own, 1 for a paused queue without jobs while the series stay at most
    ``max_queues`` (the first by name), and under ``OTHER_QUEUES`` how many other queues
    are paused (where there are other queues). A set of at most MAX_QUEUE_SETTINGS names,
    read without a query."""
    paused = view.paused
    series = {queue: int(queue in paused) for queue in queues if queue != OTHER_QUEUES}
    room = max(0, max_queues - len(series))
    for queue in sorted(paused - series.keys())[:room]:
        series[queue] = 1
    others = len(paused - series.keys())
    if others or OTHER_QUEUES in queues:
        series[OTHER_QUEUES] = others
    return series


def snapshot_limits(
    view: QueueView, queues: dict[str, dict[str, int]], max_queues: int
) -> tuple[dict[str, int], dict[str, float]]:
    """``relay_queue_max_leased``'s and ``relay_queue_rate_limit``'s series (leases per
    second: the rate's limit over its period): the queues ``snapshot_queues`` shows on their
    own that have the limit, and those without jobs that have one while the queues with a
    series stay at most ``max_queues`` (the first by name). No ``OTHER_QUEUES`` series: a sum
    of other queues' limits means nothing. Read from the view (``QueueView.limits``, at most
    MAX_QUEUE_SETTINGS queues), without a query."""
    limits = view.limits
    named = [queue for queue in queues if queue != OTHER_QUEUES and queue in limits]
    room = max(0, max_queues - len(queues.keys() - {OTHER_QUEUES}))
    named += sorted(limits.keys() - queues.keys())[:room]
    max_leased: dict[str, int] = {}
    rate_limit: dict[str, float] = {}
    for queue in named:
        most, rate = limits[queue]
        if most is not None:
            max_leased[queue] = most
        if rate is not None:
            rate_limit[queue] = rate.limit * 1000 / rate.period_ms
    return max_leased, rate_limit


class RenderCache:
    """One rendering of /metrics for every scrape within ``ttl_s`` of it: a scrape that
    finds it older makes it anew, and scrapes that come meanwhile wait for that one rather
    than make their own. Trio thread only."""

    def __init__(self, make: Callable[[], Awaitable[bytes]], ttl_s: float) -> None:
        self._make = make
        self._ttl_s = ttl_s
        self._body: bytes | None = None
        self._made_at = -math.inf
        self._making: trio.Event | None = None

    async def get(self) -> bytes:
        """The text, made at most ``ttl_s`` ago. Raises what making it raised (to the scrape
        that made it; the ones waiting on it then make it themselves, one at a time)."""
        while True:
            if self._body is not None and trio.current_time() - self._made_at < self._ttl_s:
                return self._body
            if self._making is not None:
                await self._making.wait()
                continue
            self._making = done = trio.Event()
            try:
                body = await self._make()
                self._body, self._made_at = body, trio.current_time()
                return body
            finally:
                self._making = None
                done.set()


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
    # Schedule names are queue names' characters too: no escaping.
    families = (
        ("relay_queue_paused", "gauge", "queue", s.paused,
         "Whether the queue is paused (1) or not (0): queue_pause."),
        ("relay_queue_max_leased", "gauge", "queue", s.max_leased,
         "At most this many of the queue's jobs leased at once (queue_config max_leased), "
         "for the queues that have one."),
        ("relay_queue_rate_limit", "gauge", "queue", s.rate_limit,
         "Leases per second the queue's rate allows (queue_config rate: limit / period), "
         "for the queues that have one."),
        ("relay_queue_oldest_ready_seconds", "gauge", "queue",
         {q: ms / 1000 for q, ms in s.oldest_ready_ms.items()},
         "Seconds the queue's oldest ready job has waited, for the queues with ready jobs "
         "(read at most once a second)."),
        ("relay_workers", "gauge", "queue", s.workers,
         "Connected workers of this server asking for the queue in their last lease "
         "(workers_list)."),
        ("relay_schedule_runs_total", "counter", "schedule", s.schedule_runs,
         "Slots of the schedule this server passed (a job submitted, or refused by its "
         "queue)."),
        ("relay_schedule_refused_total", "counter", "schedule", s.schedule_refused,
         "Slots of the schedule this server passed that made no job (refused by its "
         "queue: full)."),
        ("relay_schedule_last_run_age_seconds", "gauge", "schedule",
         {n: max(0, ms) / 1000 for n, ms in s.schedule_ages_ms.items()},
         "Seconds since the schedule's last slot that made a job, by any server: grows "
         "while it makes none (paused, refused, stopped)."),
    )  # fmt: skip
    for metric, kind, label, series, text in families:
        lines.append(f"# HELP {metric} {text}\n# TYPE {metric} {kind}\n")
        lines += [f'{metric}{{{label}="{k}"}} {v}\n' for k, v in sorted(series.items())]
    for metric, at, text in JOB_TIME_METRICS:
        lines.append(f"# HELP {metric} {text}\n# TYPE {metric} histogram\n")
        for queue in sorted(s.job_times):
            buckets, total_ms = s.job_times[queue][at], s.job_times[queue][at + 1]
            count = 0
            for bound, n in zip(_JOB_TIME_LE, buckets, strict=True):
                count += n
                lines.append(f'{metric}_bucket{{queue="{queue}",le="{bound}"}} {count}\n')
            lines.append(f'{metric}_sum{{queue="{queue}"}} {total_ms / 1000}\n')
            lines.append(f'{metric}_count{{queue="{queue}"}} {count}\n')
    return "".join(lines).encode()


# The job-time histograms: (metric, its place in a ``job_times`` entry, help).
JOB_TIME_METRICS = (
    ("relay_job_run_seconds", 0,
     "From a job's lease to its ack or fail, for the leases this server granted."),
    ("relay_job_wait_seconds", 2,
     "From a job ready (or due, when delayed or retried) to its lease, by this server."),
)  # fmt: skip
_JOB_TIME_LE = [repr(ms / 1000) for ms in BOUNDS_MS] + ["+Inf"]


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
    unready: Callable[[], str | None] = lambda: None,
    cache_s: float = DEFAULT_CACHE_S,
    head_timeout: float = HEAD_TIMEOUT_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics, /healthz (ready: 200, or 503 with the word ``unready()`` gives),
    /livez (200 while this loop answers), and with ``dashboard`` the page at /, until cancelled
    (one request per connection; who may connect, how long its request may take and, on
    loopback, which Host is answered: relay/server/http/admission.py). With ``authorize``, a request
    it refuses gets 401 and nothing else; the page needs no authorization (it holds no
    data: see relay/server/http/dashboard.py). One rendering of /metrics serves the scrapes of
    ``cache_s`` seconds (``RenderCache``)."""

    async def make() -> bytes:
        return render(await gather())

    metrics = RenderCache(make, cache_s)

    async def respond(stream: trio.SocketStream, conn: h11.Connection, incoming: h11.Request):
        await _exchange(stream, conn, incoming, metrics, authorize, dashboard, unready)

    await serve_http(listeners, respond, head_timeout=head_timeout, task_status=task_status)


async def _exchange(
    stream: trio.SocketStream,
    conn: h11.Connection,
    incoming: h11.Request,
    metrics: RenderCache,
    authorize: Authorize | None,
    dashboard: Dashboard | None,
    unready: Callable[[], str | None],
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
                status, body, kind = 200, await metrics.get(), CONTENT_TYPE_LATEST.encode()
            except RelayError as exc:  # the store cannot answer now (disk, shutdown)
                event(log, logging.WARNING, "metrics.unavailable", error=repr(exc))
                status, body = 503, b"unavailable\n"  # no error text
        elif target == b"/healthz":
            # Ready for clients: the store open and the previous run's leases recovered,
            # and not shutting down. A load balancer or orchestrator sends clients only
            # while it answers 200.
            reason = unready()
            status, body = (200, b"ok\n") if reason is None else (503, f"{reason}\n".encode())
        elif target == b"/livez":
            # Alive: this event loop answers (the process is not stuck), ready or not.
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
