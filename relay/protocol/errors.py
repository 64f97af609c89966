"""Every relay-trio exception. Each one that reaches a client maps to one wire error code.

The tree:

    RelayError                      code         connection
      BadRequest                    bad_request  stays open
      FrameTooLarge                 frame_too_large  closed
      UnknownOp                     unknown_op   stays open
      JobNotFound                   not_found
        ScheduleNotFound            not_found    (extension: no schedule of that name)
      StaleToken                    stale_token
      LeaseExpired                  lease_expired
      InvalidState                  invalid_state
      Cancelled                     cancelled    (extension: the token's lease was
                                                 cancelled with its job)
      Overloaded                    overloaded
      ShuttingDown                  shutting_down
      Unauthorized                  unauthorized
      InternalError                 internal
      QueueFull                     queue_full   (extension: a queue at its max depth)
        TooManyQueues               too_many_queues  (extension: a submit would create
                                                 a queue past the server's max_queues)
      TooManySchedules              too_many_schedules  (extension: a schedule_put would
                                                 create one past --max-schedules)
      Unavailable                   unavailable  (extension: not committed, the store
                                                 cannot write now: disk full, I/O error)
      ConnectionLost                (client side: the connection dropped mid-request)
      WrongServer                   (client side: the peer does not speak relay-trio's
                                    protocol, or TLS on one side only)
      StoreError                    (fatal at start, never sent on the wire)
        NotADatabase, ForeignDatabase, SchemaTooNew, DatabaseCorrupt, DatabaseInUse,
        BadDatabasePath

Job errors carry fields (``job_id``, ``state``) so callers need not parse messages. An
error rebuilt from a reply on the client side (``error_from_wire``) carries the server's
message; its fields are None where the reply does not state them.
"""

from __future__ import annotations

import os
from typing import Any


class RelayError(Exception):
    """Base of every relay-trio error. ``code`` is the wire error code."""

    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @classmethod
    def from_wire(cls, message: str) -> RelayError:
        """An instance carrying only the server's message (fields stay at None)."""
        error = cls.__new__(cls)
        RelayError.__init__(error, message)
        return error


class BadRequest(RelayError):
    """A malformed request or a field outside its documented range; names the field."""

    code = "bad_request"
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class FrameTooLarge(RelayError):
    """A frame longer than the limit. The server replies once, then closes the connection."""

    code = "frame_too_large"


class UnknownOp(RelayError):
    code = "unknown_op"


class JobNotFound(RelayError):
    job_id: str | None = None

    code = "not_found"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id


class ScheduleNotFound(JobNotFound):
    """No schedule has this name (``schedule_delete``, ``schedule_pause``...). The wire's
    ``not_found``: a client sees a ``JobNotFound`` (``NotFound``) with this message."""

    name: str | None = None

    def __init__(self, name: str) -> None:
        RelayError.__init__(self, f"no schedule {name}")
        self.name = name


class StaleToken(RelayError):
    job_id: str | None = None

    """The token and worker id do not hold the job's current lease. Nothing was changed."""

    code = "stale_token"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"token and worker_id do not hold the current lease of {job_id}")
        self.job_id = job_id


class LeaseExpired(RelayError):
    job_id: str | None = None
    expired_at: int | None = None

    """The token held the lease, but the lease has expired. Nothing was changed."""

    code = "lease_expired"

    def __init__(self, job_id: str, expired_at: int) -> None:
        super().__init__(f"the lease of {job_id} expired at {expired_at}")
        self.job_id = job_id
        self.expired_at = expired_at


class InvalidState(RelayError):
    job_id: str | None = None
    state: str | None = None
    operation: str | None = None

    """The operation is not allowed in the job's current state. Nothing was changed."""

    code = "invalid_state"

    def __init__(self, job_id: str, state: str, operation: str, hint: str | None = None) -> None:
        # ``hint``: what to do instead, said after the reason.
        reason = f"cannot {operation} {job_id}: it is {state}"
        super().__init__(reason if hint is None else f"{reason} ({hint})")
        self.job_id = job_id
        self.state = state
        self.operation = operation


class Cancelled(RelayError):
    job_id: str | None = None

    """The token held the job's lease, and the job was cancelled (``cancel``): the lease is
    void and the work is not wanted. Nothing was changed; stop working on the job."""

    code = "cancelled"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"{job_id} was cancelled: its lease is void, stop working on it")
        self.job_id = job_id


class Overloaded(RelayError):
    code = "overloaded"


class ShuttingDown(RelayError):
    code = "shutting_down"


class Unauthorized(RelayError):
    code = "unauthorized"


class InternalError(RelayError):
    """A bug. The server logs the traceback and keeps serving."""

    code = "internal"


class QueueFull(RelayError):
    """The queue holds its maximum number of unfinished jobs; submit again later."""

    code = "queue_full"


class TooManyQueues(QueueFull):
    """A submit would create a queue (its first job) while the server already holds
    ``max_queues`` queues with jobs. A ``QueueFull`` in Python: submit again later, to a
    queue that exists, or once queues have drained."""

    code = "too_many_queues"


class TooManySchedules(RelayError):
    """A ``schedule_put`` would create a schedule while the server holds its maximum
    (``--max-schedules``): delete schedules no longer needed first."""

    code = "too_many_schedules"


class Unavailable(RelayError):
    """The store could not commit (disk full, an I/O error): nothing of the request was
    kept, and the server stays up. Safe to retry later."""

    code = "unavailable"


class ConnectionLost(RelayError):
    """The connection dropped while the request was in flight: it may or may not have
    taken effect. Raised by the client; never sent by the server."""

    code = "connection_lost"


class WrongServer(RelayError):
    """The peer does not answer a ``hello`` as a relay-trio server: another kind of server,
    or TLS on one side only (a plain client of a TLS server is closed on without a byte).
    Trying again will not help. Raised by the clients; never sent by the server."""

    code = "wrong_server"


class StoreError(RelayError):
    """The database cannot be used. Raised when opening; the server exits non-zero."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class StoreUnreachable(StoreError):
    """No connection to the database server could be made: it may be down, starting or
    full (a failure that may pass), or it refused this one (its user, password or
    database): the server exits 1, and a service is restarted until it connects."""


class NotADatabase(StoreError):
    """The file is not a SQLite database."""


class ForeignDatabase(StoreError):
    """The file is a SQLite database of another application."""


class SchemaTooNew(StoreError):
    """The database was written by a newer relay-trio than this one."""


class DatabaseCorrupt(StoreError):
    """SQLite's integrity check failed."""


class DatabaseInUse(StoreError):
    """Another open store owns the SQLite file (relay/store/owner.py); ``pid`` is its
    process where the lock file tells it, else None."""

    pid: int | None = None

    def __init__(self, path: str, pid: int | None) -> None:
        if pid is not None and pid == os.getpid():
            problem = f"already open in this process (pid {pid}): close that store first"
        else:
            holder = "" if pid is None else f" (pid {pid})"
            problem = (
                f"in use by another relay-trio process{holder}; "
                "stop it, or give this one another --db"
            )
        super().__init__(path, problem)
        self.pid = pid


class BadDatabasePath(StoreError):
    """The path cannot hold a database: a directory, a missing directory, no permission."""


NotFound = JobNotFound

ERRORS_BY_CODE: dict[str, type[RelayError]] = {
    cls.code: cls
    for cls in (
        BadRequest, FrameTooLarge, UnknownOp, JobNotFound, StaleToken, LeaseExpired,
        InvalidState, Cancelled, Overloaded, ShuttingDown, Unauthorized, InternalError, QueueFull,
        TooManyQueues, TooManySchedules, Unavailable,
    )
}  # fmt: skip


def error_from_wire(code: str, message: str) -> RelayError:
    """The exception for an error reply; an unknown code (from a newer server) is internal."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return InternalError.from_wire(f"{code}: {message}")
    return cls.from_wire(message)


def reply_error(reply: dict[str, Any]) -> RelayError:
    """The exception an error reply carries."""
    error = reply.get("error") or {}
    return error_from_wire(str(error.get("code")), str(error.get("message")))


def reply_fields(reply: dict[str, Any]) -> dict[str, Any]:
    """The fields of a success reply, or raise the error it carries."""
    if reply.get("ok") is True:
        return reply
    raise reply_error(reply)
