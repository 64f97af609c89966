"""``serve(config)``: the server process's task tree, from the writer thread to each session.

The task tree (every task has one owner; read top to bottom)::

    serve()                                   root; returns after bounded shutdown
    └── open_core()                           (relay/server/core.py)
        ├── open_writer()                     owns the writer thread and the store;
        │                                     started first, stopped last
        └── services nursery                  cancelled when the core closes
            ├── LongPolls.run                 re-claims woken long-polls, answers timeouts
            ├── run_promoter                  pending/retrying -> ready when due
            ├── run_reaper                    expired leases -> ready or dead
            ├── run_pruner                    succeeded, cancelled jobs past retention, old keys
            ├── run_scheduler                 schedules' due slots -> jobs, once each
            ├── run_history_flusher           the history counted in memory -> the store
            └── ChangeFeed.run                (PostgreSQL) other servers' commits as wake-ups
        └── transports nursery                cancelled at the end of the grace period
            ├── Listener.serve                TCP accept loop (own cancel scope:
            │   └── sessions nursery            stop_accepting closes it first)
            │       └── Session.run  (xN)     reader, sender and watchdog tasks (+ a task per
            │                                 dead retry/purge of a whole queue); with TLS,
            │                                 after the handshake (in the same task, within
            │                                 its deadline)
            ├── Listener.serve                WebSocket accept loop (the same cap, the
            │   └── sessions nursery            same sessions; connections/websocket.py)
            │       └── run_websocket (xN)    opening handshake, then Session.run over
            │                                 its MessageStream (wsproto, no task of its own)
            ├── serve_metrics                 GET /metrics, /healthz, /livez, / (the
            │   └── one task per HTTP exchange    dashboard)
            └── Reloader.run                  SIGHUP: the token file and the TLS pair read
                └── a task per reload that      again (relay/server/reload.py); the
                    closes stale connections     ``reload`` op runs the same
                    after the grace

Shutdown (``ServerHandle.shutdown``): stop accepting; stop leasing and answer parked
long-polls with no jobs; wait for in-flight requests up to the shutdown timeout; cancel
the transports (sessions close); leaving the core cancels its services, and leaving
``open_writer`` commits what is queued, checkpoints and closes.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack, asynccontextmanager

import attrs
import trio

from relay.server.connections.listen import (
    JOBS,
    METRICS,
    WEBSOCKET,
    ListenError,
    host_port,
    open_listeners,
)
from relay.server.connections.listener import Accepting, Listener, Spare
from relay.server.connections.outbox import ReplyBudget
from relay.server.connections.prehello import Ticket
from relay.server.connections.session import Session, Sessions
from relay.server.connections.tls import server_context
from relay.server.connections.websocket import Origins, accept_websocket, overloaded_response
from relay.server.core import Core, ServerConfig, describe_db, open_core
from relay.server.http.dashboard import Dashboard
from relay.server.http.metrics import (
    MetricsSnapshot,
    oldest_ready,
    schedule_ages,
    serve_metrics,
    snapshot_limits,
    snapshot_paused,
    snapshot_queues,
    snapshot_schedule_runs,
    snapshot_workers,
)
from relay.server.reload import Reloader
from relay.server.requests.auth import bearer_guard, check_exposure, is_loopback
from relay.server.requests.dispatch import VERSION
from relay.util.log import event

log = logging.getLogger("relay.server")

__all__ = ["ListenError", "ServerConfig", "ServerHandle", "serve"]


@attrs.frozen
class ServerHandle:
    """What ``nursery.start(serve, config)`` returns."""

    address: tuple[str, int]
    metrics_address: tuple[str, int] | None
    shutdown: Callable[[], None]
    ws_address: tuple[str, int] | None = None


async def serve(
    config: ServerConfig, *, task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the server until ``shutdown()`` is called on its handle, or until cancelled.

    Raises, each before ``task_status.started`` and as itself (not in an exception group):
    TlsConfigError if the TLS certificate or key cannot be used, ExposureError if a
    listener would be reachable from other machines without tokens, StoreError if the
    database is refused, ListenError if a listener cannot be opened. Cancellation from
    outside (even during start-up) skips the grace period but still closes the store
    cleanly.
    """
    began = time.monotonic()
    stop = trio.Event()
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("tls_cert and tls_key go together")
    # Before the database is opened: a bad certificate stops the server as early as it can.
    tls_context = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls_context = server_context(config.tls_cert, config.tls_key)
    # Before anything is opened: an exposed listener without tokens changes nothing.
    exposed = await trio.to_thread.run_sync(check_exposure, _hosts(config), config.tokens,
                                            config.insecure)  # fmt: skip
    # Cancelled meanwhile (Ctrl-C while starting): stop here, before opening the database.
    await trio.lowlevel.checkpoint_if_cancelled()
    # After the database: a server refused for its database (say, another one uses it)
    # says so, rather than that its port is taken (by that other server).
    async with open_core(config) as core, _open_sockets(config) as sockets:
        dispatcher = core.dispatcher

        sessions = Sessions()
        replies = ReplyBudget(config.max_reply_buffer_bytes)  # what all sessions owe

        async def run_session(stream: trio.abc.Stream, peer: str, ticket: Ticket) -> None:
            idle = config.idle_timeout_ms / 1000
            session = Session(stream, dispatcher, idle_timeout=idle, peer=peer,
                              reply_budget=replies, prehello=ticket)  # fmt: skip
            await sessions.run(session)

        listener = Listener(
            sockets.jobs, run_session, config.limits.max_connections, config.prehello(),
            name=JOBS, tls_context=tls_context,
            handshake_timeout=config.tls_handshake_timeout_ms / 1000, spare=sockets.spare,
        )  # fmt: skip
        listeners = [listener]
        ws_address = None
        origins = Origins(frozenset(config.ws_origins))
        if sockets.websocket is not None:
            ws_address = sockets.websocket[0].socket.getsockname()[:2]
            websocket = _websocket_listener(
                sockets.websocket, config, run_session, listener, tls_context, origins,
                sockets.spare,
            )  # fmt: skip
            listeners.append(websocket)
        dispatcher.connections = lambda: listener.connections
        # How workers_list names this server: its host's name and its job port, which tell
        # apart servers that share one PostgreSQL database.
        jobs_port = sockets.jobs[0].socket.getsockname()[1]
        dispatcher.server_name = f"{socket.gethostname()}:{jobs_port}"

        async def gather() -> MetricsSnapshot:
            w = core.writer.statistics()
            # From the store's view (no query, no turn in the writer): bounded by
            # metrics_max_queues however many queues there are.
            queues, events = snapshot_queues(core.view, config.metrics_max_queues)
            max_leased, rate_limit = snapshot_limits(core.view, queues, config.metrics_max_queues)
            scheduled = core.scheduler.statistics()
            return MetricsSnapshot(
                queues=queues,
                events=events,
                connections=listener.connections,
                auth_failures=dispatcher.access.throttle.failures_total,
                watchers=len(core.watchers),
                watch_buffered=core.watchers.buffered(),
                durations=dispatcher.statistics().durations,
                batch_sizes=w.batch_sizes,
                commit_seconds=w.commit_seconds,
                store_errors=w.store_errors,
                paused=snapshot_paused(core.view, queues, config.metrics_max_queues),
                max_leased=max_leased,
                rate_limit=rate_limit,
                schedule_runs=snapshot_schedule_runs(scheduled.runs, config.metrics_max_queues),
                schedule_refused=snapshot_schedule_runs(
                    scheduled.refused, config.metrics_max_queues
                ),
                schedule_ages_ms=await schedule_ages(core.writer, config.metrics_max_queues),
                oldest_ready_ms=await oldest_ready(dispatcher.oldest, queues),
                workers=snapshot_workers(
                    dispatcher.workers.queue_counts(), queues, config.metrics_max_queues
                ),
                job_times=core.histograms.snapshot(),
            )

        async with trio.open_nursery() as transports:
            for each in listeners:
                await transports.start(each.serve)
            reloader = Reloader(config, dispatcher.access, listeners)
            await transports.start(reloader.run)
            dispatcher.reloader = reloader.reload
            metrics_address = None
            if sockets.metrics is not None:
                metrics_address = sockets.metrics[0].socket.getsockname()[:2]
                origins.page_port = metrics_address[1]  # the dashboard's page may connect
                # Open to anyone who can reach it on loopback; elsewhere, with tokens,
                # a bearer token of any role.
                guard = None
                if config.tokens is not None and not is_loopback(config.metrics_host):
                    access = dispatcher.access  # (its tokens change with a reload)
                    guard = bearer_guard(lambda: access.tokens, access.throttle)
                # The page is told where the WebSocket endpoint is (the port bound, not 0).
                dashboard = Dashboard(
                    config.metrics_host, config.ws_host, None if ws_address is None else
                    ws_address[1], tls=tls_context is not None, tokens=config.tokens is not None,
                )  # fmt: skip
                # Its accept never fails (out of descriptors, it backs off, logged in
                # summary): see relay/server/connections/listener.py.
                http = [Accepting(each, METRICS, sockets.spare) for each in sockets.metrics]
                await transports.start(
                    functools.partial(serve_metrics, cache_s=config.metrics_cache_ms / 1000,
                                      unready=core.unready),
                    http, gather, guard, dashboard,
                )  # fmt: skip
            address = sockets.jobs[0].socket.getsockname()[:2]
            event(
                log,
                logging.INFO,
                "server.started",
                version=VERSION,
                address=host_port(*address),
                tls=tls_context is not None,
                metrics=None if metrics_address is None else host_port(*metrics_address),
                websocket=None if ws_address is None else host_port(*ws_address),
                db=describe_db(config.db),
                synchronous=config.synchronous,
                limits=attrs.asdict(config.limits),
                tokens=len(config.tokens) if config.tokens is not None else 0,
                shutdown_timeout_ms=config.shutdown_timeout_ms,
                startup_ms=round((time.monotonic() - began) * 1000),
            )
            for host in exposed:
                event(log, logging.WARNING, "server.insecure", host=host,
                      problem="listening beyond loopback without tokens (--insecure)")  # fmt: skip
            task_status.started(ServerHandle(address, metrics_address, stop.set, ws_address))
            await stop.wait()
            await _shut_down(config, listeners, core, sessions)
            transports.cancel_scope.cancel()
        t = time.monotonic()
    event(log, logging.INFO, "server.stopped", writer_close_ms=round((time.monotonic() - t) * 1000))


@attrs.frozen
class _Sockets:
    """The listening sockets of each endpoint (None: that endpoint is off)."""

    jobs: list[trio.SocketListener]
    websocket: list[trio.SocketListener] | None
    metrics: list[trio.SocketListener] | None
    # A file descriptor held in reserve, to refuse a client when out of them.
    spare: Spare


@asynccontextmanager
async def _open_sockets(config: ServerConfig) -> AsyncIterator[_Sockets]:
    """Open every listening socket before any of them serves, so that one that cannot be
    opened stops the start-up as a ListenError naming it; all are closed on the way out
    (those a listener already closed, again: closing is idempotent)."""
    with ExitStack() as opened:

        async def each(listener: str, host: str, port: int) -> list[trio.SocketListener]:
            sockets = await open_listeners(listener, host, port)
            for one in sockets:
                opened.callback(one.socket.close)
            return sockets

        jobs = await each(JOBS, config.host, config.port)
        ws = http = None
        if config.ws_port is not None:
            ws = await each(WEBSOCKET, config.ws_host, config.ws_port)
        if config.metrics_port is not None:
            http = await each(METRICS, config.metrics_host, config.metrics_port)
        spare = Spare()
        opened.callback(spare.close)
        yield _Sockets(jobs, ws, http, spare)


def _hosts(config: ServerConfig) -> list[tuple[str, str]]:
    """Every listener's (name, host), for the exposure check."""
    hosts = [("jobs", config.host)]
    if config.metrics_port is not None:
        hosts.append(("metrics", config.metrics_host))
    if config.ws_port is not None:
        hosts.append(("websocket", config.ws_host))
    return hosts


def _websocket_listener(
    sockets: list[trio.SocketListener],
    config: ServerConfig,
    run_session: Callable[[trio.abc.Stream, str, Ticket], Awaitable[None]],
    jobs: Listener,
    tls_context: ssl.SSLContext | None,
    origins: Origins,
    spare: Spare,
) -> Listener:
    """The WebSocket endpoint: its connections share the job listener's cap and pools of
    unauthenticated connections, and run the same sessions, each over the opening
    handshake's ``MessageStream``."""

    async def run_websocket(stream: trio.abc.Stream, peer: str, ticket: Ticket) -> None:
        try:
            messages = await accept_websocket(stream, origins, ticket.deadline)
            if messages is not None:
                await run_session(messages, peer, ticket)
        finally:
            # The TCP (or TLS) stream is this task's: closed here, after the session's
            # closing handshake, or if the opening one failed or was cut short.
            await trio.aclose_forcefully(stream)

    return Listener(
        sockets, run_websocket, config.limits.max_connections, jobs.prehello, name=WEBSOCKET,
        limiter=jobs.limiter, refusal=overloaded_response, tls_context=tls_context,
        handshake_timeout=config.tls_handshake_timeout_ms / 1000, spare=spare,
    )  # fmt: skip


async def _shut_down(
    config: ServerConfig, listeners: list[Listener], core: Core, sessions: Sessions
) -> None:
    """Everything before cancelling the transports, within one grace deadline."""
    t = time.monotonic()
    deadline = trio.current_time() + config.shutdown_timeout_ms / 1000
    for listener in listeners:
        listener.stop_accepting()
    event(log, logging.INFO, "shutdown.stopped_accepting", in_flight=core.dispatcher.in_flight)
    drained = await core.drain(deadline - trio.current_time())
    event(
        log,
        logging.INFO if drained else logging.WARNING,
        "shutdown.requests_drained" if drained else "shutdown.grace_expired",
        in_flight=core.dispatcher.in_flight,
        ms=round((time.monotonic() - t) * 1000),
    )
    # Every request is answered; let each session write its last replies and close.
    sessions.stop_reading()
    with trio.move_on_at(deadline):
        await sessions.wait_closed()
    event(
        log,
        logging.INFO,
        "shutdown.connections_closed",
        remaining=len(sessions),
        ms=round((time.monotonic() - t) * 1000),
    )
