"""``relay-trio top``: a live view of the queues, fed by ``watch`` and a ``stats`` a second.

``TopView`` holds what is shown and knows nothing of sockets: the events and stats given
to it, and ``render()``, so that a test can draw it into a recording Console. ``run_top``
owns the connection: it reconnects after a server restart (showing that it does), and
draws at most ``REFRESH_PER_S`` times a second. An error that no retry can fix (a token
refused, TLS on one side only or a certificate not trusted, a peer that is not a relay-trio
server) ends it instead, for the command to say in one line.
"""

from __future__ import annotations

import collections
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any

import trio
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from relay.client import Client, open_client
from relay.errors import BadRequest, RelayError, Unauthorized, WrongServer
from relay.model import JobState
from relay_cli.views import format_duration

RATE_WINDOW_S = 10.0  # rates are per second over this many seconds
STATS_EVERY_S = 1.0
REFRESH_PER_S = 4
FAILURES_SHOWN = 8
RECONNECT_S = 1.0
STATES = [str(state) for state in JobState]


class TopView:
    """What ``top`` shows: per queue, the counts by state (from stats) and the rates of
    submitted, succeeded and failed jobs over the last RATE_WINDOW_S (from events); the
    latest failures; and the connection's status."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.queues: dict[str, dict[str, int]] = {}
        self.oldest_ready_ms: dict[str, int] = {}  # per queue with ready jobs
        self.server: Any = None  # the stats' ServerInfo
        # (when, queue, kind): kind is submitted, succeeded or failed.
        self.recent: collections.deque[tuple[float, str, str]] = collections.deque()
        self.failures: collections.deque[tuple[str, str, int, str]] = collections.deque(
            maxlen=FAILURES_SHOWN
        )
        self.lagged = 0
        self.status = "connecting"

    def stats(
        self, queues: dict[str, dict[str, int]], server: Any, oldest_ready_ms: dict[str, int]
    ) -> None:
        self.queues, self.server, self.oldest_ready_ms = queues, server, oldest_ready_ms

    def event(self, event: dict[str, Any]) -> str | None:
        """Count one event; returns the job id of a failure (whose error to fetch)."""
        if event.get("event") == "lagged":
            self.lagged += int(event.get("dropped") or 0)
            return None
        state = event.get("state")
        kind = None
        if state in ("ready", "pending") and "from" not in event:  # a job just made
            kind = "submitted"
        elif state == "succeeded":
            kind = "succeeded"
        elif state in ("retrying", "dead"):
            kind = "failed"
        if kind is None:
            return None
        self.recent.append((self.clock(), event["queue"], kind))
        return event["job_id"] if kind == "failed" else None

    def failure(self, job_id: str, queue: str, attempt: int, error: str) -> None:
        self.failures.appendleft((job_id, queue, attempt, error))

    def rates(self) -> dict[str, dict[str, float]]:
        """Per queue: submitted, succeeded and failed per second over the window."""
        horizon = self.clock() - RATE_WINDOW_S
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for _, queue, kind in self.recent:
            counts[queue][kind] += 1
        return {q: {k: n / RATE_WINDOW_S for k, n in c.items()} for q, c in counts.items()}

    def render(self) -> Group:
        rates = self.rates()
        table = Table(title="Queues", expand=True)
        table.add_column("queue")
        for state in STATES:
            table.add_column(state, justify="right")
        table.add_column("oldest ready", justify="right")
        for kind in ("submitted/s", "succeeded/s", "failed/s"):
            table.add_column(kind, justify="right")
        for queue in sorted(set(self.queues) | set(rates)):
            counts = self.queues.get(queue, {})
            rate = rates.get(queue, {})
            table.add_row(
                queue,
                *(f"{counts.get(state, 0):,}" for state in STATES),
                age(self.oldest_ready_ms.get(queue)),
                *(f"{rate.get(kind, 0.0):.1f}" for kind in ("submitted", "succeeded", "failed")),
            )
        failures = Table(title="Latest failures", expand=True)
        for column in ("job", "queue", "attempt", "error"):
            failures.add_column(column)
        for job_id, queue, attempt, error in self.failures:
            failures.add_row(job_id, queue, str(attempt), error)
        status = Text(f"relay-trio top · {self.status}", style="bold")
        if self.server is not None:
            status.append(f" · {self.server.connections} connections")
        if self.lagged:
            status.append(f" · {self.lagged} events lost to lag", style="yellow")
        return Group(status, table, failures)


def age(ms: int | None) -> str:
    """How long the oldest ready job has waited; "-" for a queue with none ready."""
    return "-" if ms is None else format_duration(ms)


async def run_top(
    address: str, token: str | None, tls_ca: str | None, view: TopView, connect_timeout: float
) -> None:
    """Show the view until cancelled (Ctrl-C), reconnecting whenever the server goes.
    Raises what ``follow`` cannot retry, once the screen is restored."""
    with Live(view.render(), refresh_per_second=REFRESH_PER_S, screen=True) as live:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_redraw, live, view)
            await follow(address, token, tls_ca, view, connect_timeout)
            nursery.cancel_scope.cancel()


async def follow(
    address: str,
    token: str | None,
    tls_ca: str | None,
    view: TopView,
    connect_timeout: float = 10.0,
) -> None:
    """Feed the view until cancelled: connect, follow, and after the connection is lost
    (or cannot be made) say so in the view and try again every RECONNECT_S. Raises the
    first error that trying again cannot fix (see ``incurable``)."""
    connected = False
    while True:
        try:
            async with open_client(
                address,
                reconnect=False,
                token=token,
                tls_ca=tls_ca,
                connect_timeout=connect_timeout,
            ) as client:
                connected = True
                view.status = f"connected to {address}"
                await _follow(client, view)
        except* (RelayError, OSError, trio.TooSlowError) as lost:  # from any of _follow's tasks
            for exc in _leaves(lost):
                if incurable(exc, connected):
                    raise exc from None
            view.status = f"reconnecting to {address} ({type(lost.exceptions[0]).__name__})"
        await trio.sleep(RECONNECT_S)


def incurable(exc: BaseException, connected: bool) -> bool:
    """Whether no retry can fix ``exc``: a token refused (or of a role that may not watch),
    a request refused as malformed, a certificate not trusted or TLS on one side only, a
    peer that is not a relay-trio server. A server that answered before (``connected``) and
    now closes at hello is taken to be restarting, not to have become another kind."""
    if isinstance(exc, Unauthorized | BadRequest | ssl.SSLCertVerificationError):
        return True
    if isinstance(exc, ssl.SSLError):  # not an EOF: the peer does not speak TLS
        return not isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError)
    return isinstance(exc, WrongServer) and not connected


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def _redraw(live: Live, view: TopView) -> None:
    while True:
        live.update(view.render())
        await trio.sleep(1 / REFRESH_PER_S)


async def _follow(client: Client, view: TopView) -> None:
    """Feed the view from one connection until it drops (raises)."""
    failed: trio.MemorySendChannel[str]
    failed, failed_out = trio.open_memory_channel[str](FAILURES_SHOWN)

    async def poll_stats() -> None:
        while True:
            stats = await client.stats(oldest_ready=True)
            view.stats(stats.queues, stats.server, stats.oldest_ready_ms or {})
            await trio.sleep(STATS_EVERY_S)

    async def fetch_errors() -> None:
        async for job_id in failed_out:
            job = await client.inspect(job_id)
            error = (job.last_error or "").splitlines()[0] if job.last_error else ""
            view.failure(job.job_id, job.queue, job.attempt, error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_stats)
        nursery.start_soon(fetch_errors)
        events = client.watch()
        async with events:
            async for event in events:
                job_id = view.event(event)
                if job_id is not None:
                    with contextlib.suppress(trio.WouldBlock):  # more than shown: skip
                        failed.send_nowait(job_id)
