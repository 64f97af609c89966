"""What a page of the job browser costs at a million jobs: ``python -m
relay_scripts.bench_browse``. The store alone, no server: 1,000,000 jobs in 4 queues (the
first queue's with idempotency keys), their states then set by SQL as a busy server's
are (88 % succeeded, 5 % dead, 2 % cancelled, 2 % pending, 1 % retrying, 2 % ready), and
the counts rebuilt. Then ``jobs_list`` pages of 50, each in a transaction rolled back,
and ``dead_list`` beside them for comparison; prints the median of each in microseconds,
one JSON line per store. Used for docs/benchmarking.md.

    python -m relay_scripts.bench_browse [--db postgresql://.../its_own_db] [--jobs 1000000]
    python -m relay_scripts.bench_browse [--db ...] --queues 10000 --reps 5

With --db, it fills that database and empties its jobs at the end: give it one of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.protocol.model import SubmitSpec, format_job_id
from relay.store import rows
from relay.store.base import Store

QUEUES = ("b0", "b1", "b2", "b3")
T0 = 1_800_000_000_000
EVERY = ("pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled")
# Each job's state by its id modulo 100.
STATES_SQL = (
    "UPDATE jobs SET state = CASE WHEN id % 100 < 88 THEN 'succeeded' "
    "WHEN id % 100 < 93 THEN 'dead' WHEN id % 100 < 95 THEN 'cancelled' "
    "WHEN id % 100 < 97 THEN 'pending' WHEN id % 100 < 98 THEN 'retrying' ELSE 'ready' END, "
    "finished_at = CASE WHEN id % 100 < 95 THEN created_at END, "
    "run_at = CASE WHEN id % 100 >= 95 AND id % 100 < 98 THEN created_at + 86400000 END"
)
RECOUNT_PG = (
    "DELETE FROM job_counts",
    "INSERT INTO job_counts (slot, queue, state, n) "
    "SELECT 0, queue, state, count(*) FROM jobs GROUP BY queue, state",
)


def open_store(db: str | None, directory: str) -> Store:
    if db is None:
        from relay.store.sqlite import SqliteStore

        return SqliteStore.open(str(Path(directory) / "bench.db"))
    from relay.store.postgres import PostgresStore

    return PostgresStore.open(db)


def fill(store: Store, db: str | None, directory: str, jobs: int) -> Store:
    """``jobs`` jobs submitted, then their states set; the store reopened on them."""
    per_queue = jobs // len(QUEUES)
    for queue in QUEUES:
        for start in range(0, per_queue, 1_000):
            specs = [
                SubmitSpec(
                    queue,
                    f'{{"n": {n}}}',
                    idempotency_key=f"order-{n}" if queue == "b0" else None,
                )
                for n in range(start, min(start + 1_000, per_queue))
            ]
            store.jobs_submit(specs, T0 + start)
    store.begin()
    store._db.execute(STATES_SQL)
    for statement in RECOUNT_PG if db is not None else ():
        store._db.execute(statement)
    store.commit()
    store.close()
    return open_store(db, directory)


def timed(store: Store, call: Callable[[], Any], reps: int) -> float:
    """Median microseconds of ``call``, each in a transaction rolled back."""
    times = []
    for _ in range(reps):
        store.begin()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        store.rollback()
    return round(statistics.median(times) * 1e6)


def by_id(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with no (queue, state) runs merged: the page is read by id."""

    def forced() -> Any:
        merged = rows.MERGED_RUNS_MAX
        rows.MERGED_RUNS_MAX = 0
        try:
            return call()
        finally:
            rows.MERGED_RUNS_MAX = merged

    return forced


def many_queues(store: Store, queues: int, reps: int) -> dict[str, int]:
    """``--queues N``: N queues of one ready and one delayed job each; the median of a
    page of 50 of every queue, in some states."""
    for start in range(0, queues, 1_000):
        names = [f"q{i:05d}" for i in range(start, min(queues, start + 1_000))]
        store.jobs_submit([SubmitSpec(q, "{}") for q in names], T0)
        store.jobs_submit([SubmitSpec(q, "{}", delay_ms=10**9) for q in names], T0 + 1)
    cases = {
        "every state": EVERY,
        "ready": ("ready",),
        "ready, pending": ("ready", "pending"),
        "dead (none)": ("dead",),
        "leased (none)": ("leased",),
    }
    return {
        name: timed(
            store, lambda states=states: store.jobs_list(None, states, None, None, 50), reps
        )
        for name, states in cases.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a PostgreSQL URL (default: a fresh SQLite file)")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--queues", type=int, help="instead: pages of every queue at this many")
    args = parser.parse_args()
    if args.queues:
        with tempfile.TemporaryDirectory() as directory:
            store = open_store(args.db, directory)
            try:
                us = many_queues(store, args.queues, args.reps)
                store_name = "postgresql" if args.db else "sqlite"
                print(json.dumps({"store": store_name, "queues": args.queues, "us": us}))
            finally:
                if args.db is not None:
                    for statement in ("DELETE FROM jobs", "DELETE FROM job_counts"):
                        store._db.execute(statement)
                store.close()
        return
    with tempfile.TemporaryDirectory() as directory:
        store = open_store(args.db, directory)
        try:
            started = time.perf_counter()
            store = fill(store, args.db, directory, args.jobs)
            fill_s = round(time.perf_counter() - started)
            middle = format_job_id(
                store._db.execute("SELECT id FROM jobs WHERE queue = 'b1' ORDER BY id LIMIT 1 "
                                  f"OFFSET {args.jobs // 8}").fetchone()[0]
            )  # fmt: skip
            prefix = middle[:11]  # ids of ~8 ms
            cases: dict[str, Callable[[], Any]] = {
                "b1 succeeded": lambda: store.jobs_list("b1", ["succeeded"], None, None, 50),
                "b1 dead": lambda: store.jobs_list("b1", ["dead"], None, None, 50),
                "b1 ready": lambda: store.jobs_list("b1", ["ready"], None, None, 50),
                "b1 every state": lambda: store.jobs_list("b1", EVERY, None, None, 50),
                "b1 every state, mid-way": lambda: store.jobs_list("b1", EVERY, None, middle, 50),
                "b1 dead, oldest": lambda: store.jobs_list("b1", ["dead"], None, None, 50, False),
                "all queues, every state": lambda: store.jobs_list(None, EVERY, None, None, 50),
                "all queues, dead": lambda: store.jobs_list(None, ["dead"], None, None, 50),
                "search id prefix": lambda: store.jobs_list(None, EVERY, prefix, None, 50),
                "search key prefix": lambda: store.jobs_list("b0", EVERY, "order-1234", None, 50),
                "dead_list b1 (compare)": lambda: store.dead_list("b1", 50, None, None, True),
                # The read by id (as past MERGED_RUNS_MAX pairs), and a search's at its
                # most: 10,000 jobs examined for a page that finds none.
                "all queues by id, every state": by_id(
                    lambda: store.jobs_list(None, EVERY, None, None, 50)
                ),
                "all queues by id, ready": by_id(
                    lambda: store.jobs_list(None, ["ready"], None, None, 50)
                ),
                "all queues by id, retrying": by_id(
                    lambda: store.jobs_list(None, ["retrying"], None, None, 50)
                ),
                "search id prefix, leased (none)": lambda: store.jobs_list(
                    None, ["leased"], prefix, None, 50
                ),
            }
            for name, call in cases.items():
                assert call()[0] or "(none)" in name, "an empty page measures nothing"
            medians = {name: timed(store, call, args.reps) for name, call in cases.items()}
            print(json.dumps({"store": "postgresql" if args.db else "sqlite", "jobs": args.jobs,
                              "fill_s": fill_s, "us": medians}))  # fmt: skip
        finally:
            if args.db is not None:
                for statement in ("DELETE FROM jobs", "DELETE FROM job_counts"):
                    store._db.execute(statement)
            store.close()


if __name__ == "__main__":
    main()
