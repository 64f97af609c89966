"""relay-bench: throughput, latency and memory of a relay-trio server, measured honestly.

    relay-bench                 # full run (a few minutes), server started on a temp db
    relay-bench --quick         # reduced sizes, one run each: under 30 s
    relay-bench --json out.json --address 127.0.0.1:7400   # against a running server
    relay-bench --tls           # the submit scenarios over plain TCP and over TLS
    relay-bench --watchers      # submit and lease+ack with no, an idle, an all-events watcher

Each scenario runs ``--runs`` times; the table shows the median with min and max. The
server is a subprocess with ``synchronous=FULL`` unless stated: every ok reply it sends is
fsync'd. Load generators use raw sockets and pre-encoded requests, and count replies
without parsing them, so that the generator is not what is measured. See
docs/benchmarking.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import sqlite3
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import click
import orjson
import trio
from rich.console import Console
from rich.table import Table

READ_BYTES = 256 * 1024
# Every scenario run is bounded: a hung server fails the bench instead of hanging it.
RUN_TIMEOUT_S = 300.0


# -- the server under test --------------------------------------------------------------------


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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of ``pids`` so far (those gone count nothing)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS


# PostgreSQL's backends report their statistics at most once a second (PGSTAT_MIN_INTERVAL).
STATS_SETTLE_S = 1.1
STATS_SETTLE_TRIES = 6


class PgDatabase:
    """A fresh PostgreSQL database for one group of scenarios, named uniquely, created
    through ``admin_url`` (an existing database) and dropped afterwards; never any other."""

    def __init__(self, admin_url: str) -> None:
        import psycopg
        from psycopg import sql
        from psycopg.conninfo import conninfo_to_dict

        self.admin_url = admin_url
        self.name = f"relay_bench_{os.getpid()}_{os.urandom(4).hex()}"
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        params = conninfo_to_dict(admin_url)
        auth = f"{params['user']}@" if params.get("user") else ""
        host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
        self.url = f"postgresql://{auth}{host}:{port}/{self.name}"
        # Sampled between runs from the admin database, so that the samples' own
        # transactions are not counted in this one's.
        self._conn = psycopg.connect(admin_url, autocommit=True)

    def sample(self) -> dict[str, float]:
        """Counters of this database, and the CPU seconds of PostgreSQL's processes that
        serve it: its backends, and the shared ones (WAL writer, checkpointer, ...).

        A backend reports its counts at most once a second, when it goes idle: the
        counters are read until two reads STATS_SETTLE_S apart agree (at most
        STATS_SETTLE_TRIES reads), so that a run's transactions are not counted late."""
        row = None
        for _ in range(STATS_SETTLE_TRIES):
            self._conn.execute("SELECT pg_stat_clear_snapshot()")  # (a fresh read)
            now = self._conn.execute(
                "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted, tup_fetched "
                "FROM pg_stat_database WHERE datname = %s",
                (self.name,),
            ).fetchone()
            if now is not None and now == row:
                break
            row = now
            time.sleep(STATS_SETTLE_S)
        pids = [r[0] for r in self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s OR backend_type <> "
            "'client backend'", (self.name,),
        )]  # fmt: skip
        assert row is not None
        return {"xacts": row[0], "rows_written": row[1], "rows_fetched": row[2],
                "cpu_s": cpu_seconds(pids)}  # fmt: skip

    def drop(self) -> None:
        from psycopg import sql

        self._conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
        )
        self._conn.close()


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


def peak_rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else None


class RssSampler:
    """Samples the server's resident memory while a scenario runs; keeps the peak."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak: float | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            rss = peak_rss_mb(self.pid)
            if rss is not None:
                self.peak = rss if self.peak is None else max(self.peak, rss)
            await trio.sleep(0.05)


async def scrape(metrics: tuple[str, int] | None) -> dict[str, float]:
    """The writer's batch-size sum and count from /metrics."""
    if metrics is None:
        return {}
    stream = await trio.open_tcp_stream(*metrics)
    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := await stream.receive_some(READ_BYTES):
        data += chunk
    await stream.aclose()
    values = {}
    for name in ("relay_store_batch_size_sum", "relay_store_batch_size_count"):
        match = re.search(rf"^{name} (\S+)$", data.decode(), re.M)
        if match:
            values[name] = float(match.group(1))
    # Summed over queues: the jobs a scenario moved, whichever server moved them.
    for name in ("relay_jobs_submitted_total", "relay_jobs_acked_total"):
        found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", data.decode(), re.M)
        values[name] = sum(float(v) for v in found)
    return values


# -- raw NDJSON connections -------------------------------------------------------------------


class Conn:
    """A raw connection: pre-encoded lines out, replies counted (parsed only when asked)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buffer = b""
        self.ids = itertools.count(1)

    @classmethod
    async def open(cls, address: tuple[str, int], context: ssl.SSLContext | None = None) -> Conn:
        """A connection; with ``context``, over TLS (the handshake done before returning)."""
        stream: trio.abc.Stream = await trio.open_tcp_stream(*address)
        if context is not None:
            stream = trio.SSLStream(stream, context, server_hostname=address[0])
            await stream.do_handshake()
        return cls(stream)

    def line(self, op: str, **fields: Any) -> bytes:
        return orjson.dumps({"op": op, "id": next(self.ids), **fields}) + b"\n"

    async def read_count(self, n: int) -> None:
        """Read ``n`` reply lines; fail on any error reply."""
        got = self.buffer.count(b"\n")
        while got < n:
            data = await self.stream.receive_some(READ_BYTES)
            if not data:
                raise RuntimeError("server closed the connection")
            self.buffer += data
            got = self.buffer.count(b"\n")
        if b'"ok":false' in self.buffer:
            raise RuntimeError(f"error reply: {self.buffer[:300]!r}")
        # Keep what follows the n-th line.
        cut = -1
        for _ in range(n):
            cut = self.buffer.index(b"\n", cut + 1)
        self.buffer = self.buffer[cut + 1 :]

    async def read_replies(self, n: int) -> list[dict[str, Any]]:
        replies = []
        while len(replies) < n:
            while b"\n" not in self.buffer:
                data = await self.stream.receive_some(READ_BYTES)
                if not data:
                    raise RuntimeError("server closed the connection")
                self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            replies += [orjson.loads(line) for line in lines]
        for reply in replies:
            if not reply.get("ok"):
                raise RuntimeError(f"error reply: {reply}")
        return replies

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        await self.stream.send_all(self.line(op, **fields))
        (reply,) = await self.read_replies(1)
        return reply

    async def aclose(self) -> None:
        await self.stream.aclose()


def _payload(i: int) -> dict[str, Any]:
    return {"n": i, "kind": "bench"}


# -- scenarios ------------------------------------------------------------------------------


async def _timed_connections(
    addresses: list[tuple[str, int]],
    connections: int,
    produce: Callable[[Conn], Awaitable[None]],
    context: ssl.SSLContext | None = None,
) -> float:
    """Open ``connections`` (round-robin over the servers), run ``produce`` on each
    concurrently; the seconds it took."""
    conns = [await Conn.open(pick(addresses, i), context) for i in range(connections)]
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for conn in conns:
            nursery.start_soon(produce, conn)
    elapsed = time.perf_counter() - started
    for conn in conns:
        await conn.aclose()
    return elapsed


async def submit_one_at_a_time(
    addresses, producers: int, per_producer: int, context: ssl.SSLContext | None = None
) -> float:
    async def produce(conn: Conn) -> None:
        for i in range(per_producer):
            await conn.stream.send_all(conn.line("submit", queue="bench", payload=_payload(i)))
            await conn.read_count(1)

    elapsed = await _timed_connections(addresses, producers, produce, context)
    return producers * per_producer / elapsed


async def submit_pipelined(
    addresses, window: int, total: int, context: ssl.SSLContext | None = None
) -> float:
    conn = await Conn.open(addresses[0], context)
    lines = [conn.line("submit", queue="bench", payload=_payload(i)) for i in range(total)]
    started = time.perf_counter()

    async def sender() -> None:
        for i in range(0, total, window // 2):
            await conn.stream.send_all(b"".join(lines[i : i + window // 2]))
            await sent.acquire()

    sent = trio.Semaphore(2)  # at most `window` requests outstanding
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        remaining = total
        while remaining:
            n = min(window // 2, remaining)
            await conn.read_count(n)
            remaining -= n
            sent.release()
    elapsed = time.perf_counter() - started
    await conn.aclose()
    return total / elapsed


async def submit_batches(addresses, clients: int, batch: int, batches: int) -> float:
    async def produce(conn: Conn) -> None:
        jobs = [{"queue": "bench", "payload": _payload(i)} for i in range(batch)]
        for _ in range(batches):
            await conn.stream.send_all(conn.line("submit_batch", jobs=jobs))
            await conn.read_count(1)

    return clients * batch * batches / await _timed_connections(addresses, clients, produce)


async def submit_from_tasks(
    addresses, tasks: int, per_task: int, batch_window_ms: float | None = None
) -> float:
    """One relay.Client shared by ``tasks`` tasks, each submitting one job at a time (a
    web app's request handlers, a fan-out)."""
    import relay

    async with relay.open_client(addresses[0], batch_window_ms=batch_window_ms) as client:

        async def produce(t: int) -> None:
            for i in range(per_task):
                await client.submit("bench", _payload(t * per_task + i))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(produce, t)
        return tasks * per_task / (time.perf_counter() - started)


async def prefill(addresses, total: int, queue: str = "bench") -> None:
    """Submit ``total`` no-op jobs in batches of 1000, a few batches in flight."""
    conn = await Conn.open(addresses[0])
    jobs = [{"queue": queue, "payload": {}}] * 1000
    sent = 0
    window = 4
    outstanding = 0
    while sent < total or outstanding:
        while sent < total and outstanding < window:
            n = min(1000, total - sent)
            await conn.stream.send_all(conn.line("submit_batch", jobs=jobs[:n]))
            sent += n
            outstanding += 1
        await conn.read_count(1)
        outstanding -= 1
    await conn.aclose()


async def consume_raw(
    address, total: int, count: int, queue: str = "bench", batch_acks: bool = False
) -> int:
    """Lease up to ``count`` at a time and pipeline the acks (or send them as one
    ``ack_batch``); stop after ``total`` jobs or when the queue is empty. Returns jobs done."""
    conn = await Conn.open(address)
    worker = f"bench-{os.getpid()}-{id(conn)}"
    done = 0
    while done < total:
        reply = await conn.call("lease", queues=[queue], worker_id=worker, count=count)
        jobs = reply["jobs"]
        if not jobs:
            break
        if batch_acks:
            acks = [{"job_id": j["job_id"], "token": j["token"]} for j in jobs]
            reply = await conn.call("ack_batch", worker_id=worker, acks=acks)
            if not all(r["ok"] for r in reply["results"]):
                raise RuntimeError(f"an ack was refused: {reply}")
        else:
            lines = b"".join(
                conn.line("ack", job_id=j["job_id"], worker_id=worker, token=j["token"])
                for j in jobs
            )
            await conn.stream.send_all(lines)
            await conn.read_count(len(jobs))
        done += len(jobs)
    await conn.aclose()
    return done


async def lease_ack_processes(
    addresses, processes: int, count: int, total: int, batch_acks: bool = False
) -> float:
    """``processes`` consumer processes, each leasing ``count`` per request. The clock
    starts when all of them are connected and told to go: process start-up (~1 s of
    imports on a small VM) is not part of the rate."""
    per = math.ceil(total / processes)

    def args(i: int) -> list[str]:
        host, port = pick(addresses, i)
        return [sys.executable, __file__, "_consume", f"{host}:{port}", str(per), str(count),
                "batch" if batch_acks else "each"]  # fmt: skip

    consumers = [
        await trio.lowlevel.open_process(args(i), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for i in range(processes)
    ]
    for consumer in consumers:
        assert consumer.stdout is not None
        assert await _read_line(consumer.stdout) == "ready"
    started = time.perf_counter()
    for consumer in consumers:
        assert consumer.stdin is not None
        await consumer.stdin.send_all(b"go\n")
    done = [int(await _read_line(c.stdout)) for c in consumers]  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    for consumer in consumers:
        await consumer.wait()
    return sum(done) / elapsed


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            raise RuntimeError("a consumer process exited early")
        data += chunk
    return data.decode().strip()


async def lease_ack_worker(addresses, concurrency: int, total: int) -> float:
    import relay

    address = addresses[0]
    done = 0
    finished = trio.Event()

    async def noop(job: Any) -> None:
        nonlocal done
        done += 1
        if done >= total:
            finished.set()

    worker = relay.Worker(
        f"{address[0]}:{address[1]}", queues=["bench"], handler=noop, concurrency=concurrency,
        wait_ms=200,
    )  # fmt: skip
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.run)
        await finished.wait()
        elapsed = time.perf_counter() - started
        worker.stop()
    return total / elapsed


async def latency(addresses, rate: float, duration: float) -> dict[str, float]:
    """Open loop: submit at ``rate``/s; a consumer leases (long-poll) and acks. Measures
    submit sent -> handler started, and submit sent -> ack committed (reply received).
    Both on the first server: its long-poll wakes for its own commits."""
    producer = await Conn.open(addresses[0])
    consumer = await Conn.open(addresses[0])
    to_start: list[float] = []
    to_ack: list[float] = []
    total = int(rate * duration)
    worker = "bench-latency"

    async def produce() -> None:
        interval = 1 / rate
        next_at = time.perf_counter()
        for _ in range(total):
            now = time.perf_counter()
            if next_at > now:
                await trio.sleep(next_at - now)
            next_at += interval
            line = producer.line("submit", queue="lat", payload={"t": time.perf_counter()})
            await producer.stream.send_all(line)

    async def drain_producer() -> None:
        remaining = total
        while remaining:
            n = min(remaining, 64)
            await producer.read_count(n)
            remaining -= n

    async def consume() -> None:
        seen = 0
        while seen < total:
            reply = await consumer.call("lease", queues=["lat"], worker_id=worker, count=64,
                                        wait_ms=1000)  # fmt: skip
            jobs = reply["jobs"]
            started = time.perf_counter()
            for job in jobs:
                to_start.append(started - job["payload"]["t"])
            if not jobs:
                continue
            await consumer.stream.send_all(b"".join(
                consumer.line("ack", job_id=j["job_id"], worker_id=worker, token=j["token"])
                for j in jobs
            ))  # fmt: skip
            await consumer.read_count(len(jobs))
            acked = time.perf_counter()
            for job in jobs:
                to_ack.append(acked - job["payload"]["t"])
            seen += len(jobs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain_producer)
        nursery.start_soon(consume)
        await produce()
    await producer.aclose()
    await consumer.aclose()
    return {
        **{f"start_{k}": v for k, v in _percentiles(to_start).items()},
        **{f"ack_{k}": v for k, v in _percentiles(to_ack).items()},
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": at(1.0)}


# -- running and reporting ------------------------------------------------------------------


@attrs.define
class Result:
    scenario: str
    unit: str
    runs: list[float]
    sync: str = "full"
    peak_rss_mb: float | None = None
    mean_batch: float | None = None
    extra: dict[str, Any] = attrs.Factory(dict)

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")


async def measure(
    server: ServerProcess,
    name: str,
    unit: str,
    runs: int,
    run_once: Callable[[], Awaitable[float]],
    before_each: Callable[[], Awaitable[None]] | None = None,
    sync: str = "full",
) -> Result | None:
    """``runs`` runs of one scenario, or None where ``--scenarios`` leaves it out."""
    if not wanted(name):
        return None
    result = Result(name, unit, [], sync)
    sampler = RssSampler(server.pid)
    batches: list[float] = []
    costs: list[dict[str, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sampler.run)
        for _ in range(runs):
            if before_each is not None:
                await before_each()
            m0, c0 = await scrape_all(server.all_metrics), cpu_seconds(server.pids)
            d0 = server.database.sample() if server.database else {}
            with trio.fail_after(RUN_TIMEOUT_S):
                result.runs.append(await run_once())
            m1, c1 = await scrape_all(server.all_metrics), cpu_seconds(server.pids)
            d1 = server.database.sample() if server.database else {}
            count = m1.get("relay_store_batch_size_count", 0) - m0.get(
                "relay_store_batch_size_count", 0
            )
            if count:
                total = m1["relay_store_batch_size_sum"] - m0["relay_store_batch_size_sum"]
                batches.append(total / count)
            if unit == "jobs/s":
                costs.append(_costs(result.runs[-1], m0, m1, c1 - c0, d0, d1))
        nursery.cancel_scope.cancel()
    result.peak_rss_mb = sampler.peak
    result.mean_batch = statistics.mean(batches) if batches else None
    costs = [c for c in costs if c]
    if costs:
        result.extra |= {key: statistics.median(c[key] for c in costs) for key in costs[0]}
    return result


def _costs(
    rate: float, m0: dict[str, float], m1: dict[str, float], server_cpu_s: float,
    d0: dict[str, float], d1: dict[str, float],
) -> dict[str, float]:  # fmt: skip
    """What one run cost: CPU of the servers (and of the database), as a share of the
    run's time in cores and per job, and the database's transactions and rows per job.
    The jobs are what the servers counted (submitted or acked, whichever moved more); the
    run's time is jobs / rate, which leaves out connection and process start-up."""
    jobs = max(
        m1.get(name, 0) - m0.get(name, 0)
        for name in ("relay_jobs_submitted_total", "relay_jobs_acked_total")
    )
    if jobs <= 0 or rate <= 0:
        return {}
    seconds = jobs / rate
    costs = {
        "server_cpu_cores": server_cpu_s / seconds,
        "server_cpu_us_per_job": server_cpu_s / jobs * 1e6,
    }
    if d0:
        db_cpu_s = d1["cpu_s"] - d0["cpu_s"]
        costs |= {
            "db_cpu_cores": db_cpu_s / seconds,
            "db_cpu_us_per_job": db_cpu_s / jobs * 1e6,
            "db_xacts_per_job": (d1["xacts"] - d0["xacts"]) / jobs,
            "db_rows_written_per_job": (d1["rows_written"] - d0["rows_written"]) / jobs,
        }
    return costs


async def scrape_all(metrics: list[tuple[str, int]]) -> dict[str, float]:
    """``scrape`` of every server, summed."""
    total: dict[str, float] = {}
    for address in metrics:
        for name, value in (await scrape(address)).items():
            total[name] = total.get(name, 0) + value
    return total


@attrs.frozen
class Sizes:
    per_producer: int
    per_task: int
    pipelined: int
    batches: int
    backlog: int
    claims: int
    depths: tuple[int, ...]
    latency_s: float
    baseline_commits: int


FULL = Sizes(1000, 150, 40_000, 200, 40_000, 5_000, (1_000, 100_000, 1_000_000), 10.0, 400)
QUICK = Sizes(150, 16, 4_000, 20, 3_000, 1_000, (1_000, 20_000), 2.0, 50)


def commit_baseline_us(db_dir: str, commits: int) -> float:
    """The median time of a single-row transaction of SQLite alone (WAL, FULL), on the
    file system the benchmark's servers use: this disk's fsync, against which the
    one-at-a-time rows of a run can be read (it drifts on a shared VM)."""
    path = os.path.join(db_dir, f"baseline-{time.monotonic_ns()}.db")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        times = []
        for _ in range(commits):
            started = time.perf_counter()
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO t (v) VALUES (?)", ("x" * 100,))
            db.execute("COMMIT")
            times.append(time.perf_counter() - started)
    finally:
        db.close()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.remove(path + suffix)
    return statistics.median(times) * 1e6


async def submit_scenarios(server: ServerProcess, sizes: Sizes, runs: int, sync: str):
    a = server.addresses
    for producers in (1, 8, 32):
        yield await measure(
            server, f"submit, {producers} producer(s) one-at-a-time", "jobs/s", runs,
            lambda p=producers: submit_one_at_a_time(a, p, sizes.per_producer), sync=sync,
        )  # fmt: skip
    yield await measure(
        server, "submit, 1 connection pipelining (window 64)", "jobs/s", runs,
        lambda: submit_pipelined(a, 64, sizes.pipelined), sync=sync,
    )  # fmt: skip
    for clients in (1, 4):
        yield await measure(
            server, f"submit_batch of 100, {clients} client(s)", "jobs/s", runs,
            lambda c=clients: submit_batches(a, c, 100, sizes.batches), sync=sync,
        )  # fmt: skip
    for window in (None, 2.0):
        name = "relay.Client, 256 tasks one-at-a-time" + (
            "" if window is None else f", batch_window_ms {window:g}"
        )
        yield await measure(
            server, name, "jobs/s", runs,
            lambda w=window: submit_from_tasks(a, 256, sizes.per_task, w), sync=sync,
        )  # fmt: skip


async def tls_scenarios(server: ServerProcess, sizes: Sizes, runs: int, sync: str, tls: Tls | None):
    """The one-at-a-time and pipelined submits, over TLS when given ``tls`` (the server
    then has its certificate): ``--tls`` runs these against a plain server and a TLS one."""
    a, context = server.addresses, None if tls is None else tls.context
    over = "" if tls is None else ", TLS"
    for producers in (1, 8):
        yield await measure(
            server, f"submit, {producers} producer(s) one-at-a-time{over}", "jobs/s", runs,
            lambda p=producers: submit_one_at_a_time(a, p, sizes.per_producer, context),
            sync=sync,
        )  # fmt: skip
    yield await measure(
        server, f"submit, 1 connection pipelining (window 64){over}", "jobs/s", runs,
        lambda: submit_pipelined(a, 64, sizes.pipelined, context), sync=sync,
    )  # fmt: skip


async def consume_scenarios(server: ServerProcess, sizes: Sizes, runs: int):
    a = server.addresses
    yield await measure(
        server, "lease+ack, 8 processes, count 8, pipelined acks", "jobs/s", runs,
        lambda: lease_ack_processes(a, 8, 8, sizes.backlog),
        before_each=lambda: prefill(a, sizes.backlog),
    )  # fmt: skip
    yield await measure(
        server, "lease+ack, 8 processes, count 8, ack_batch", "jobs/s", runs,
        lambda: lease_ack_processes(a, 8, 8, sizes.backlog, batch_acks=True),
        before_each=lambda: prefill(a, sizes.backlog),
    )  # fmt: skip
    for concurrency in (1, 4, 16, 64):
        yield await measure(
            server, f"lease+ack, relay.Worker concurrency {concurrency}", "jobs/s", runs,
            lambda c=concurrency: lease_ack_worker(a, c, sizes.claims),
            before_each=lambda: prefill(a, sizes.claims),
        )  # fmt: skip


async def latency_scenario(server: ServerProcess, sizes: Sizes, runs: int, rate: float):
    lat = Result(f"end-to-end latency at {rate:,.0f} jobs/s offered", "ms", [])
    measured = [await latency(server.addresses, rate, sizes.latency_s) for _ in range(runs)]
    lat.extra = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
    lat.runs = [m["ack_p99_ms"] for m in measured]
    return lat


async def depth_scenario(server: ServerProcess, sizes: Sizes, runs: int, depth: int):
    a = server.addresses
    await prefill(a, depth)
    claims = min(sizes.claims, depth // 2)
    return await measure(
        server, f"lease+ack with {depth:,} ready jobs (raw, count 8)", "jobs/s", runs,
        lambda: _consume_rate(a, claims), before_each=lambda: prefill(a, claims),
    )  # fmt: skip


# The scenarios ``--scenarios`` selects (a name contains one of these), empty for all.
SCENARIO_FILTER: list[str] = []


def wanted(name: str) -> bool:
    return not SCENARIO_FILTER or any(part in name for part in SCENARIO_FILTER)


async def run_all(
    sizes: Sizes, runs: int, syncs: tuple[str, ...], address: str | None, db_dir: str,
    console: Console, tls: Tls | None = None, watchers: bool = False,
    target: Target = Target(),
) -> list[Result]:  # fmt: skip
    results: list[Result] = []

    def note(result: Result | None) -> None:
        if result is None:
            return
        results.append(result)
        extra = "".join(f", {k} {v:,}" for k, v in result.extra.items() if isinstance(v, int))
        console.print(
            f"{time.strftime('%H:%M:%S')} {result.scenario} [{result.sync}]: "
            f"{result.median:,.1f} {result.unit}{extra}",
            highlight=False, soft_wrap=True,
        )  # fmt: skip

    if watchers:
        from relay_scripts.bench_watchers import run_watchers

        await run_watchers(sizes, runs, db_dir, note)
        return results
    if tls is not None:
        for sync in syncs:
            for over in (None, tls):
                with running_server(sync, db_dir, over) as server:
                    async for result in tls_scenarios(server, sizes, runs, sync, over):
                        note(result)
        return results
    for sync in syncs:
        with _server(sync, address, db_dir, target) as server:
            async for result in submit_scenarios(server, sizes, runs, sync):
                note(result)
    with _server("full", address, db_dir, target) as server:
        async for result in consume_scenarios(server, sizes, runs):
            note(result)
    # Offered rates: the target's 2,000 jobs/s, and half the measured consumer maximum.
    top = next(
        (r.median for r in results if r.scenario.startswith("lease+ack, 8 processes")), 4000.0
    )
    for rate in sorted({2000.0, max(100.0, round(top / 2, -2))}):
        if wanted(f"end-to-end latency at {rate:,.0f} jobs/s offered"):
            with _server("full", address, db_dir, target) as server:
                note(await latency_scenario(server, sizes, runs, rate))
    for depth in sizes.depths:
        if wanted(f"lease+ack with {depth:,} ready jobs (raw, count 8)"):
            with _server("full", address, db_dir, target) as server:
                note(await depth_scenario(server, sizes, runs, depth))
    return results


async def _consume_rate(addresses, total: int) -> float:
    started = time.perf_counter()
    done = await consume_raw(addresses[0], total, 8)
    return done / (time.perf_counter() - started)


@contextmanager
def _server(
    sync: str, address: str | None, db_dir: str, target: Target = Target()
) -> Iterator[ServerProcess]:
    if address is not None:
        host, port = address.rsplit(":", 1)
        yield ServerProcess(None, (host, int(port)), None)
    else:
        with running_server(sync, db_dir, target=target) as server:
            yield server


def render(results: list[Result], console: Console) -> None:
    table = Table(title="relay-bench (medians; min-max across runs)")
    for column in ("scenario", "sync", "median", "min-max", "unit", "peak RSS MB", "batch"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for r in results:
        digits = 1 if r.unit == "ms" else 0
        spread = f"{min(r.runs):,.{digits}f}-{max(r.runs):,.{digits}f}" if len(r.runs) > 1 else "-"
        if r.unit == "ms":
            table.add_row(r.scenario, r.sync, f"{r.median:.1f}", spread, "p99 ms", "-", "-")
            continue
        table.add_row(
            r.scenario, r.sync, f"{r.median:,.0f}", spread, r.unit,
            "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}",
            "-" if r.mean_batch is None else f"{r.mean_batch:.1f}",
        )  # fmt: skip
    console.print(table)
    latencies = [r for r in results if r.unit == "ms"]
    if latencies:
        console.print(_latency_table(latencies))
    costs = [r for r in results if "server_cpu_us_per_job" in r.extra]
    if costs:
        console.print(_cost_table(costs))


COST_COLUMNS = {
    "server_cpu_cores": ("servers' CPU, cores", "{:.2f}"),
    "server_cpu_us_per_job": ("servers' CPU us/job", "{:.0f}"),
    "db_cpu_cores": ("db CPU, cores", "{:.2f}"),
    "db_cpu_us_per_job": ("db CPU us/job", "{:.0f}"),
    "db_xacts_per_job": ("db commits/job", "{:.3f}"),
    "db_rows_written_per_job": ("db rows written/job", "{:.1f}"),
}


def _cost_table(results: list[Result]) -> Table:
    """What each job cost (medians across runs): CPU of the servers and of the database,
    and the database's commits and rows written per job."""
    table = Table(title="cost per job (medians across runs)")
    table.add_column("scenario", justify="left")
    for title, _ in COST_COLUMNS.values():
        table.add_column(title, justify="right")
    for r in results:
        cells = [
            fmt.format(r.extra[key]) if key in r.extra else "-"
            for key, (_, fmt) in COST_COLUMNS.items()
        ]
        table.add_row(r.scenario, *cells)
    return table


def _latency_table(latencies: list[Result]) -> Table:
    """Each latency scenario's percentiles (medians across runs), to the handler's start
    and to the committed ack."""
    table = Table(title="end-to-end latency, ms (submit sent -> handler start / ack committed)")
    table.add_column("offered", justify="left")
    for stage in ("start", "ack"):
        for q in ("p50", "p90", "p99", "max"):
            table.add_column(f"{stage} {q}", justify="right")
    for r in latencies:
        rate = r.scenario.removeprefix("end-to-end latency at ")
        cells = [
            f"{r.extra[f'{stage}_{q}_ms']:.1f}"
            for stage in ("start", "ack")
            for q in ("p50", "p90", "p99", "max")
        ]
        table.add_row(rate, *cells)
    return table


@click.command()
@click.option("--quick", is_flag=True, help="Reduced sizes, one run each: under 30 s.")
@click.option(
    "--runs",
    type=click.IntRange(1, 20),
    default=None,
    help="Runs of each scenario  [default: 3; 1 with --quick]",
)
@click.option(
    "--sync",
    "sync_modes",
    type=click.Choice(["full", "normal", "both"]),
    default="both",
    show_default=True,
    help="Server synchronous mode; 'both' adds NORMAL for the submit scenarios.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the results as JSON here.",
)
@click.option("--address", default=None, help="Target a running server instead.")
@click.option(
    "--tls",
    is_flag=True,
    help="Only the one-at-a-time and pipelined submits, against a plain server and a TLS "
    "one (a self-signed certificate made with the openssl command).",
)
@click.option(
    "--watchers",
    is_flag=True,
    help="Only submit and lease+ack, each with no watcher, an idle one and one of every "
    "event, interleaved on one server (FULL).",
)
@click.option(
    "--db",
    "pg_admin_url",
    default=None,
    help="A PostgreSQL URL (postgresql://USER@HOST:PORT/DBNAME) of an existing database: "
    "each group of scenarios runs on a fresh database created through it and dropped after.",
)
@click.option(
    "--servers",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="With --db: servers on the one database; connections go round-robin over them.",
)
@click.option(
    "--scenarios",
    "scenario_filter",
    multiple=True,
    help="Only the scenarios whose name contains this (repeatable).",
)
def main(quick: bool, runs: int | None, sync_modes: str, json_path: str | None,
         address: str | None, tls: bool, watchers: bool, pg_admin_url: str | None,
         servers: int, scenario_filter: tuple[str, ...]) -> None:  # fmt: skip
    """Measure a relay-trio server: submit, lease+ack, latency, claim cost, memory."""
    if pg_admin_url is not None and (address is not None or tls or watchers):
        raise click.UsageError("--db starts its own servers: not with --address, --tls, --watchers")
    if servers > 1 and pg_admin_url is None:
        raise click.UsageError("--servers N needs --db: servers share a PostgreSQL database")
    SCENARIO_FILTER[:] = scenario_filter
    target = Target(pg_admin_url, servers)
    for flag, given in (("--tls", tls), ("--watchers", watchers)):
        if given and address is not None:
            raise click.UsageError(f"{flag} starts its own servers: it does not take --address")
    if tls and watchers:
        raise click.UsageError("--tls and --watchers are separate runs")
    if runs is None:
        runs = 1 if quick else 3
    # Not a terminal (a file, a CI log): wide enough that no scenario name wraps.
    console = Console(width=None if sys.stdout.isatty() else 120)
    syncs = ("full", "normal") if sync_modes == "both" else (sync_modes,)
    if pg_admin_url is not None:
        # --synchronous is SQLite's; PostgreSQL commits as the database is configured
        # (synchronous_commit on by default: every ok reply is on disk, as with FULL).
        syncs = ("full",)
    sizes = QUICK if quick else FULL
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as db_dir:
        before = commit_baseline_us(db_dir, sizes.baseline_commits)
        certificate = make_tls(db_dir) if tls else None
        results = trio.run(
            run_all,
            sizes,
            runs,
            syncs,
            address,
            db_dir,
            console,
            certificate,
            watchers,
            target,
        )
        after = commit_baseline_us(db_dir, sizes.baseline_commits)
    render(results, console)
    console.print(f"{len(results)} scenarios in {time.monotonic() - started:.0f} s; "
                  f"machine: {os.cpu_count()} cpus; a single-row FULL commit of SQLite "
                  f"alone here: {before:.0f} us before, {after:.0f} us after")  # fmt: skip
    if json_path:
        Path(json_path).write_bytes(orjson.dumps({
            "machine": {
                "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "sqlite_commit_us": {"before": before, "after": after},
            },
            "quick": quick, "runs": runs,
            "results": [attrs.asdict(r) | {"median": r.median} for r in results],
        }, option=orjson.OPT_INDENT_2))  # fmt: skip


def _consume_main(address: str, per: str, count: str, acks: str) -> None:
    """A consumer process: connect, say ready, wait for go, consume, print how many."""
    host, port = address.rsplit(":", 1)

    async def run() -> int:
        conn = await Conn.open((host, int(port)))
        await conn.call("ping")
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        await conn.aclose()
        return await consume_raw(
            (host, int(port)), int(per), int(count), batch_acks=acks == "batch"
        )

    print(trio.run(run), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_consume":
        _consume_main(*sys.argv[2:6])
    else:
        main()
