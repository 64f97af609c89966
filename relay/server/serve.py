"""``serve(config)``: the server process's task tree, from the writer thread to each session.

The task tree (every task has one owner; read top to bottom)::

    serve()                                   root; returns after bounded shutdown
    └── open_writer()                         owns the writer thread and the store;
        │                                     started first, stopped last
        └── services nursery                  cancelled at the end of the grace period
            ├── Listener.serve                TCP accept loop (own cancel scope:
            │   └── sessions nursery            stop_accepting closes it first)
            │       └── Session.run  (xN)     reader task + sender task (+ admin tasks)
            ├── LongPolls.run                 re-claims woken long-polls, answers timeouts
            ├── run_promoter                  pending/retrying -> ready when due
            ├── run_reaper                    expired leases -> ready or dead
            ├── run_pruner                    succeeded jobs past retention, old keys
            └── serve_metrics                 GET /metrics, GET /healthz
                └── one task per HTTP exchange

Shutdown (``ServerHandle.shutdown``): stop accepting; stop leasing and answer parked
long-polls with no jobs; wait for in-flight requests up to the shutdown timeout; cancel
the services; leaving ``open_writer`` commits what is queued, checkpoints and closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import trio

from relay import wire
from relay.log import event
from relay.server.dispatch import VERSION, Dispatcher
from relay.server.listener import Listener
from relay.server.longpoll import LongPolls
from relay.server.maintenance import Alarm, commit_listener, run_promoter, run_pruner, run_reaper
from relay.server.metrics import MetricsSnapshot, serve_metrics
from relay.server.session import Session
from relay.store import commands as cmd
from relay.store.sqlite import SqliteStore, StoreConfig
from relay.store.writer import open_writer, wall_clock_ms

log = logging.getLogger("relay.server")


@attrs.frozen
class ServerConfig:
    db: str = "relay.db"
    host: str = "127.0.0.1"
    port: int = 7400
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 7401  # None: no metrics endpoint
    limits: wire.Limits = attrs.Factory(wire.Limits)
    synchronous: str = "full"
    idempotency_window_ms: int = 24 * 3_600_000
    retention_ms: int = 7 * 24 * 3_600_000
    shutdown_timeout_ms: int = 10_000
    idle_timeout_ms: int = 300_000
    clock: Callable[[], int] = wall_clock_ms


@attrs.frozen
class ServerHandle:
    """What ``nursery.start(serve, config)`` returns."""

    address: tuple[str, int]
    metrics_address: tuple[str, int] | None
    shutdown: Callable[[], None]


async def serve(
    config: ServerConfig, *, task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the server until ``shutdown()`` is called on its handle, or until cancelled.

    Raises StoreError (before ``task_status.started``) if the database is refused.
    Cancellation from outside skips the grace period but still closes the store cleanly.
    """
    began = time.monotonic()
    store_config = StoreConfig(
        idempotency_window_ms=config.idempotency_window_ms,
        retention_ms=config.retention_ms,
        max_error_bytes=config.limits.max_error_bytes,
    )
    store = SqliteStore.open(config.db, store_config, synchronous=config.synchronous)
    stop = trio.Event()
    async with open_writer(
        store, clock=config.clock, shutdown_timeout=config.shutdown_timeout_ms / 1000
    ) as writer:
        recovered = await writer.execute(cmd.Recover())
        if recovered:
            event(log, logging.WARNING, "server.recovered_leases", count=recovered)
        longpolls = LongPolls(writer)
        promoter_alarm, reaper_alarm = Alarm(), Alarm()
        writer.commit_listeners += [
            longpolls.on_commit,
            commit_listener(promoter_alarm, reaper_alarm),
        ]
        tcp = await trio.open_tcp_listeners(config.port, host=config.host)
        listener: Listener

        dispatcher = Dispatcher(
            writer, config.limits, longpolls, connections=lambda: listener.connections
        )

        async def run_session(stream: trio.SocketStream, peer: str) -> None:
            session = Session(
                stream, dispatcher, idle_timeout=config.idle_timeout_ms / 1000, peer=peer
            )
            await session.run()

        listener = Listener(tcp, run_session, config.limits.max_connections)

        async def gather() -> MetricsSnapshot:
            w = writer.statistics()
            return MetricsSnapshot(
                queues=await writer.execute(cmd.Stats()),
                events=await writer.execute(cmd.EventTotals()),
                connections=listener.connections,
                durations=dispatcher.statistics().durations,
                batch_sizes=w.batch_sizes,
                commit_seconds=w.commit_seconds,
            )

        async with trio.open_nursery() as services:
            await services.start(listener.serve)
            await services.start(longpolls.run)
            await services.start(run_promoter, writer, promoter_alarm, config.clock)
            await services.start(run_reaper, writer, reaper_alarm, config.clock)
            await services.start(run_pruner, writer)
            metrics_address = None
            if config.metrics_port is not None:
                http = await trio.open_tcp_listeners(config.metrics_port, host=config.metrics_host)
                metrics_address = http[0].socket.getsockname()[:2]
                await services.start(serve_metrics, http, gather)
            address = tcp[0].socket.getsockname()[:2]
            event(
                log,
                logging.INFO,
                "server.started",
                version=VERSION,
                address=f"{address[0]}:{address[1]}",
                metrics=None if metrics_address is None else "{}:{}".format(*metrics_address),
                db=config.db,
                synchronous=config.synchronous,
                limits=attrs.asdict(config.limits),
                shutdown_timeout_ms=config.shutdown_timeout_ms,
                startup_ms=round((time.monotonic() - began) * 1000),
            )
            task_status.started(ServerHandle(address, metrics_address, stop.set))
            await stop.wait()
            await _shut_down(config, listener, dispatcher, longpolls)
            services.cancel_scope.cancel()
        t = time.monotonic()
    event(log, logging.INFO, "server.stopped", writer_close_ms=round((time.monotonic() - t) * 1000))


async def _shut_down(
    config: ServerConfig, listener: Listener, dispatcher: Dispatcher, longpolls: LongPolls
) -> None:
    t = time.monotonic()
    listener.stop_accepting()
    dispatcher.leasing = False
    longpolls.close()
    event(log, logging.INFO, "shutdown.stopped_accepting", in_flight=dispatcher.in_flight)
    with trio.move_on_after(config.shutdown_timeout_ms / 1000) as grace:
        await dispatcher.wait_idle()
    event(
        log,
        logging.INFO if not grace.cancelled_caught else logging.WARNING,
        "shutdown.requests_drained" if not grace.cancelled_caught else "shutdown.grace_expired",
        in_flight=dispatcher.in_flight,
        ms=round((time.monotonic() - t) * 1000),
    )
