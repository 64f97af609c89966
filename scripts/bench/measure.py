"""One scenario's runs, each timed and bounded, with what they cost: the server's peak
memory, the writer's mean batch, and the CPU (and database work) per job."""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable

import trio

from relay_scripts.bench.results import Result
from relay_scripts.bench.sampling import RssSampler, cpu_seconds, scrape_all
from relay_scripts.bench.servers import ServerProcess

# Every scenario run is bounded: a hung server fails the bench instead of hanging it.
RUN_TIMEOUT_S = 300.0

# The scenarios ``--scenarios`` selects (a name contains one of these), empty for all.
SCENARIO_FILTER: list[str] = []


def wanted(name: str) -> bool:
    return not SCENARIO_FILTER or any(part in name for part in SCENARIO_FILTER)


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
