"""The transport-free core of a server: store, writer, dispatcher and time-driven services.

``open_core`` is shared by the TCP server (``serve``) and the embedded mode
(``relay.open_local``): both get the same dispatcher, so a request means the same thing
whether it arrived over a socket or from the same process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from relay.protocol import wire
from relay.protocol.errors import RelayError
from relay.server.connections.outbox import DEFAULT_REPLY_BUFFER_BYTES
from relay.server.connections.prehello import (
    HELLO_TIMEOUT_MS,
    PreHello,
    default_per_address,
    default_total,
)
from relay.server.connections.tls import HANDSHAKE_TIMEOUT_MS
from relay.server.requests.auth import Tokens
from relay.server.requests.dispatch import Dispatcher
from relay.server.requests.longpoll import PARKED_PER_CONNECTION, LongPolls
from relay.server.requests.watch import Watchers
from relay.server.services.maintenance import (
    Alarm,
    commit_listener,
    flush_history_once,
    run_counts_refresher,
    run_history_flusher,
    run_promoter,
    run_pruner,
    run_reaper,
)
from relay.server.services.schedules import Scheduler, run_scheduler
from relay.store.base import DEFAULT_MAX_SCHEDULES, Changes, Store, StoreConfig
from relay.store.history import FLUSH_INTERVAL_S, Histograms
from relay.store.view import QueueView
from relay.store.writer import CommitListener, Writer, open_writer, wall_clock_ms
from relay.util.nursery import open_service_nursery

log = logging.getLogger("relay.server")

# Queues holding jobs at once (--max-queues). Every queue costs memory in the counts (a
# few hundred bytes) and a line per state in a full stats listing; 10,000 is far beyond
# what one deployment's job kinds need, and cheap to hold.
DEFAULT_MAX_QUEUES = 10_000
# Per-queue series on /metrics (--metrics-max-queues): 1,000 queues are 13,000 samples,
# about 1 MB of text and a few ms to render; the rest are one queue="_other" series.
DEFAULT_METRICS_MAX_QUEUES = 1_000
# The last flush of the history at shutdown waits this long at most for the writer.
FINAL_FLUSH_S = 2.0
# One rendering of /metrics serves every scrape for this long (--metrics-cache-ms).
DEFAULT_METRICS_CACHE_MS = 1_000


@attrs.frozen
class ServerConfig:
    db: str = "relay.db"
    host: str = "127.0.0.1"
    port: int = 7400
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 7401  # None: no metrics endpoint
    # The WebSocket endpoint (relay/server/connections/websocket.py); None: none. The command line's
    # default is 7402; a library user asks for it.
    ws_host: str = "127.0.0.1"
    ws_port: int | None = None
    # Origins of pages (besides the dashboard's own) that may open a WebSocket.
    ws_origins: tuple[str, ...] = ()
    limits: wire.Limits = attrs.Factory(wire.Limits)
    synchronous: str = "full"
    idempotency_window_ms: int = 24 * 3_600_000
    retention_ms: int = 7 * 24 * 3_600_000
    shutdown_timeout_ms: int = 10_000
    idle_timeout_ms: int = 300_000
    # The reply bytes all connections may owe at once before those that owe any are no
    # longer read (relay/server/connections/outbox.py, ReplyBudget).
    max_reply_buffer_bytes: int = DEFAULT_REPLY_BUFFER_BYTES
    # Unfinished jobs (pending, ready, leased, retrying) a queue may hold before submit
    # answers queue_full: per queue, and a default for the others (None: unbounded).
    max_queue_depth: int | None = None
    queue_depths: dict[str, int] = attrs.Factory(dict)
    # Queues that may hold jobs at once: a submit that would create one more answers
    # too_many_queues (relay/store/counts.py). None: unbounded.
    max_queues: int | None = DEFAULT_MAX_QUEUES
    # Schedules that may exist at once: a schedule_put of a new one past it answers
    # too_many_schedules. (Seconds in a schedule: ``limits.allow_second_schedules``.)
    max_schedules: int = DEFAULT_MAX_SCHEDULES
    # /metrics: per-queue series for this many queues (by name), the others summed into
    # queue="_other"; one rendering serves every scrape for this long
    # (relay/server/http/metrics.py).
    metrics_max_queues: int = DEFAULT_METRICS_MAX_QUEUES
    metrics_cache_ms: int = DEFAULT_METRICS_CACHE_MS
    # The history counted in memory is flushed to the store this often (a crash loses at
    # most this long of it: relay/store/history.py).
    history_flush_ms: int = round(FLUSH_INTERVAL_S * 1000)
    # PEM files of the job listener's certificate (chain) and key: both, or neither (plain
    # TCP). A client's handshake must finish within the timeout (relay/server/connections/tls.py).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_handshake_timeout_ms: int = HANDSHAKE_TIMEOUT_MS
    # Connections not yet authenticated (relay/server/connections/prehello.py): each must
    # have a role (a valid hello, with tokens; its TLS or WebSocket handshake done) within
    # the hello timeout of its accept; at most max_prehello of them at once, and
    # max_prehello_per_address from one address (None: the defaults, from max_connections).
    hello_timeout_ms: int = HELLO_TIMEOUT_MS
    max_prehello: int | None = None
    max_prehello_per_address: int | None = None
    clock: Callable[[], int] = wall_clock_ms
    # Access control (relay/server/requests/auth.py): None, every connection may do everything,
    # and no listener may be reachable from other machines unless ``insecure``.
    tokens: Tokens | None = None
    insecure: bool = False
    # Where ``tokens`` came from, read again on SIGHUP or the ``reload`` op
    # (relay/server/reload.py): the token file (None: nothing to reload) and the value of
    # RELAY_AUTH_TOKEN at start. A connection whose token a reload removed, or gave another
    # role, is closed once this grace has passed (unless it says hello again with a valid
    # token meanwhile).
    auth_token_file: str | None = None
    auth_env_token: str | None = None
    token_grace_ms: int = 30_000

    def prehello(self) -> PreHello:
        """The pools of unauthenticated connections this configuration asks for."""
        most = self.limits.max_connections
        total = self.max_prehello or default_total(most)
        per_address = self.max_prehello_per_address or default_per_address(most)
        return PreHello(total, min(per_address, total), self.hello_timeout_ms / 1000)

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            idempotency_window_ms=self.idempotency_window_ms,
            retention_ms=self.retention_ms,
            max_error_bytes=self.limits.max_error_bytes,
            max_traceback_bytes=self.limits.max_traceback_bytes,
            max_depth=self.max_queue_depth,
            queue_depths=dict(self.queue_depths),
            max_queues=self.max_queues,
            max_schedules=self.max_schedules,
            history_max_queues=self.metrics_max_queues,
        )


@attrs.define
class Core:
    writer: Writer
    dispatcher: Dispatcher
    longpolls: LongPolls
    watchers: Watchers
    nursery: trio.Nursery  # the services nursery: for tasks that live as long as the core
    view: QueueView  # the store's counts per queue, as of the last commit (any thread reads)
    scheduler: Scheduler  # the schedules' service: its statistics for /metrics
    # The run-time and wait-time histograms of this server's jobs, as the history flusher
    # adds to them (relay/store/history.py): for /metrics.
    histograms: Histograms = attrs.Factory(lambda: Histograms(DEFAULT_METRICS_MAX_QUEUES))

    def unready(self) -> str | None:
        """Why the server should get no new clients now (None: it is ready): "recovering"
        while the leases of the previous run are not yet given back (the disk refused the
        write: every write is answered unavailable meanwhile), "stopping" once the
        shutdown began. Read by ``/healthz``; sync, reads two flags."""
        if not self.dispatcher.leasing or self.writer.closed:
            return "stopping"
        if self.writer.recovering:
            return "recovering"
        return None

    async def drain(self, timeout_s: float) -> bool:
        """Stop leasing, answer parked long-polls, and wait (at most ``timeout_s``) for the
        requests in flight. True if they all finished."""
        self.dispatcher.leasing = False
        self.longpolls.close()
        with trio.move_on_after(timeout_s):
            await self.dispatcher.wait_idle()
            return True
        return False


def is_postgres_url(db: str) -> bool:
    """``--db`` names a PostgreSQL database (a URL), not a SQLite file (a path)."""
    return db.startswith(("postgresql://", "postgres://"))


def describe_db(db: str) -> str:
    """``db`` as it may be logged: a URL's password left out."""
    if not is_postgres_url(db):
        return db
    url = urllib.parse.urlsplit(db)
    if url.password is None:
        return db
    netloc = url.netloc.rsplit("@", 1)[1]
    user = url.username or ""
    return urllib.parse.urlunsplit(url._replace(netloc=f"{user}:***@{netloc}"))


def open_store(config: ServerConfig) -> Store:
    """The store ``config.db`` names: PostgreSQL for a URL, else the SQLite file. Each is
    imported only here, when chosen: a server on SQLite loads nothing of PostgreSQL's
    (psycopg, and numpy through it where installed), nor one on PostgreSQL sqlite-utils."""
    if is_postgres_url(config.db):
        from relay.store.postgres import PostgresStore

        return PostgresStore.open(config.db, config.store_config())
    from relay.store.sqlite import SqliteStore

    return SqliteStore.open(config.db, config.store_config(), synchronous=config.synchronous)


def _has_events(changes: Changes) -> bool:
    return bool(changes.events)  # (recorded only while someone watches)


@asynccontextmanager
async def open_core(config: ServerConfig) -> AsyncIterator[Core]:
    """Open the store, start the writer (which recovers leases) and the time-driven services.

    Owns: the writer thread (through ``open_writer``) and a services nursery with the
    long-poll hub, promoter, reaper, pruner and scheduler (and, on PostgreSQL, the feed of the other
    servers' commits, relay/server/services/feed.py, and this server's rows of ``waiters``,
    relay/server/services/waiters.py). Leaving the block cancels the services,
    then stops the writer (commit, checkpoint, close). Raises StoreError if the database
    is refused. Exceptions of the body come out as they are, not in a group.
    """
    # In a thread, not cancellable (it may be migrating the schema): the trio thread waits
    # in its event loop meanwhile, where a signal's handler runs at once, rather than in a
    # long synchronous call (a quick_check of a large file), where it would run only after.
    # A cancellation comes at the next checkpoint, inside open_writer, which owns the store.
    store = await trio.to_thread.run_sync(open_store, config)
    # The writer's first write gives the leases of a previous run back: at once, or, if
    # the disk refuses it, in the background while writes are refused (thread.py).
    async with open_writer(
        store, clock=config.clock, shutdown_timeout=config.shutdown_timeout_ms / 1000,
        recover=True,
    ) as writer:  # fmt: skip
        limits = config.limits
        longpolls = LongPolls(writer, PARKED_PER_CONNECTION * limits.max_connections)
        promoter, reaper = Alarm(), Alarm()
        scheduler = Scheduler()
        wakes = CommitListener(longpolls.on_commit, longpolls.wants)
        writer.commit_listeners += [wakes, commit_listener(promoter, reaper), scheduler.listener()]
        watchers = Watchers(writer, limits.max_watchers, limits.max_watch_buffer)
        writer.commit_listeners.append(CommitListener(watchers.on_commit, _has_events))
        dispatcher = Dispatcher(
            writer, limits, longpolls, config.tokens, watchers, store.view, config.clock
        )
        async with open_service_nursery() as services:
            await services.start(longpolls.run)
            await services.start(run_promoter, writer, promoter, config.clock)
            await services.start(run_reaper, writer, reaper, config.clock)
            await services.start(run_pruner, writer)
            await services.start(run_scheduler, writer, scheduler, config.clock)
            histograms = Histograms(config.metrics_max_queues)
            await services.start(
                functools.partial(
                    run_history_flusher, interval_s=config.history_flush_ms / 1000
                ),
                writer, histograms,
            )  # fmt: skip
            if is_postgres_url(config.db):  # other servers may commit too: follow them
                from relay.server.services.feed import ChangeFeed

                others = [longpolls.on_remote_commit, commit_listener(promoter, reaper),
                          scheduler.listener()]  # fmt: skip

                def deliver(changes: Changes) -> None:
                    for listener in others:
                        listener(changes)

                def recheck() -> None:
                    longpolls.wake_all()
                    promoter.notify(0)
                    reaper.notify(0)
                    scheduler.alarm.notify(0)

                feed = ChangeFeed(store.url, store.origin, deliver, recheck)
                await services.start(feed.run)
                from relay.server.services.waiters import WaiterRows

                waiters = WaiterRows(writer, longpolls)
                longpolls.on_park = waiters.parked
                await services.start(waiters.run)
                await services.start(run_counts_refresher, writer)
            yield Core(
                writer, dispatcher, longpolls, watchers, services, store.view, scheduler,
                histograms,
            )  # fmt: skip
        # The history counted since the last flush, before the writer stops (a shutdown
        # loses none of it; a crash loses up to FLUSH_INTERVAL_S of it).
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(FINAL_FLUSH_S),
            contextlib.suppress(RelayError),
        ):
            await flush_history_once(writer, histograms)
