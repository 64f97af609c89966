"""The one owner of a SQLite database file: a lock file beside it, and the path checks before.

A SQLite database has one relay-trio process that writes it. A second one on the same
file would not corrupt it (SQLite serialises the two writers), but it would break the
failure semantics: at start it recovers the leases of the first as orphans and hands
their jobs out again, and each process keeps its own counts and lease book. So every way
of opening a file for writing (``schema.open_database``) first takes ``OwnerLock``, and a
second opener is refused with ``DatabaseInUse`` before it reads or writes a byte of the
database. Several servers on one database is what the PostgreSQL store is for.

Why a separate file, ``<realpath(db)>.lock``: POSIX record locks (``fcntl``/``lockf``)
belong to a process and an inode, and closing *any* descriptor of the file drops all of
the process's locks on it, SQLite's own among them (sqlite.org/howtocorrupt.html, 2.2).
So we neither lock nor open-and-close a descriptor of the database (nor its -wal/-shm);
the lock file is ours alone. It is named after the real path, so a symlink to the same
database takes the same lock.

Why ``flock``: its lock belongs to the open file description, not to the process, so a
second open in the same process conflicts as a second process does; it never blocks
here (``LOCK_NB``); and the kernel drops it when the owner dies, even by SIGKILL, so a
restart after a crash is never refused and there is nothing stale to clean up. The lock
file is left in place when the store closes: deleting it would race with an opener that
has it open but not yet locked (that one would lock a deleted file while a third creates
and locks a new one). It holds the owner's pid, for the refusal to name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
from typing import Any, NoReturn

from relay.protocol.errors import BadDatabasePath, DatabaseInUse

LOCK_SUFFIX = ".lock"
# The mode of the files a store creates: the database (SQLite gives its -wal and -shm the
# database's mode) and the lock file. Jobs' payloads, and the owner's pid, are nobody
# else's business.
PRIVATE_MODE = 0o600
PID_BYTES = 32  # a pid in decimal and a newline, with room to spare


def lock_path(db: str) -> str:
    """The lock file of database ``db``: beside the file the path resolves to."""
    return os.path.realpath(db) + LOCK_SUFFIX


def check_path(db: str) -> None:
    """Refuse a path that cannot hold a database we can write, naming the reason. Reads
    only the file system's metadata (stat, access), not a byte of any file.

    Raises:
        BadDatabasePath: a directory, a missing directory, no permission.
    """
    if os.path.isdir(db):
        _refuse(db, "is a directory: give a file path, e.g. " + os.path.join(db, "relay.db"))
    directory = os.path.dirname(os.path.realpath(db))
    if not os.path.exists(directory):
        _refuse(db, f"directory {directory} does not exist: create it, or give another path")
    if not os.path.isdir(directory):
        _refuse(db, f"{directory} is not a directory")
    if os.path.exists(db) and not _may(db, os.R_OK | os.W_OK):
        _refuse(db, "permission denied: this user cannot read and write the file")
    # The lock file, and SQLite's -wal and -shm files, are created beside the database.
    if not _may(directory, os.W_OK | os.X_OK):
        name = os.path.basename(os.path.realpath(db))
        _refuse(
            db,
            f"permission denied: this user cannot create files in {directory}, where "
            f"{name}{LOCK_SUFFIX} and SQLite's {name}-wal and {name}-shm go",
        )


def create_private(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (never through a symbolic link), creating it with mode 0600 whatever
    the umask if it does not exist; a file that exists keeps its mode. Returns the fd."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_MODE)
    except FileExistsError:
        return os.open(path, flags | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # (the umask may have taken bits away)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _may(path: str, mode: int) -> bool:
    # As the effective user (the one whose rights the opens will be checked against).
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def _refuse(db: str, problem: str) -> NoReturn:
    raise BadDatabasePath(db, problem)


class OwnerLock:
    """An exclusive ``flock`` on the lock file of one database, held until ``release``."""

    def __init__(self, db: str, path: str, fd: int) -> None:
        self.db = db
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, db: str) -> OwnerLock:
        """Check the path, take the lock of ``db`` without waiting, and record this
        process's pid in it.

        Raises:
            BadDatabasePath: see ``check_path``; or the lock file cannot be opened.
            DatabaseInUse: another open store holds it (in this process or another).
        """
        check_path(db)  # first: the lock file of a directory would be created beside it
        path = lock_path(db)
        try:
            # Not through a symlink planted where the lock file goes: it is truncated.
            fd = create_private(path, os.O_RDWR)
        except OSError as exc:
            raise BadDatabasePath(db, _open_problem(path, exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            raise DatabaseInUse(db, holder) from exc
        except OSError as exc:  # e.g. ENOLCK: a file system without locks (some NFS, FUSE)
            os.close(fd)
            raise BadDatabasePath(
                db,
                f"cannot lock {path}: {exc.strerror or exc} (put the database on a local "
                "file system, which SQLite's WAL needs too)",
            ) from exc
        except BaseException:
            os.close(fd)
            raise
        # Best effort: the pid only makes a refusal's message more helpful.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(db, path, fd)

    def release(self) -> None:
        """Drop the lock (closing its descriptor); the file stays. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self) -> None:  # forgotten, not released: the lock goes with the object
        self.release()


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote, or None (not yet written, or not a pid)."""
    try:
        text = os.pread(fd, PID_BYTES, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _open_problem(path: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"its lock file {path} is a symbolic link: remove it"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied: cannot open its lock file {path}"
    return f"cannot open its lock file {path}: {exc.strerror or exc}"


class OwnedConnection(sqlite3.Connection):
    """A SQLite connection that holds its database's ``OwnerLock``: closing the connection
    releases the lock, after SQLite has closed the file (and checkpointed, if last)."""

    __slots__ = ("owner",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # (sqlite3.connect's arguments)
        super().__init__(*args, **kwargs)
        self.owner: OwnerLock | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.owner is not None:
                self.owner.release()

    def __del__(self) -> None:
        # Forgotten, not closed: close as sqlite3 would at collection, and only then let
        # the lock go (before the base class's clean-up, which would drop it first).
        if getattr(self, "owner", None) is not None:
            with contextlib.suppress(sqlite3.Error):
                self.close()
