"""The PostgreSQL part of ``relay-bench --db URL``: a fresh database per group of
scenarios, and the counters and CPU seconds of PostgreSQL that a run's cost is read from."""

from __future__ import annotations

import os
import time

from relay_scripts.bench.sampling import cpu_seconds

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
