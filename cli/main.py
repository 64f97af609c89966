"""The relay-trio command line: arguments in, calls out. Rendering lives in cli/views.py."""

from __future__ import annotations

import logging
import os
import signal
import sys

import attrs
import click
import trio

from relay import log as relay_log
from relay import wire
from relay.errors import StoreError
from relay.server.serve import ServerConfig, ServerHandle, serve

log = logging.getLogger("relay.cli")

DEFAULT_ADDRESS = "127.0.0.1:7400"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:7401"
# Exit code when a second SIGINT/SIGTERM cuts the graceful shutdown short.
EXIT_SECOND_SIGNAL = 130


def parse_address(text: str, option: str = "--address") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{text!r} is not HOST:PORT", param_hint=option)
    return host.strip("[]"), int(port)


@click.group()
def main() -> None:
    """relay-trio: a durable job queue server with visible failure semantics."""


def _limit(name: str, default: int, text: str):
    return click.option(
        f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1), default=default,
        show_default=True, help=text,
    )  # fmt: skip


_LIMITS = wire.Limits()


@main.command()
@click.option("--db", default="relay.db", show_default=True, help="SQLite database file.")
@click.option(
    "--address", envvar="RELAY_ADDRESS", default=DEFAULT_ADDRESS, show_default=True,
    help="HOST:PORT to listen on for clients (env RELAY_ADDRESS). Port 0 picks a free one.",
)  # fmt: skip
@click.option(
    "--metrics-address", default=DEFAULT_METRICS_ADDRESS, show_default=True,
    help="HOST:PORT for GET /metrics and /healthz; 'off' disables it.",
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
def server(db: str, address: str, metrics_address: str, synchronous: str, **numbers: int) -> None:
    """Run the server until SIGINT or SIGTERM (a second one exits at once)."""
    relay_log.configure()
    host, port = parse_address(address)
    metrics_host, metrics_port = "127.0.0.1", None
    if metrics_address != "off":
        metrics_host, metrics_port = parse_address(metrics_address, "--metrics-address")
    limit_fields = {f.name for f in attrs.fields(wire.Limits)}
    limits = wire.Limits(**{k: v for k, v in numbers.items() if k in limit_fields})
    config = ServerConfig(
        db=db,
        host=host,
        port=port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        limits=limits,
        synchronous=synchronous,
        **{k: v for k, v in numbers.items() if k not in limit_fields},
    )
    # serve() runs under a nursery, so a start-up failure arrives in an exception group.
    failure: tuple[int, str] | None = None
    try:
        trio.run(_run_server, config)
    except* StoreError as group:
        exc = group.exceptions[0]
        assert isinstance(exc, StoreError)
        failure = (2, f"relay-trio: refusing to open {exc.path}: {exc.problem}")
    except* OSError as group:
        failure = (1, f"relay-trio: cannot listen on {address}: {group.exceptions[0]}")
    if failure is not None:
        click.echo(failure[1], err=True)
        sys.exit(failure[0])


async def _run_server(config: ServerConfig) -> None:
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
