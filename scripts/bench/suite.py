"""Which scenarios a run takes, on which servers, in which order: the submit scenarios in
each synchronous mode, the consumers, latency at two offered rates, claims at depth; or,
with ``--tls`` or ``--watchers``, their runs alone. Each result is shown as it comes."""

from __future__ import annotations

from rich.console import Console

from relay_scripts.bench.measure import wanted
from relay_scripts.bench.report import progress
from relay_scripts.bench.results import Result
from relay_scripts.bench.scenarios import (
    Sizes,
    consume_scenarios,
    depth_scenario,
    latency_scenario,
    submit_scenarios,
    tls_scenarios,
)
from relay_scripts.bench.servers import SQLITE, Target, Tls, running_server, server_at
from relay_scripts.bench.watchers import run_watchers


async def run_all(
    sizes: Sizes, runs: int, syncs: tuple[str, ...], address: str | None, db_dir: str,
    console: Console, tls: Tls | None = None, watchers: bool = False,
    target: Target = SQLITE,
) -> list[Result]:  # fmt: skip
    results: list[Result] = []

    def note(result: Result | None) -> None:
        if result is None:
            return
        results.append(result)
        progress(console, result)

    if watchers:
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
        with server_at(sync, address, db_dir, target) as server:
            async for result in submit_scenarios(server, sizes, runs, sync):
                note(result)
    with server_at("full", address, db_dir, target) as server:
        async for result in consume_scenarios(server, sizes, runs):
            note(result)
    # Offered rates: the target's 2,000 jobs/s, and half the measured consumer maximum.
    top = next(
        (r.median for r in results if r.scenario.startswith("lease+ack, 8 processes")), 4000.0
    )
    for rate in sorted({2000.0, max(100.0, round(top / 2, -2))}):
        if wanted(f"end-to-end latency at {rate:,.0f} jobs/s offered"):
            with server_at("full", address, db_dir, target) as server:
                note(await latency_scenario(server, sizes, runs, rate))
    for depth in sizes.depths:
        if wanted(f"lease+ack with {depth:,} ready jobs (raw, count 8)"):
            with server_at("full", address, db_dir, target) as server:
                note(await depth_scenario(server, sizes, runs, depth))
    return results
