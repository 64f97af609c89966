"""What a queue's settings cost a claim: ``python -m relay_scripts.bench_claims``.

The store's claim alone, no server: ``jobs_claim`` inside a transaction that is rolled
back after it, so every claim sees the same ready jobs (20,000 in each of 4 queues). The
variants are the claimed queue with no settings, with a concurrency limit, with a rate
limit, and with both (each limit far above what the claims take, so the claim is never
held back: what is measured is the bookkeeping); a claim of one queue for one job and one
of four queues for eight jobs. Rounds interleave the variants; prints the median of each
in microseconds, one JSON line per store. Used for docs/benchmarking.md.

    python -m relay_scripts.bench_claims [--db postgresql://...] [--rounds 5 --claims 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from relay.protocol.model import Rate, SubmitSpec
from relay.store.base import Store

QUEUES = ("b0", "b1", "b2", "b3")
JOBS_PER_QUEUE = 20_000
T0 = 1_800_000_000_000
NONE = dict.fromkeys(("max_leased", "rate"), None)
VARIANTS = {
    "none": NONE,
    "max_leased": {**NONE, "max_leased": 1_000_000},
    "rate": {**NONE, "rate": Rate(1_000_000, 1_000)},
    "both": {"max_leased": 1_000_000, "rate": Rate(1_000_000, 1_000)},
}
CLAIMS = {"1 queue, 1 job": (QUEUES[:1], 1), "4 queues, 8 jobs": (QUEUES, 8)}


def open_store(db: str | None, directory: str) -> Store:
    if db is None:
        from relay.store.sqlite import SqliteStore

        return SqliteStore.open(str(Path(directory) / "bench.db"))
    from relay.store.postgres import PostgresStore

    return PostgresStore.open(db)


def fill(store: Store) -> None:
    for queue in QUEUES:
        for start in range(0, JOBS_PER_QUEUE, 1_000):
            specs = [SubmitSpec(queue, f'{{"n": {n}}}') for n in range(start, start + 1_000)]
            store.jobs_submit(specs, T0)


def time_claims(store: Store, queues: tuple[str, ...], count: int, claims: int) -> float:
    """Microseconds per claim, each in a transaction rolled back."""
    started = time.perf_counter()
    for i in range(claims):
        store.begin()
        store.jobs_claim(queues, "bench", count, 60_000, T0 + 1 + i)
        store.rollback()
    return (time.perf_counter() - started) / claims * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a PostgreSQL URL (default: a fresh SQLite file)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--claims", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        store = open_store(args.db, directory)
        try:
            fill(store)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for variant, settings in VARIANTS.items():
                    for queue in QUEUES:
                        store.queue_config(queue, settings, T0)
                    for name, (queues, count) in CLAIMS.items():
                        key = f"{name} | {variant}"
                        times.setdefault(key, []).append(
                            time_claims(store, queues, count, args.claims)
                        )
            medians = {key: round(statistics.median(v), 1) for key, v in times.items()}
            print(json.dumps({"store": "postgresql" if args.db else "sqlite", "us": medians}))
        finally:
            for queue in QUEUES:
                store.queue_config(queue, NONE, T0)
            store.close()


if __name__ == "__main__":
    main()
