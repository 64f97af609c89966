"""The scenarios of a run, in groups that share a server, and their sizes (FULL, or QUICK
for ``--quick``): each named, measured with ``measure`` and yielded as it completes."""

from __future__ import annotations

import statistics

import attrs

from relay_scripts.bench.loads import (
    consume_rate,
    latency,
    lease_ack_processes,
    lease_ack_worker,
    prefill,
    submit_batches,
    submit_from_tasks,
    submit_one_at_a_time,
    submit_pipelined,
)
from relay_scripts.bench.measure import measure
from relay_scripts.bench.results import Result
from relay_scripts.bench.servers import ServerProcess, Tls


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
        lambda: consume_rate(a, claims), before_each=lambda: prefill(a, claims),
    )  # fmt: skip
