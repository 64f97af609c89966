"""What each scenario does to the server: the load generators. Each returns its rate
(jobs/s) or, for latency, its percentiles; the clock covers the load alone, not the
connections' or processes' start-up."""

from __future__ import annotations

import math
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from relay_scripts.bench.conn import Conn
from relay_scripts.bench.consumer import consume_raw
from relay_scripts.bench.servers import pick


def _payload(i: int) -> dict[str, Any]:
    return {"n": i, "kind": "bench"}


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


async def lease_ack_processes(
    addresses, processes: int, count: int, total: int, batch_acks: bool = False
) -> float:
    """``processes`` consumer processes, each leasing ``count`` per request. The clock
    starts when all of them are connected and told to go: process start-up (~1 s of
    imports on a small VM) is not part of the rate."""
    per = math.ceil(total / processes)

    def args(i: int) -> list[str]:
        host, port = pick(addresses, i)
        # -P: the current directory's modules are not imported in place of the package's.
        return [sys.executable, "-P", "-m", "relay_scripts.bench.consumer", f"{host}:{port}",
                str(per), str(count), "batch" if batch_acks else "each"]  # fmt: skip

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


async def consume_rate(addresses, total: int) -> float:
    """Lease and ack ``total`` jobs on one raw connection (count 8); the rate."""
    started = time.perf_counter()
    done = await consume_raw(addresses[0], total, 8)
    return done / (time.perf_counter() - started)


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
