"""``relay-trio server``: its options made into a ``ServerConfig``, its start-up (the
open-files limit, the signal handlers, ``serve``), its start-up failures, each mapped to one
line on stderr and an exit code, and what a person at a terminal reads: the start-up
summary and the line that says it is stopping (relay/util/log.py's text format).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import signal
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

import attrs
import click
import trio

from relay.protocol import wire
from relay.protocol.errors import StoreError, StoreUnreachable
from relay.protocol.model import QUEUE_NAME_RE
from relay.server.connections.listen import JOBS, METRICS, WEBSOCKET, ListenError
from relay.server.connections.tls import TlsConfigError
from relay.server.core import ServerConfig, is_postgres_url
from relay.server.requests.auth import AuthConfigError, ExposureError, load_tokens
from relay.util import log as relay_log
from relay_cli.config import configurable, print_config, print_config_requested
from relay_cli.errors import EXIT_FAILED, fail
from relay_cli.options import DEFAULT_ADDRESS, parse_address

if TYPE_CHECKING:
    from relay.server.serve import ServerHandle

log = logging.getLogger("relay.cli")

# The server's defaults, as its configuration states them.
_DEFAULT = {field.name: field.default for field in attrs.fields(ServerConfig)}

DEFAULT_METRICS_ADDRESS = "127.0.0.1:7401"
DEFAULT_WS_ADDRESS = "127.0.0.1:7402"
# Exit code when a second SIGINT/SIGTERM cuts the graceful shutdown short.
EXIT_SECOND_SIGNAL = 130
# Exit code of a start-up refused for its configuration (as click's usage errors).
EXIT_CONFIGURATION = 2
# The option that sets each listener's address, for the one line a ListenError becomes.
LISTEN_OPTIONS = {JOBS: "--address", METRICS: "--metrics-address", WEBSOCKET: "--ws-address"}


def _limit(name: str, default: int, text: str):
    return click.option(
        f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1), default=default,
        show_default=True, help=text,
    )  # fmt: skip


_LIMITS = wire.Limits()


@configurable
@click.command()
@click.option(
    "--db", default="relay.db", show_default=True, callback=lambda ctx, param, value:
    check_db(value),
    help="SQLite database file, or a PostgreSQL URL (postgresql://USER@HOST:PORT/DBNAME) "
    "that several servers may share.",
)  # fmt: skip
@click.option(
    "--address", envvar="RELAY_ADDRESS", default=DEFAULT_ADDRESS, show_default=True,
    help="HOST:PORT to listen on for clients (env RELAY_ADDRESS). Port 0 picks a free one.",
)  # fmt: skip
@click.option(
    "--metrics-address", default=DEFAULT_METRICS_ADDRESS, show_default=True,
    help="HOST:PORT for GET /metrics, /healthz (ready), /livez (alive) and the dashboard "
    "page (GET /, which connects to --ws-address); 'off' disables it.",
)  # fmt: skip
@click.option(
    "--ws-address", default=DEFAULT_WS_ADDRESS, show_default=True,
    help="HOST:PORT for the WebSocket endpoint (the same requests, one per text message); "
    "'off' disables it.",
)  # fmt: skip
@click.option(
    "--ws-origin", "ws_origins", multiple=True, metavar="ORIGIN",
    help="A web page origin (scheme://host[:port]) that may open a WebSocket, besides the "
    "dashboard's own page on an IP address or localhost; repeat for several.",
)  # fmt: skip
@_limit("max_connections", _LIMITS.max_connections, "Client connections at once.")
@_limit("max_in_flight", _LIMITS.max_in_flight, "Unanswered requests per connection.")
@_limit("max_frame_bytes", _LIMITS.max_frame_bytes, "Longest request line.")
@_limit("max_payload_bytes", _LIMITS.max_payload_bytes, "Largest payload, encoded.")
@_limit("max_lease_ms", _LIMITS.max_lease_ms, "Longest lease a worker may ask for.")
@_limit("max_wait_ms", _LIMITS.max_wait_ms, "Longest long-poll wait.")
@_limit("max_batch", _LIMITS.max_batch, "Most items per submit_batch, lease, ack_batch, short_ids.")
@_limit("idempotency_window_ms", 24 * 3_600_000, "How long an idempotency key dedupes.")
@_limit("retention_ms", 7 * 24 * 3_600_000, "How long succeeded jobs are kept.")
@_limit("shutdown_timeout_ms", 10_000, "Grace period for in-flight requests at shutdown.")
@_limit("idle_timeout_ms", 300_000, "Close a connection silent this long (nothing in flight).")
@_limit(
    "token_grace_ms", _DEFAULT["token_grace_ms"],
    "After a reload (SIGHUP) removes a token or changes its role, connections that said "
    "hello with it are closed once this has passed.",
)  # fmt: skip
@_limit(
    "max_queues", _DEFAULT["max_queues"],
    "Queues that may hold jobs (in any state, retained ones included); a submit that would "
    "create one more answers too_many_queues.",
)  # fmt: skip
@_limit(
    "max_schedules", _DEFAULT["max_schedules"],
    "Cron schedules that may exist at once; a schedule put that would make one more "
    "answers too_many_schedules.",
)  # fmt: skip
@click.option(
    "--allow-second-schedules", is_flag=True,
    help="Accept cron schedules with a seconds field (six fields: more often than once a "
    "minute); without it, a schedule runs at most once a minute.",
)  # fmt: skip
@_limit(
    "metrics_max_queues", _DEFAULT["metrics_max_queues"],
    "Queues (the first by name) with their own series on /metrics; the others are summed "
    'into queue="_other".',
)  # fmt: skip
@_limit(
    "metrics_cache_ms",
    _DEFAULT["metrics_cache_ms"],
    "One /metrics rendering serves scrapes this long.",
)
@_limit(
    "max_reply_buffer_bytes", _DEFAULT["max_reply_buffer_bytes"],
    "Reply bytes all connections may owe at once; past it, those that owe any are not read "
    "until their clients take their replies.",
)  # fmt: skip
@_limit(
    "hello_timeout_ms", _DEFAULT["hello_timeout_ms"],
    "Close a connection not authenticated this long after it connects (its TLS or "
    "WebSocket handshake, and with tokens its hello).",
)  # fmt: skip
@click.option(
    "--max-prehello", type=click.IntRange(min=1), default=None,
    help="Connections not yet authenticated at once; past it, a newcomer takes the place "
    "of the oldest from the address holding the most. Default: max-connections/8, at "
    "least 16.",
)  # fmt: skip
@click.option(
    "--max-prehello-per-address", type=click.IntRange(min=1), default=None,
    help="Connections not yet authenticated from one address (an IPv6 /64) at once; past "
    "it: overloaded. Default: max-connections/64, at least 8.",
)  # fmt: skip
@click.option(
    "--synchronous", type=click.Choice(["full", "normal"]), default="full", show_default=True,
    help="SQLite synchronous mode: full fsyncs every commit; normal may lose the last "
    "commits on power loss.",
)  # fmt: skip
@click.option(
    "--max-queue-depth", type=click.IntRange(min=1), default=None,
    help="Unfinished jobs (pending, ready, leased, retrying) any queue may hold before "
    "submit answers queue_full. Default: unbounded.",
)  # fmt: skip
@click.option(
    "--auth-token-file", metavar="PATH",
    help="Tokens with roles, one 'ROLE TOKEN' per line (roles: producer, worker, admin), or "
    "one bare admin token. Env RELAY_AUTH_TOKEN adds one admin token. With any token, a "
    "connection must say hello with one first. See docs/security.md.",
)  # fmt: skip
@click.option(
    "--insecure", is_flag=True,
    help="Allow listening beyond loopback without tokens: anyone who can reach the port "
    "may submit, lease and purge.",
)  # fmt: skip
@click.option(
    "--queue-depth", "queue_depths", multiple=True, metavar="QUEUE=N",
    callback=lambda ctx, param, value: _parse_depths(value),
    help="The same for one queue (repeatable); overrides --max-queue-depth for it.",
)  # fmt: skip
@click.option(
    "--tls-cert", metavar="PATH",
    help="Serve clients over TLS with this certificate (PEM, the chain after it); with "
    "--tls-key. The metrics endpoint stays plain HTTP.",
)  # fmt: skip
@click.option("--tls-key", metavar="PATH", help="The certificate's private key (PEM).")
@click.option(
    "--log-format", type=click.Choice(list(relay_log.FORMATS), case_sensitive=False),
    default="auto", show_default=True,
    help="Logs on stderr: json (one object per line, for journald and log collectors), "
    "human (short lines and a start-up summary; 'text' is its former name), or auto: "
    "human on a terminal, json otherwise.",
)  # fmt: skip
@click.option(
    "--log-level", type=click.Choice(list(relay_log.LEVELS), case_sensitive=False),
    default="info", show_default=True, envvar=["RELAY_LOG_LEVEL", "RELAY_LOG"],
    help="The least important events logged.",
)  # fmt: skip
def server(
    db: str,
    address: str,
    metrics_address: str,
    ws_address: str,
    ws_origins: tuple[str, ...],
    synchronous: str,
    max_queue_depth: int | None,
    queue_depths: dict[str, int],
    auth_token_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    allow_second_schedules: bool,
    log_format: str,
    log_level: str,
    **numbers: int,
) -> None:
    """Run the server until SIGINT or SIGTERM (a second one exits at once). SIGHUP reads
    the token file and the TLS certificate and key again.

    Every option may also come from a TOML file (--config) and from the environment
    (RELAY_<OPTION>, dashes as underscores); the command line comes first, then the
    environment, then the file. Logs go to stderr: short lines, and a summary once it
    serves, on a terminal; JSON lines otherwise (--log-format). See docs/operations.md.
    """
    ctx = click.get_current_context()
    if print_config_requested(ctx):
        print_config(ctx, ctx.params)
    # First: from here on, Ctrl-C stops the server without a traceback, whatever it does.
    signals = Signals(numbers["shutdown_timeout_ms"])
    signals.install()
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("give --tls-cert and --tls-key together")
    try:
        relay_log.configure(log_level, log_format=log_format, renderers=TEXT_RENDERERS)
    except relay_log.LogConfigError as exc:
        fail(str(exc), EXIT_CONFIGURATION)
    try:
        tokens = load_tokens(auth_token_file, os.environ.get("RELAY_AUTH_TOKEN"))
    except AuthConfigError as exc:
        fail(str(exc), EXIT_CONFIGURATION)
    host, port = parse_address(address)
    metrics_host, metrics_port = "127.0.0.1", None
    if metrics_address != "off":
        metrics_host, metrics_port = parse_address(metrics_address, "--metrics-address")
    ws_host, ws_port = "127.0.0.1", None
    if ws_address != "off":
        ws_host, ws_port = parse_address(ws_address, "--ws-address")
    limit_fields = {f.name for f in attrs.fields(wire.Limits)}
    limits = wire.Limits(
        **{k: v for k, v in numbers.items() if k in limit_fields},
        allow_second_schedules=allow_second_schedules,
    )
    raise_open_files_limit(limits.max_connections)
    config = ServerConfig(
        db=db,
        host=host,
        port=port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        ws_host=ws_host,
        ws_port=ws_port,
        ws_origins=ws_origins,
        limits=limits,
        synchronous=synchronous,
        max_queue_depth=max_queue_depth,
        queue_depths=queue_depths,
        tokens=tokens,
        auth_token_file=auth_token_file,
        auth_env_token=os.environ.get("RELAY_AUTH_TOKEN") or None,
        insecure=insecure,
        tls_cert=tls_cert,
        tls_key=tls_key,
        **{k: v for k, v in numbers.items() if k not in limit_fields},
    )
    # serve() raises each start-up failure as itself (_run_server keeps it out of an
    # exception group); anything else is a bug and keeps its traceback.
    try:
        trio.run(_run_server, config, signals)
    except ListenError as exc:
        option = LISTEN_OPTIONS[exc.listener]
        fail(f"cannot open the {exc.listener} listener ({option}) on {exc.address}: "
             f"{exc.reason}", EXIT_CONFIGURATION)  # fmt: skip
    except StoreUnreachable as exc:
        # (A failure that may pass, PostgreSQL down or starting: exit 1, which the
        # systemd unit restarts, as it does not restart a configuration error's 2.)
        fail(f"cannot connect to {exc.path}: {exc.problem.removeprefix('cannot connect: ')} "
             f"(check that PostgreSQL runs there and takes this URL's user, password and "
             f"database)", EXIT_FAILED)  # fmt: skip
    except StoreError as exc:
        fail(f"refusing to open {exc.path}: {exc.problem}", EXIT_CONFIGURATION)
    except (ExposureError, TlsConfigError) as exc:
        fail(str(exc), EXIT_CONFIGURATION)


# File descriptors the server needs besides its client connections: the database and its
# WAL, the listeners, up to 32 metrics connections, trio's wake-up pipe, and some spare.
SPARE_FILES = 128


def raise_open_files_limit(max_connections: int) -> None:
    """Raise the soft limit on open files (often 1,024) toward the hard one, so that
    ``max_connections`` connections can be accepted: past the limit accept() fails, and
    a client over it would wait in the backlog rather than be told it is overloaded."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):  # e.g. macOS caps it below an unlimited hard limit
            new = soft
    if new < want:
        relay_log.event(
            logging.getLogger("relay.server"), logging.WARNING, "server.open_files_limit",
            limit=new, max_connections=max_connections,
            hint="raise the hard limit (ulimit -Hn) or lower --max-connections",
        )  # fmt: skip


def check_db(value: str) -> str:
    """A --db that names a file or a PostgreSQL database: not empty (SQLite would take it
    for a temporary database, gone at exit), not a URL of another kind (a path it is not)."""
    if not value.strip():
        raise click.BadParameter("is empty: give a SQLite file path or a postgresql:// URL")
    if "://" in value and not is_postgres_url(value):
        scheme = value.split("://", 1)[0]
        raise click.BadParameter(
            f"{value!r}: {scheme}:// is no store of relay-trio's: give a SQLite file path or "
            "a postgresql:// URL"
        )
    return value


def _parse_depths(values: tuple[str, ...]) -> dict[str, int]:
    depths = {}
    for value in values:
        queue, sep, number = value.rpartition("=")
        if not sep or not QUEUE_NAME_RE.fullmatch(queue) or not number.isdigit():
            raise click.BadParameter(f"{value!r} is not QUEUE=N", param_hint="--queue-depth")
        depths[queue] = int(number)
    return depths


class Signals:
    """SIGINT and SIGTERM, from the command's start to the process's end: the first stops
    the server (gracefully once it serves; while it starts, at once, closing what is open),
    a second exits with EXIT_SECOND_SIGNAL at once, in any phase.

    Python-level handlers rather than trio's signal receiver: they run before ``trio.run``
    (reading the options and the token file), and while the trio thread is busy in
    synchronous code (opening the database), where a second signal must still end the
    process. The first is passed to the trio run with ``run_sync_soon``, which may be
    called from a signal handler. (A handler runs between bytecodes, or when its signal
    interrupts a system call: a signal that lands just before a blocking call begins waits
    until that call returns. A person's Ctrl-C during a long wait lands in the wait.)
    """

    def __init__(self, shutdown_timeout_ms: int) -> None:
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self.count = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: Callable[[], bool] | None = None
        self._first: str | None = None  # the first signal's name, once it came
        self._said = False  # shutdown.signal was logged
        self._passed = False  # the first signal was passed to stop()
        self._over = False  # the trio run is over

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)
        # SIGHUP reloads the token file and the certificate once the server serves
        # (relay/server/reload.py takes it then); until then it is ignored, where by
        # default it would end the process (a `systemctl reload` during start-up).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def attach(self, stop: Callable[[], bool]) -> None:
        """From the trio run: for the first signal (at once if it came before), call
        ``stop()`` there, which returns whether the server was serving."""
        self._stop = stop
        self._token = trio.lowlevel.current_trio_token()
        if self._first is not None:
            self._pass_on(self._first)

    def detach(self) -> None:
        """The trio run is over: a first signal from now on has nothing left to stop."""
        self._token = None
        self._over = True

    def _pass_on(self, name: str) -> None:
        """In the trio run: stop the server (once), and say so (unless said already)."""
        if self._passed or self._stop is None:
            return
        self._passed = True
        serving = self._stop()
        self._say(name, starting=not serving)

    def _say(self, name: str, *, starting: bool, in_handler: bool = False) -> None:
        if not self._said:
            self._said = True
            fields = {"signal": name, "starting": starting,
                      "shutdown_timeout_ms": self.shutdown_timeout_ms}  # fmt: skip
            if in_handler:
                _write_now(logging.INFO, "shutdown.signal", fields)
            else:
                relay_log.event(log, logging.INFO, "shutdown.signal", **fields)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count > 1:
            # SQLite's journal keeps the file consistent; nothing to flush here.
            try:
                _write_now(logging.WARNING, "shutdown.forced", {"signal": name})
            finally:
                os._exit(EXIT_SECOND_SIGNAL)
        self._first = name
        token = self._token
        if token is None:
            # Before the run, said now: start-up may be stuck where it is (a token file
            # that is a pipe), and the person should know that a second Ctrl-C ends it.
            if not self._over:
                self._say(name, starting=True, in_handler=True)
            return
        with contextlib.suppress(trio.RunFinishedError):  # it has just ended
            token.run_sync_soon(self._pass_on, name)


def _write_now(level: int, name: str, fields: dict[str, Any]) -> None:
    """Log ``name`` from a signal handler: formatted as the relay logger's lines are, and
    written to stderr directly, only if it can take the line now. Not through logging: the
    handler may have interrupted a write to stderr (a second write would fail as reentrant)
    or stderr may be a pipe nobody reads (the write would block, and the exit with it)."""
    handlers = logging.getLogger("relay").handlers
    record = logging.LogRecord(log.name, level, __file__, 0, name, None, None)
    record.fields = fields
    text = handlers[0].format(record) if handlers else name
    with contextlib.suppress(OSError, ValueError):
        if select.select([], [2], [], 0)[1]:
            os.write(2, text.encode() + b"\n")


@attrs.define
class _Started:
    """serve()'s ``task_status``, passed on to ``outer``: ``handle`` is set in the very
    step in which serve() logs ``server.started``, so a signal handled after that line
    finds a server to shut down gracefully, and one handled before it, a start-up to
    cancel."""

    outer: trio.TaskStatus[None]
    handle: ServerHandle | None = None

    def started(self, value: ServerHandle) -> None:
        self.handle = value
        self.outer.started()


async def _run_server(config: ServerConfig, signals: Signals) -> None:
    # Imported here: the TCP server (and its metrics endpoint) is the heaviest import, and
    # no other command needs it.
    from relay.server.serve import serve

    started: _Started | None = None
    failure: Exception | None = None

    async def run(task_status: trio.TaskStatus[None]) -> None:
        nonlocal started
        started = _Started(task_status)
        await serve(config, task_status=started)

    try:
        async with trio.open_nursery() as nursery:

            def stop() -> bool:
                handle = None if started is None else started.handle
                if handle is None:
                    nursery.cancel_scope.cancel()  # serve() closes what it opened so far
                    return False
                handle.shutdown()
                return True

            signals.attach(stop)
            try:
                await nursery.start(run)
            except Exception as exc:
                failure = exc  # a start-up failure: out of the nursery as itself, not in a group
            # The nursery waits for serve(), which returns after its bounded shutdown.
    finally:
        signals.detach()
    if failure is not None:
        raise failure


# -- what a person at a terminal reads --------------------------------------------------------


def startup_summary(fields: Mapping[str, Any]) -> str:
    """``server.started`` as text: where clients and browsers connect, where the jobs are
    kept and how durably, whether tokens and TLS are on, and how to stop it."""
    tls = bool(fields.get("tls"))
    metrics, websocket = fields.get("metrics"), fields.get("websocket")
    db = str(fields.get("db", ""))
    if is_postgres_url(db):
        database, durability = f"{db} (PostgreSQL)", "each ok after its COMMIT (PostgreSQL's)"
    else:
        database = f"{os.path.abspath(db)} (SQLite)"
        durability = {
            "full": "synchronous=full: each commit is on disk (fsync) before its ok",
            "normal": "synchronous=normal: a power loss may lose the last commits",
        }.get(str(fields.get("synchronous")), f"synchronous={fields.get('synchronous')}")
    tokens = fields.get("tokens") or 0
    rows = [
        ("jobs", f"{fields.get('address')}" + (" (TLS)" if tls else "")),
        ("metrics", f"http://{metrics}/metrics" if metrics else "off"),
        ("dashboard", f"http://{metrics}/" if metrics else "off (it is served with metrics)"),
        ("WebSocket", f"{'wss' if tls else 'ws'}://{websocket}/" if websocket else "off"),
        ("database", database),
        ("durability", durability),
        ("tokens", f"{tokens} (a client says hello with one)" if tokens else
                   "off (loopback only; any client may do anything)"),
        ("TLS", "on (jobs and WebSocket; metrics stay plain HTTP)" if tls else "off"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    seconds = _seconds(fields.get("shutdown_timeout_ms"))
    return "\n".join([
        f"relay-trio {fields.get('version')} is serving (started in "
        f"{fields.get('startup_ms')} ms)",
        *(f"  {name:<{width}}  {value}" for name, value in rows),
        f"  Ctrl-C stops it (requests in flight get up to {seconds}; Ctrl-C again: at once)",
    ])  # fmt: skip


def stopping_line(fields: Mapping[str, Any]) -> str:
    """``shutdown.signal`` as text: that it stops, and how long it may take at most."""
    name = fields.get("signal")
    if fields.get("starting"):
        return f"stopping ({name}) before serving: closing what is open"
    seconds = _seconds(fields.get("shutdown_timeout_ms"))
    return f"stopping ({name}): requests in flight get up to {seconds} (again: now)"


def _seconds(ms: Any) -> str:
    return f"{ms / 1000:g} s" if isinstance(ms, int | float) else "the shutdown timeout"


TEXT_RENDERERS = {"server.started": startup_summary, "shutdown.signal": stopping_line}
