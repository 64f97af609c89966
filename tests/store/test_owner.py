"""One owner per SQLite file (relay/store/owner.py): the lock file, its refusals, its release.

A holder in another process is a child Python that opens the store and says so on stdout;
it is killed with SIGKILL, as a crash would, and the lock must be free at once.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from relay.protocol.errors import BadDatabasePath, DatabaseInUse, NotADatabase
from relay.store.owner import OwnerLock, lock_path
from relay.store.schema import open_database
from relay.store.sqlite import SqliteStore
from tests.conftest import T0
from tests.store.test_sqlite import spec

HOLDER = """
import sys
from relay.store.sqlite import SqliteStore
store = SqliteStore.open(sys.argv[1])
print("open", flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
store.close()
"""
HOLDER_TIMEOUT_S = 30  # how long the child may take to import and open


@contextmanager
def holder_process(db: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process with ``db`` open as a store; SIGKILLed on the way out."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "open\n"  # (EOF, "", if it failed to open)
        yield child
    finally:
        child.kill()
        child.wait(HOLDER_TIMEOUT_S)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_store_open_in_another_process_is_refused_naming_its_pid(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    with holder_process(db) as child:
        before = files(tmp_path)
        with pytest.raises(DatabaseInUse) as refused:
            SqliteStore.open(str(db))
        assert refused.value.pid == child.pid
        assert refused.value.path == str(db)
        assert refused.value.problem == (
            f"in use by another relay-trio process (pid {child.pid}); "
            "stop it, or give this one another --db"
        )
        # Nothing of the database was read or written: every byte beside it is the same,
        # and no -wal or -shm appeared or went away.
        assert files(tmp_path) == before


def test_a_crashed_owner_leaves_nothing_that_refuses_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    with holder_process(db) as child:
        child.send_signal(signal.SIGKILL)
        child.wait(HOLDER_TIMEOUT_S)
        store = SqliteStore.open(str(db))  # the kernel dropped the dead owner's lock
        store.close()
    assert Path(lock_path(str(db))).exists()  # left in place, and harmless


def test_a_second_open_in_this_process_is_refused_until_the_first_is_closed(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "relay.db")
    first = SqliteStore.open(db)
    [job] = first.jobs_submit([spec()], T0)
    with pytest.raises(DatabaseInUse) as refused:
        SqliteStore.open(db)
    assert refused.value.pid == os.getpid()
    assert "already open in this process" in refused.value.problem
    first.close()

    again = SqliteStore.open(db)  # closing the store released the lock
    try:
        assert again.job_inspect(job.job_id).job_id == job.job_id
    finally:
        again.close()


def test_closing_the_connection_of_open_database_releases_the_lock(tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    conn = open_database(db)
    with pytest.raises(DatabaseInUse):
        open_database(db)
    conn.close()
    open_database(db).close()


def test_a_store_never_closed_releases_its_lock_when_collected(tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    forgotten = SqliteStore.open(db)
    del forgotten
    gc.collect()
    SqliteStore.open(db).close()


def test_a_symlink_to_an_open_database_takes_the_same_lock(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    alias = tmp_path / "alias.db"
    alias.symlink_to(db)
    store = SqliteStore.open(str(db))
    try:
        with pytest.raises(DatabaseInUse) as refused:
            SqliteStore.open(str(alias))
        assert refused.value.path == str(alias)
        assert not Path(f"{alias}.lock").exists()
    finally:
        store.close()


def test_a_lock_file_without_a_pid_gives_a_refusal_without_one(tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    lock = OwnerLock.acquire(db)
    try:
        Path(lock.path).write_text("not a pid\n")
        with pytest.raises(DatabaseInUse) as refused:
            OwnerLock.acquire(db)
        assert refused.value.pid is None
        assert refused.value.problem.startswith("in use by another relay-trio process; ")
    finally:
        lock.release()


def test_release_is_idempotent_and_leaves_the_lock_file(tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    lock = OwnerLock.acquire(db)
    assert lock.held and Path(lock.path).read_text() == f"{os.getpid()}\n"
    lock.release()
    lock.release()
    assert not lock.held and Path(lock.path).exists()
    OwnerLock.acquire(db).release()


def test_a_refused_file_releases_the_lock_it_took(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    db.write_text("my notes\n")
    for _ in range(2):  # the second time refused for the same reason, not as in use
        with pytest.raises(NotADatabase):
            SqliteStore.open(str(db))


def test_in_memory_databases_take_no_lock(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    first, second = SqliteStore.open(":memory:"), SqliteStore.open(":memory:")
    first.close()
    second.close()
    assert list(tmp_path.iterdir()) == []


# -- paths that cannot hold a database ---------------------------------------------------------


def test_a_directory_is_refused_and_gets_no_lock_file_beside_it(tmp_path: Path) -> None:
    directory = tmp_path / "data"
    directory.mkdir()
    with pytest.raises(BadDatabasePath) as refused:
        SqliteStore.open(str(directory))
    assert refused.value.problem.startswith("is a directory: give a file path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert list(directory.iterdir()) == []


def test_a_missing_directory_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(BadDatabasePath) as refused:
        SqliteStore.open(str(missing / "relay.db"))
    assert refused.value.problem.startswith(f"directory {missing} does not exist")
    assert not missing.exists()


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("")
    with pytest.raises(BadDatabasePath) as refused:
        SqliteStore.open(str(tmp_path / "notes" / "relay.db"))
    assert refused.value.problem == f"{tmp_path / 'notes'} is not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any directory and file")
def test_no_permission_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    # (As root, the CLI tests in tests/server/test_process.py run this as nobody.)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(BadDatabasePath) as refused:
        SqliteStore.open(str(locked / "relay.db"))
    assert refused.value.problem.startswith("permission denied")
    assert str(locked) in refused.value.problem
    db = tmp_path / "relay.db"
    db.write_bytes(b"")
    db.chmod(0)
    with pytest.raises(BadDatabasePath) as refused:
        SqliteStore.open(str(db))
    assert refused.value.problem.startswith("permission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked", "relay.db"]


def test_a_symlink_where_the_lock_file_goes_is_refused_and_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "relay.db.lock").symlink_to(target)
    with pytest.raises(BadDatabasePath, match="symbolic link"):
        OwnerLock.acquire(str(tmp_path / "relay.db"))
    assert target.read_text() == "keep me"
