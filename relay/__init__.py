"""relay-trio: a compact, durable job queue with visible failure semantics.

Public API (re-exports only):

- ``open_client(address)``: async client; ``connect(address)``: blocking client
- ``open_local(db)``: embedded mode, the same client API without sockets
- ``Worker``, ``run_worker``, ``PermanentError``: the pull worker
- the errors, one per wire error code

docs/client.md lists every name here (tests/test_public_api.py compares the two). Importing
``relay`` loads the clients and the worker, never the server, the stores or their drivers:
``open_local`` imports the server's core when it opens a queue.
"""

import importlib.metadata

from relay.blocking import BlockingClient, connect
from relay.client import Client, DeadPage, JobView, LeasedJob, Stats, job_fields, open_client
from relay.errors import (
    BadRequest,
    ConnectionLost,
    FrameTooLarge,
    InternalError,
    InvalidState,
    JobNotFound,
    LeaseExpired,
    NotFound,
    Overloaded,
    QueueFull,
    RelayError,
    ShuttingDown,
    StaleToken,
    Unauthorized,
    Unavailable,
    UnknownOp,
    WrongServer,
)
from relay.local import open_local
from relay.model import JobState, SubmitResult
from relay.worker import PermanentError, Worker, run_worker

__version__ = importlib.metadata.version("relay-trio")  # pyproject.toml's

__all__ = [
    "BadRequest",
    "BlockingClient",
    "Client",
    "ConnectionLost",
    "DeadPage",
    "FrameTooLarge",
    "InternalError",
    "InvalidState",
    "JobNotFound",
    "JobState",
    "JobView",
    "LeaseExpired",
    "LeasedJob",
    "NotFound",
    "Overloaded",
    "PermanentError",
    "QueueFull",
    "RelayError",
    "ShuttingDown",
    "StaleToken",
    "Stats",
    "SubmitResult",
    "Unauthorized",
    "Unavailable",
    "UnknownOp",
    "Worker",
    "WrongServer",
    "connect",
    "job_fields",
    "open_client",
    "open_local",
    "run_worker",
]
