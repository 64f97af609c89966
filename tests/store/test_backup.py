"""The online backup of a SQLite file (relay/store/backup.py) against a store that keeps
it open: the copy holds what was committed, also what is still only in the WAL, is a
relay-trio database that opens and recovers, and is made with mode 0600; refusals name the
file and leave nothing behind."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from relay.protocol.errors import JobNotFound
from relay.protocol.model import JobState, SubmitSpec
from relay.store.backup import BackupError, backup_file
from relay.store.sqlite import SqliteStore
from tests.conftest import T0


def submit(store: SqliteStore, n: int, queue: str = "q") -> list[str]:
    store.begin()
    with store.command():
        receipts = store.jobs_submit([SubmitSpec(queue, f'{{"n": {i}}}') for i in range(n)], T0)
    store.commit()
    return [r.job_id for r in receipts]


def test_the_copy_holds_what_is_committed_also_only_in_the_wal(tmp_path: Path) -> None:
    path, dest = tmp_path / "relay.db", tmp_path / "copy.db"
    store = SqliteStore.open(str(path))
    try:
        ids = submit(store, 50)
        store.begin()
        with store.command():
            [lease] = store.jobs_claim(["q"], "w", 1, 60_000, T0)
        store.commit()
        # Nothing checkpointed yet: the WAL holds every commit, the main file none.
        assert os.path.getsize(f"{path}-wal") > 0
        result = backup_file(str(path), str(dest))
        after = submit(store, 1)  # committed after: not in the copy
    finally:
        store.close()
    assert result.jobs == 50 and result.path == str(dest)
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["relay.db", "relay.db.lock", "copy.db"]
    )
    copy = sqlite3.connect(dest)
    try:
        assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert copy.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        copy.close()
    restored = SqliteStore.open(str(dest))  # a server opening it recovers the lease
    try:
        assert restored.leases_recover(T0 + 1) == 1
        assert restored.job_inspect(lease.job_id).state is JobState.READY
        assert all(restored.job_inspect(i).state is JobState.READY for i in ids)
        with pytest.raises(JobNotFound):
            restored.job_inspect(after[0])
    finally:
        restored.close()


def test_the_store_commits_while_a_backup_reads(tmp_path: Path) -> None:
    """The copy's read transaction blocks no commit of the server's connection (WAL)."""
    path, dest = tmp_path / "relay.db", tmp_path / "copy.db"
    store = SqliteStore.open(str(path))
    try:
        submit(store, 20_000)  # a few MB: the copy takes a while
        failures: list[BaseException] = []

        def copy() -> None:
            try:
                backup_file(str(path), str(dest))
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=copy)
        thread.start()
        committed = 0
        while thread.is_alive():
            submit(store, 1, queue="during")
            committed += 1
        thread.join()
        assert failures == []
        assert committed > 0
    finally:
        store.close()
    assert sqlite3.connect(dest).execute("SELECT count(*) FROM jobs").fetchone()[0] >= 20_000


def test_refusals_name_the_file_and_leave_nothing(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    SqliteStore.open(str(path)).close()
    dest = tmp_path / "copy.db"
    dest.write_bytes(b"older")
    with pytest.raises(BackupError, match=r"copy\.db exists: .* --force"):
        backup_file(str(path), str(dest))
    assert dest.read_bytes() == b"older"
    backup_file(str(path), str(dest), force=True)
    assert dest.read_bytes().startswith(b"SQLite format 3\x00")
    with pytest.raises(BackupError, match=r"directory of .* does not exist"):
        backup_file(str(path), str(tmp_path / "missing" / "copy.db"))
    with pytest.raises(BackupError, match="no database at"):
        backup_file(str(tmp_path / "none.db"), str(tmp_path / "a.db"))
    assert not (tmp_path / "none.db").exists()  # never created
    (tmp_path / "text.db").write_text("hello")
    with pytest.raises(BackupError, match="not a SQLite database"):
        backup_file(str(tmp_path / "text.db"), str(tmp_path / "a.db"))
    newer = tmp_path / "newer.db"
    SqliteStore.open(str(newer)).close()
    conn = sqlite3.connect(newer)
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(BackupError, match="schema version 999, newer"):
        backup_file(str(newer), str(tmp_path / "a.db"))
    assert not (tmp_path / "a.db").exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
