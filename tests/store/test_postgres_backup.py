"""The PostgreSQL backup recipe of docs/operations.md, done once: pg_dump of a database
whose job is leased, pg_restore into a fresh database, a store opened on it. The lease
held at the dump comes back as the dump had it, and is returned to ``ready`` by the reaper
once it expires (a store on PostgreSQL never takes back leases at start: other servers
may hold them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from relay.protocol.model import JobState, SubmitSpec
from relay.store.postgres import PostgresStore
from tests import pg
from tests.conftest import T0

LEASE_MS = 60_000


def run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_pg_dump_while_a_job_is_leased_restores_to_a_store_that_recovers_it(tmp_path: Path):
    dump = tmp_path / "relay.dump"
    with pg.run_database() as source:
        store = PostgresStore.open(source)
        try:
            store.begin()
            with store.command():
                held, done, waiting = store.jobs_submit(
                    [SubmitSpec("q", f'{{"n": {i}}}') for i in range(3)], T0
                )
            store.commit()
            store.begin()
            with store.command():
                [first] = store.jobs_claim(["q"], "w", 1, LEASE_MS, T0)
            with store.command():
                [second] = store.jobs_claim(["q"], "w", 1, LEASE_MS, T0)
            with store.command():
                store.jobs_ack(second.job_id, "w", second.token, None, T0)
            store.commit()
            assert first.job_id == held.job_id and second.job_id == done.job_id
            # The recipe: a consistent snapshot of a database in use, in the custom format.
            run("pg_dump", "--format=custom", "--file", str(dump), "--dbname", source)
        finally:
            store.close()
    with pg.run_database() as target:
        run("pg_restore", "--no-owner", "--exit-on-error", "--dbname", target, str(dump))
        restored = PostgresStore.open(target)
        try:
            assert restored.job_inspect(done.job_id).state is JobState.SUCCEEDED
            assert restored.job_inspect(waiting.job_id).state is JobState.READY
            # Leased in the dump, and still leased: its lease runs to its expiry...
            assert restored.job_inspect(held.job_id).state is JobState.LEASED
            assert restored.leases_recover(T0 + 1) == 0
            restored.begin()
            with restored.command():
                assert restored.leases_reap_expired(T0 + LEASE_MS - 1, 100) == []
            with restored.command():
                [reaped] = restored.leases_reap_expired(T0 + LEASE_MS + 1, 100)
            restored.commit()
            # ...then the reaper makes it ready again, and it can be leased anew.
            assert reaped.job_id == held.job_id and reaped.state is JobState.READY
            assert restored.queue_stats()["q"]["ready"] == 2
            restored.begin()
            with restored.command():
                leased = restored.jobs_claim(["q"], "w2", 2, LEASE_MS, T0 + LEASE_MS + 2)
            restored.commit()
            assert {lease.job_id for lease in leased} == {held.job_id, waiting.job_id}
            # New ids do not collide with restored ones (the sequence came with the dump).
            restored.begin()
            with restored.command():
                [new] = restored.jobs_submit([SubmitSpec("q", "{}")], T0 + LEASE_MS + 3)
            restored.commit()
            assert new.job_id not in {held.job_id, done.job_id, waiting.job_id}
        finally:
            restored.close()
