"""What the job browser's index (``jobs_queue_state``) costs the hot path: ``python -m
relay_scripts.bench_index``. Two SQLite stores, one with the index and one without (it
is dropped after open), each holding 200,000 succeeded jobs; rounds interleave them, and
each round runs a job's life, one transaction per step as the server's writer commits
them alone (submit, claim, ack), for ``--jobs`` jobs. Prints the median microseconds of
each step per job, one JSON line. ``--synchronous normal`` (the default here) leaves out
the fsync per commit, so that the index's own cost is what differs (``full``, the
server's default, adds the same fsync to both). Used for docs/benchmarking.md.

    python -m relay_scripts.bench_index [--rounds 7 --jobs 2000 --synchronous normal]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from relay.protocol.model import SubmitSpec
from relay.store.sqlite import SqliteStore

T0 = 1_800_000_000_000
BACKGROUND = 200_000


def open_store(directory: str, name: str, synchronous: str, index: bool) -> SqliteStore:
    store = SqliteStore.open(str(Path(directory) / f"{name}.db"), synchronous=synchronous)
    if not index:
        store._db.execute("DROP INDEX jobs_queue_state")
    for start in range(0, BACKGROUND, 1_000):
        specs = [SubmitSpec("old", "{}") for _ in range(1_000)]
        store.jobs_submit(specs, T0 + start)
    store.begin()
    store._db.execute("UPDATE jobs SET state = 'succeeded', finished_at = created_at")
    store.commit()
    store.close()
    store = SqliteStore.open(str(Path(directory) / f"{name}.db"), synchronous=synchronous)
    if not index:
        store._db.execute("DROP INDEX IF EXISTS jobs_queue_state")
    return store


def one_round(store: SqliteStore, jobs: int, now: int) -> dict[str, float]:
    """Microseconds per job of each step, each job's step its own transaction."""
    times = {}
    started = time.perf_counter()
    for i in range(jobs):
        store.begin()
        store.jobs_submit([SubmitSpec("q", '{"n": 1}')], now + i)
        store.commit()
    times["submit"] = time.perf_counter() - started
    leases = []
    started = time.perf_counter()
    for i in range(jobs):
        store.begin()
        leases += store.jobs_claim(["q"], "w", 1, 60_000, now + jobs + i)
        store.commit()
    times["claim"] = time.perf_counter() - started
    started = time.perf_counter()
    for i, lease in enumerate(leases):
        store.begin()
        store.jobs_ack(lease.job_id, "w", lease.token, None, now + 2 * jobs + i)
        store.commit()
    times["ack"] = time.perf_counter() - started
    return {step: seconds / jobs * 1e6 for step, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=2_000)
    parser.add_argument("--synchronous", default="normal", choices=("normal", "full"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        stores = {
            "with index": open_store(directory, "with", args.synchronous, True),
            "without": open_store(directory, "without", args.synchronous, False),
        }
        try:
            runs: dict[str, dict[str, list[float]]] = {name: {} for name in stores}
            for r in range(args.rounds):
                order = list(stores.items())
                for name, store in order if r % 2 else order[::-1]:  # (each first in turn)
                    now = T0 + BACKGROUND + (r + 1) * 10 * args.jobs
                    for step, us in one_round(store, args.jobs, now).items():
                        runs[name].setdefault(step, []).append(us)
            medians = {
                name: {step: round(statistics.median(v), 1) for step, v in steps.items()}
                for name, steps in runs.items()
            }
            print(json.dumps({"synchronous": args.synchronous, "us_per_job": medians}))
        finally:
            for store in stores.values():
                store.close()


if __name__ == "__main__":
    main()
