"""The server(s) under test: ``relay-trio server`` subprocesses on a fresh database (a
SQLite file, or a PostgreSQL database several of them share), stopped afterwards; or a
server that is already running, at an address."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from relay_scripts.bench.postgres import PgDatabase


@attrs.define
class ServerProcess:
    """The server(s) under test: the first one's process, address and metrics address;
    with ``--servers N``, all N addresses (the first included) in ``addresses``, and with
    ``--db URL`` the database they share, which ``database`` measures."""

    process: subprocess.Popen | None
    address: tuple[str, int]
    metrics: tuple[str, int] | None
    addresses: list[tuple[str, int]] = attrs.Factory(list)
    all_metrics: list[tuple[str, int]] = attrs.Factory(list)
    pids: list[int] = attrs.Factory(list)
    database: PgDatabase | None = None

    def __attrs_post_init__(self) -> None:
        if not self.addresses:
            self.addresses = [self.address]
        if not self.all_metrics and self.metrics is not None:
            self.all_metrics = [self.metrics]
        if not self.pids and self.process is not None:
            self.pids = [self.process.pid]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


def pick(addresses: list[tuple[str, int]], i: int) -> tuple[str, int]:
    """The server for connection ``i``: round-robin over them."""
    return addresses[i % len(addresses)]


def _relay_trio() -> str:
    return str(Path(sys.executable).parent / "relay-trio")


@attrs.frozen
class Tls:
    """A self-signed certificate for 127.0.0.1, and a client context that trusts it."""

    cert: str
    key: str
    context: ssl.SSLContext


def make_tls(directory: str) -> Tls:
    """Made with the openssl command (trustme is a test dependency, not the bench's): RSA
    2048, the common choice; the handshake is paid once per connection anyway."""
    cert, key = os.path.join(directory, "bench-cert.pem"), os.path.join(directory, "bench-key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
         "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return Tls(cert, key, ssl.create_default_context(cafile=cert))


@attrs.frozen
class Target:
    """Where the servers keep their jobs: a SQLite file in ``db_dir`` (the default), or,
    with ``pg_admin_url``, a fresh PostgreSQL database shared by ``servers`` servers."""

    pg_admin_url: str | None = None
    servers: int = 1


SQLITE = Target()  # the default: one server, on a SQLite file of its own


@contextmanager
def running_server(
    sync: str, db_dir: str, tls: Tls | None = None, target: Target = Target()
) -> Iterator[ServerProcess]:
    """``relay-trio server``(s) on a fresh database, stopped (SIGTERM) afterwards."""
    if target.pg_admin_url is None:
        db = os.path.join(db_dir, f"bench-{sync}-{time.monotonic_ns()}.db")
        try:
            with _one_server(db, sync, tls) as server:
                yield server
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.remove(db + suffix)
        return
    database = PgDatabase(target.pg_admin_url)
    try:
        with contextlib.ExitStack() as stack:
            group = [
                stack.enter_context(_one_server(database.url, sync, tls))
                for _ in range(target.servers)
            ]
            yield ServerProcess(
                group[0].process, group[0].address, group[0].metrics,
                addresses=[s.address for s in group],
                all_metrics=[s.metrics for s in group if s.metrics is not None],
                pids=[s.pid for s in group if s.pid is not None], database=database,
            )  # fmt: skip
    finally:
        database.drop()


@contextmanager
def _one_server(db: str, sync: str, tls: Tls | None) -> Iterator[ServerProcess]:
    args = [
        _relay_trio(), "server", "--db", db, "--address", "127.0.0.1:0",
        "--metrics-address", "127.0.0.1:0", "--ws-address", "off", "--synchronous", sync,
        "--max-in-flight", "1024", "--max-batch", "1000",
        # Its batch sizes are read from /metrics before and after each run: uncached.
        "--metrics-cache-ms", "1",
    ]  # fmt: skip
    if tls is not None:
        args += ["--tls-cert", tls.cert, "--tls-key", tls.key]
    env = dict(os.environ, RELAY_LOG="info", RELAY_LOG_FORMAT="json")  # read as JSON below
    process = subprocess.Popen(args, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 30
        started = None
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            entry = json.loads(line)
            if entry.get("event") == "server.started":
                started = entry
                break
        if started is None:
            raise RuntimeError("the server did not start")
        # Drain stderr in the background so the server never blocks on a full pipe.
        stderr = process.stderr
        threading.Thread(target=lambda: stderr.read(), daemon=True).start()
        host, port = started["address"].rsplit(":", 1)
        metrics = None
        if started.get("metrics"):
            mhost, mport = started["metrics"].rsplit(":", 1)
            metrics = (mhost, int(mport))
        yield ServerProcess(process, (host, int(port)), metrics)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def server_at(
    sync: str, address: str | None, db_dir: str, target: Target = Target()
) -> Iterator[ServerProcess]:
    """The running server at ``address`` (``--address``), or else one started as above."""
    if address is not None:
        host, port = address.rsplit(":", 1)
        yield ServerProcess(None, (host, int(port)), None)
    else:
        with running_server(sync, db_dir, target=target) as server:
            yield server
