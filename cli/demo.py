"""The demo executor (the default handler of ``relay-trio worker``) and ``relay-trio demo``.

The executor does what the payload says, so a queue can be exercised without writing a
handler:

- ``{"sleep_ms": N}``: sleep N ms first (any payload may have it);
- ``{"fail": true, "error": "..."}``: raise with that error: a retryable failure, or
  ``PermanentError`` (dead at once) with ``"retryable": false`` as well;
- ``{"fail_attempts": N, "error": "..."}``: fail the first N attempts, then succeed;
- anything else succeeds, with ``{"attempt": n, "slept_ms": ms}`` as the result.

``run_demo`` runs an embedded queue (``relay.open_local``) with one worker on it in this
process, submits a mix of those jobs and shows them move through the states.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import attrs
import trio
from rich.console import Console

from relay import Client, DeadPage, LeasedJob, PermanentError, Stats, Worker, job_fields, open_local
from relay_cli import views
from relay_cli.ids import server_short_ids

DEMO_WORKER_ID = "relay-trio-demo"
# Enough slots that the slow jobs (100-800 ms each) do not hold up the rest.
DEMO_CONCURRENCY = 8
DEMO_POLL_S = 0.1  # how often the progress bars ask for stats
DEMO_TIMEOUT_S = 60.0
# Jobs that fail into retries wait this long between attempts: long enough to be seen in
# the "retrying" bar, short enough that the demo ends within a few seconds.
DEMO_BACKOFF = {"kind": "fixed", "delay_ms": 300}
DEMO_DEAD_ROWS = 20
SUBMIT_CHUNK = 500  # below the server's max_batch (1000)
PRIORITIES = ("low", "normal", "high", "critical")
DEMO_QUEUES = ("email", "thumbnails", "reports", "payments", "webhooks")


class DemoFailure(Exception):
    """What the demo executor raises for a payload that asks to fail."""


def _number(value: Any) -> int | float:
    """A non-negative number from the payload; 0 for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, value)


async def demo_handler(job: LeasedJob) -> Any:
    """Run ``job`` as its payload says (see the module docstring)."""
    payload = job.payload if isinstance(job.payload, dict) else {}
    sleep_ms = _number(payload.get("sleep_ms"))
    if sleep_ms:
        await trio.sleep(sleep_ms / 1000)
    error = str(payload.get("error") or "the payload asked to fail")
    if payload.get("fail") or job.attempt <= _number(payload.get("fail_attempts")):
        if payload.get("retryable") is False:
            raise PermanentError(error)
        raise DemoFailure(error)
    return {"attempt": job.attempt, "slept_ms": sleep_ms}


# -- the demo's jobs ----------------------------------------------------------------------

# (kind, share of the jobs). The quick jobs take what the rounding leaves.
MIX = (
    ("slow", 0.20),
    ("delayed", 0.20),
    ("flaky", 0.10),  # fails its first attempt, succeeds on the retry
    ("doomed", 0.08),  # fails every attempt: dead after its one retry
    ("rejected", 0.07),  # fails with no retries: dead at once
)
ERRORS = ("card declined", "gateway timeout", "insufficient funds", "upstream 503")


def demo_counts(jobs: int) -> dict[str, int]:
    counts = {kind: int(jobs * share) for kind, share in MIX}
    return {"quick": jobs - sum(counts.values()), **counts}


def demo_jobs(jobs: int, rng: random.Random) -> list[dict[str, Any]]:
    """``jobs`` submit requests (``job_fields``): quick, slow, delayed, flaky and failing
    jobs on a few queues, every priority among them, shuffled."""
    out: list[dict[str, Any]] = []
    n = 0
    for kind, count in demo_counts(jobs).items():
        for _ in range(count):
            n += 1
            priority = PRIORITIES[n % len(PRIORITIES)]
            out.append(_job(kind, n, priority, rng))
    rng.shuffle(out)
    return out


def _job(kind: str, n: int, priority: str, rng: random.Random) -> dict[str, Any]:
    error = rng.choice(ERRORS)
    if kind == "quick":
        return job_fields("email", {"to": f"user{n}@example.com"}, priority=priority)
    if kind == "slow":
        payload = {"image": f"photo{n}.jpg", "sleep_ms": rng.randint(100, 800)}
        return job_fields("thumbnails", payload, priority=priority)
    if kind == "delayed":
        return job_fields("reports", {"report": n, "sleep_ms": 50}, priority=priority,
                          delay_ms=rng.randint(500, 2000))  # fmt: skip
    if kind == "flaky":
        payload = {"order": n, "fail_attempts": 1, "error": error}
        return job_fields("payments", payload, priority=priority, retries=2,
                          backoff=DEMO_BACKOFF)  # fmt: skip
    if kind == "doomed":
        payload = {"order": n, "fail": True, "error": error}
        return job_fields("payments", payload, priority=priority, retries=1,
                          backoff=DEMO_BACKOFF)  # fmt: skip
    payload = {"hook": n, "fail": True, "error": "endpoint answered 410 Gone"}
    return job_fields("webhooks", payload, priority=priority, retries=0)


def _chunks(items: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- the demo run -------------------------------------------------------------------------


@attrs.frozen
class DemoOutcome:
    stats: Stats
    dead: DeadPage
    short: dict[str, str]  # the dead jobs' ids as the queue abbreviates them (views.short_ids)
    finished: bool  # False: the timeout passed with jobs unfinished
    seconds: float


async def run_demo(
    console: Console,
    db: str,
    jobs: int,
    *,
    concurrency: int = DEMO_CONCURRENCY,
    timeout_s: float = DEMO_TIMEOUT_S,
    seed: int | None = None,
) -> DemoOutcome:
    """Submit ``jobs`` demo jobs to an embedded queue on ``db``, work them off with one
    worker in this process, and show progress on ``console`` until none is pending, ready,
    leased or retrying (or ``timeout_s`` passes).

    Owns the embedded queue (its services and writer thread) and the worker's tasks; all
    are stopped before this returns.
    """
    rng = random.Random(seed)
    started = time.monotonic()
    async with open_local(db) as client:
        worker = Worker(
            client, queues=list(DEMO_QUEUES), handler=demo_handler, concurrency=concurrency,
            worker_id=DEMO_WORKER_ID,
        )  # fmt: skip
        finished = False
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            try:
                for chunk in _chunks(demo_jobs(jobs, rng), SUBMIT_CHUNK):
                    await client.submit_batch(chunk)
                finished = await _watch(console, client, timeout_s)
            finally:
                worker.stop()
                if not finished:
                    worker.stop()  # the second stop cancels running jobs at once
        stats = await client.stats()
        dead = await client.dead_list(limit=DEMO_DEAD_ROWS)
        short = await server_short_ids(client, [job.job_id for job in dead.jobs]) or {}
    return DemoOutcome(stats, dead, short, finished, time.monotonic() - started)


async def _watch(console: Console, client: Client, timeout_s: float) -> bool:
    """Poll stats into the progress bars until every job is finished; False on timeout."""
    progress, tasks = views.state_progress(console)
    with progress, trio.move_on_after(timeout_s):
        while True:
            stats = _demo_only(await client.stats())
            views.update_state_progress(progress, tasks, stats)
            if views.unfinished(stats) == 0:
                return True
            await trio.sleep(DEMO_POLL_S)
    return False


def _demo_only(stats: Stats) -> Stats:
    """The demo's queues only: a --db that other queues share must not hold the demo up."""
    queues = {name: counts for name, counts in stats.queues.items() if name in DEMO_QUEUES}
    return attrs.evolve(stats, queues=queues)
