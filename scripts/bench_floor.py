"""How fast PostgreSQL could go at all, next to the stores: ``python -m
relay_scripts.bench_floor --db postgresql://...``.

Three ways to run the same transaction, the store alone (no server, no writer thread),
rounds interleaving them:

- ``sqlite``: SqliteStore (FULL), the whole transaction as the writer runs it;
- ``postgres``: PostgresStore, the same;
- ``floor``: the least PostgreSQL can be asked for the same rows: one prepared statement,
  one round trip, its own commit (autocommit), no queue settings, counts, history or
  notifications, one token for every lease. Nothing the store does can make its
  transaction faster than this, on this machine and this database.

Transactions: ``submit N``, N jobs created (the drawn-id insert: ids from the
sequence); ``lease+ack N``, the N jobs claimed by the previous transaction acked and N
more claimed (``FOR UPDATE SKIP LOCKED``, as several servers need), from a backlog of
``--backlog`` ready jobs, analyzed. Prints per transaction the median wall time and
PostgreSQL's CPU (its backends', from ``/proc``) in microseconds, one JSON line. Used for
docs/benchmarking.md.

    python -m relay_scripts.bench_floor --db postgresql://... [--rounds 5 --seconds 2]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from relay.protocol.model import SubmitSpec
from relay.store.base import Store
from relay.store.postgres import PostgresStore
from relay.store.sqlite import SqliteStore
from relay_scripts.bench.postgres import PgDatabase
from relay_scripts.bench.sampling import cpu_seconds

T0 = 1_800_000_000_000
PAYLOAD = '{"n": 1}'

# The columns a submit fills and a claim and an ack change, with constants for the
# settings a store would read from the queue's.
_INSERT = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at) "
    "SELECT nextval('job_ids'), 'floor', 'ready', 0, p, 0, 3, 'fixed', 1000, 1000, false, "
    "%(now)s, %(now)s FROM unnest(%(payloads)s::text[]) AS p"
)
_LEASE_ACK = (
    "WITH acked AS (UPDATE jobs SET state = 'succeeded', finished_at = %(now)s, "
    "lease_expires_at = NULL WHERE id = ANY(%(ids)s::bigint[]) AND state = 'leased' "
    "AND lease_token = %(token)s AND lease_worker = 'w' RETURNING id), "
    "claimed AS (UPDATE jobs SET state = 'leased', attempt = attempt + 1, "
    "lease_token = %(token)s, lease_worker = 'w', lease_expires_at = %(now)s + 60000, "
    "leased_at = %(now)s WHERE id IN (SELECT id FROM jobs WHERE state = 'ready' "
    "AND queue = 'floor' AND priority = 0 ORDER BY ready_at, id LIMIT %(n)s "
    "FOR UPDATE SKIP LOCKED) RETURNING id, payload, attempt, max_attempts) "
    "SELECT id, (SELECT count(*) FROM acked) FROM claimed"
)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def tick(self) -> int:
        self.now += 1
        return self.now


def store_submit(store: Store, n: int, clock: Clock) -> Callable[[], None]:
    specs = [SubmitSpec("floor", PAYLOAD) for _ in range(n)]

    def run() -> None:
        store.begin()
        store.jobs_submit_later(specs, clock.tick())
        store.commit()

    return run


def store_lease_ack(store: Store, n: int, clock: Clock) -> Callable[[], None]:
    held = []

    def run() -> None:
        nonlocal held
        now = clock.tick()
        store.begin()
        if held:
            refused = store.jobs_ack_many([(h.job_id, "w", h.token, None) for h in held], now)
            assert not any(refused), refused
        held = store.jobs_claim(["floor"], "w", n, 60_000, now)
        store.commit()
        assert len(held) == n, "the backlog ran out: give a larger --backlog"

    return run


def floor_submit(db: psycopg.Connection, n: int, clock: Clock) -> Callable[[], None]:
    payloads = [PAYLOAD] * n

    def run() -> None:
        db.execute(_INSERT, {"now": clock.tick(), "payloads": payloads}, prepare=True)

    return run


def floor_lease_ack(db: psycopg.Connection, n: int, clock: Clock) -> Callable[[], None]:
    held: list[int] = []
    token = secrets.token_hex(16)

    def run() -> None:
        nonlocal held
        params = {"now": clock.tick(), "ids": held, "token": token, "n": n}
        rows = db.execute(_LEASE_ACK, params, prepare=True).fetchall()
        assert len(rows) == n, "the backlog ran out: give a larger --backlog"
        assert not held or rows[0][1] == len(held)
        held = [row[0] for row in rows]

    return run


def backend_cpu(db: psycopg.Connection, name: str) -> float:
    """CPU seconds so far of the backends serving database ``name`` (this one's too)."""
    pids = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
        (name,),
    ).fetchall()
    return cpu_seconds([pid for (pid,) in pids])


def timed(run: Callable[[], None], seconds: float, cpu: Callable[[], float]) -> tuple[float, float]:
    """Microseconds per run: wall, and the database's CPU."""
    run()
    cpu_before, started, runs = cpu(), time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        run()
        runs += 1
    wall = time.perf_counter() - started
    return wall / runs * 1e6, (cpu() - cpu_before) / runs * 1e6


def fill(store: Store, jobs: int) -> None:
    for start in range(0, jobs, 5_000):
        store.jobs_submit([SubmitSpec("floor", PAYLOAD)] * min(5_000, jobs - start), T0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="a PostgreSQL URL to create databases from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per variant and round")
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--sizes", default="1,8,100", help="jobs per submit transaction")
    parser.add_argument("--claims", default="8,16", help="jobs per lease+ack transaction")
    args = parser.parse_args()
    databases: list[PgDatabase] = []  # (the store's, the floor's)
    try:
        for _ in range(2):
            databases.append(PgDatabase(args.db))
        with (
            psycopg.connect(args.db, autocommit=True) as admin,
            tempfile.TemporaryDirectory() as directory,
        ):
            report = measure(args, directory, admin, databases)
        print(json.dumps(report))
    finally:
        for database in databases:
            database.drop()


def measure(args, directory: str, admin: psycopg.Connection, databases: list[PgDatabase]) -> dict:
    urls = [database.url for database in databases]
    sqlite = SqliteStore.open(str(Path(directory) / "floor.db"))
    postgres = PostgresStore.open(urls[0])
    PostgresStore.open(urls[1]).close()  # (the same schema, for the bare statements)
    db = psycopg.connect(urls[1], autocommit=True)
    try:
        clock = Clock()
        for store in (sqlite, postgres):
            fill(store, args.backlog)
        fill_floor = floor_submit(db, 5_000, clock)
        for _ in range(0, args.backlog, 5_000):
            fill_floor()
        for url in urls:
            with psycopg.connect(url, autocommit=True) as analyze:
                analyze.execute("VACUUM ANALYZE jobs")
        cpu = {
            "sqlite": lambda: 0.0,
            "postgres": lambda: backend_cpu(admin, databases[0].name),
            "floor": lambda: backend_cpu(admin, databases[1].name),
        }
        variants: dict[str, dict[str, Callable[[], None]]] = {}
        for n in (int(size) for size in args.sizes.split(",")):
            variants[f"submit {n}"] = {
                "sqlite": store_submit(sqlite, n, clock),
                "postgres": store_submit(postgres, n, clock),
                "floor": floor_submit(db, n, clock),
            }
        for n in (int(size) for size in args.claims.split(",")):
            variants[f"lease+ack {n}"] = {
                "sqlite": store_lease_ack(sqlite, n, clock),
                "postgres": store_lease_ack(postgres, n, clock),
                "floor": floor_lease_ack(db, n, clock),
            }
        times: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for _ in range(args.rounds):
            for name, runs in variants.items():
                for way, run in runs.items():
                    sample = timed(run, args.seconds, cpu[way])
                    times.setdefault(name, {}).setdefault(way, []).append(sample)
        return {
            name: {
                way: {
                    "us": round(statistics.median(s[0] for s in samples)),
                    "db_cpu_us": round(statistics.median(s[1] for s in samples)),
                }
                for way, samples in ways.items()
            }
            for name, ways in times.items()
        }
    finally:
        db.close()
        postgres.close()
        sqlite.close()


if __name__ == "__main__":
    main()
