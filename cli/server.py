"""``relay-trio server``: its options made into a ``ServerConfig``, its start-up (the
open-files limit, the signal receiver, ``serve``) and its start-up failures, each mapped to
one line on stderr and an exit code.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
from typing import TYPE_CHECKING

import attrs
import click
import trio

from relay import log as relay_log
from relay import wire
from relay.errors import StoreError
from relay.model import QUEUE_NAME_RE
from relay.server.auth import AuthConfigError, ExposureError, load_tokens
from relay.server.core import ServerConfig
from relay.server.tls import TlsConfigError
from relay_cli.options import DEFAULT_ADDRESS, parse_address

if TYPE_CHECKING:
    from relay.server.serve import ServerHandle

log = logging.getLogger("relay.cli")

DEFAULT_METRICS_ADDRESS = "127.0.0.1:7401"
DEFAULT_WS_ADDRESS = "127.0.0.1:7402"
# Exit code when a second SIGINT/SIGTERM cuts the graceful shutdown short.
EXIT_SECOND_SIGNAL = 130


def _limit(name: str, default: int, text: str):
    return click.option(
        f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1), default=default,
        show_default=True, help=text,
    )  # fmt: skip


_LIMITS = wire.Limits()


@click.command()
@click.option(
    "--db", default="relay.db", show_default=True,
    help="SQLite database file, or a PostgreSQL URL (postgresql://USER@HOST:PORT/DBNAME) "
    "that several servers may share.",
)  # fmt: skip
@click.option(
    "--address", envvar="RELAY_ADDRESS", default=DEFAULT_ADDRESS, show_default=True,
    help="HOST:PORT to listen on for clients (env RELAY_ADDRESS). Port 0 picks a free one.",
)  # fmt: skip
@click.option(
    "--metrics-address", default=DEFAULT_METRICS_ADDRESS, show_default=True,
    help="HOST:PORT for GET /metrics, /healthz and the dashboard page (GET /, which "
    "connects to --ws-address); 'off' disables it.",
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
@_limit("max_batch", _LIMITS.max_batch, "Most jobs per submit_batch or lease.")
@_limit("idempotency_window_ms", 24 * 3_600_000, "How long an idempotency key dedupes.")
@_limit("retention_ms", 7 * 24 * 3_600_000, "How long succeeded jobs are kept.")
@_limit("shutdown_timeout_ms", 10_000, "Grace period for in-flight requests at shutdown.")
@_limit("idle_timeout_ms", 300_000, "Close a connection silent this long (nothing in flight).")
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
    **numbers: int,
) -> None:
    """Run the server until SIGINT or SIGTERM (a second one exits at once)."""
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("give --tls-cert and --tls-key together")
    relay_log.configure()
    try:
        tokens = load_tokens(auth_token_file, os.environ.get("RELAY_AUTH_TOKEN"))
    except AuthConfigError as exc:
        click.echo(f"relay-trio: {exc}", err=True)
        sys.exit(2)
    host, port = parse_address(address)
    metrics_host, metrics_port = "127.0.0.1", None
    if metrics_address != "off":
        metrics_host, metrics_port = parse_address(metrics_address, "--metrics-address")
    ws_host, ws_port = "127.0.0.1", None
    if ws_address != "off":
        ws_host, ws_port = parse_address(ws_address, "--ws-address")
    limit_fields = {f.name for f in attrs.fields(wire.Limits)}
    limits = wire.Limits(**{k: v for k, v in numbers.items() if k in limit_fields})
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
        insecure=insecure,
        tls_cert=tls_cert,
        tls_key=tls_key,
        **{k: v for k, v in numbers.items() if k not in limit_fields},
    )
    # serve() runs under a nursery, so a start-up failure arrives in an exception group.
    failure: tuple[int, str] | None = None
    try:
        trio.run(_run_server, config)
    except* (ExposureError, TlsConfigError) as group:
        failure = (2, f"relay-trio: {group.exceptions[0]}")
    except* StoreError as group:
        exc = group.exceptions[0]
        assert isinstance(exc, StoreError)
        failure = (2, f"relay-trio: refusing to open {exc.path}: {exc.problem}")
    except* OSError as group:
        failure = (1, f"relay-trio: cannot listen on {address}: {group.exceptions[0]}")
    if failure is not None:
        click.echo(failure[1], err=True)
        sys.exit(failure[0])


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


def _parse_depths(values: tuple[str, ...]) -> dict[str, int]:
    depths = {}
    for value in values:
        queue, sep, number = value.rpartition("=")
        if not sep or not QUEUE_NAME_RE.fullmatch(queue) or not number.isdigit():
            raise click.BadParameter(f"{value!r} is not QUEUE=N", param_hint="--queue-depth")
        depths[queue] = int(number)
    return depths


async def _run_server(config: ServerConfig) -> None:
    # Imported here: the TCP server (and its metrics endpoint) is the heaviest import, and
    # no other command needs it.
    from relay.server.serve import serve

    # The signal receiver is installed before serving, so a signal during start-up is
    # not lost: it stops the server as soon as it is up.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def run(task_status: trio.TaskStatus[ServerHandle]) -> None:
                await serve(config, task_status=task_status)
                nursery.cancel_scope.cancel()

            handle: ServerHandle = await nursery.start(run)
            count = 0
            async for signum in signals:
                count += 1
                name = signal.Signals(signum).name
                if count == 1:
                    relay_log.event(log, logging.INFO, "shutdown.signal", signal=name)
                    handle.shutdown()
                else:
                    # SQLite's journal keeps the file consistent; nothing to flush here.
                    relay_log.event(log, logging.WARNING, "shutdown.forced", signal=name)
                    os._exit(EXIT_SECOND_SIGNAL)
