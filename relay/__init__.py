"""relay-trio: a compact, durable job queue with visible failure semantics.

Public API (re-exports only):

- ``open_client(address)``: async client; ``connect(address)``: blocking client
- ``open_local(db)``: embedded mode, the same client API without sockets
- ``Worker``, ``run_worker``, ``PermanentError``: the pull worker
- the errors, one per wire error code

docs/client.md lists every name here (tests/test_public_api.py compares the two).

Each name is imported from its module when it is first used (PEP 562), not with the
package: ``import relay`` costs almost nothing, a program that only submits loads the
client and not the worker, and the server (which imports ``relay.x`` modules, and so this
package) loads no client it does not use. None of them loads the server, the stores or
their drivers: ``open_local`` imports the server's core when it opens a queue.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives.
_EXPORTS = {
    "BlockingClient": "relay.client.blocking",
    "connect": "relay.client.blocking",
    "Client": "relay.client.client",
    "DeadPage": "relay.client.client",
    "JobView": "relay.client.client",
    "JobsPage": "relay.client.client",
    "JobSummary": "relay.client.client",
    "LeasedJob": "relay.client.client",
    "Stats": "relay.client.client",
    "QueueConfig": "relay.client.client",
    "QueueInfo": "relay.client.client",
    "QueuePage": "relay.client.client",
    "ScheduleInfo": "relay.client.client",
    "SchedulePage": "relay.client.client",
    "WorkerInfo": "relay.client.client",
    "WorkersPage": "relay.client.client",
    "History": "relay.client.client",
    "HistoryPoint": "relay.client.client",
    "job_fields": "relay.client.client",
    "open_client": "relay.client.client",
    "open_local": "relay.local",
    "AttemptEntry": "relay.protocol.model",
    "AttemptOutcome": "relay.protocol.model",
    "JobState": "relay.protocol.model",
    "SubmitResult": "relay.protocol.model",
    "PermanentError": "relay.worker.worker",
    "Worker": "relay.worker.worker",
    "run_worker": "relay.worker.worker",
    **dict.fromkeys(
        [
            "BadRequest",
            "Cancelled",
            "ConnectionLost",
            "FrameTooLarge",
            "InternalError",
            "InvalidState",
            "JobNotFound",
            "LeaseExpired",
            "NotFound",
            "Overloaded",
            "QueueFull",
            "RelayError",
            "ShuttingDown",
            "StaleToken",
            "TooManyQueues",
            "TooManySchedules",
            "Unauthorized",
            "Unavailable",
            "UnknownOp",
            "WrongServer",
        ],
        "relay.protocol.errors",
    ),
}

__all__ = [  # _EXPORTS's names, spelled out for the tools that read __all__
    "AttemptEntry",
    "AttemptOutcome",
    "BadRequest",
    "BlockingClient",
    "Cancelled",
    "Client",
    "ConnectionLost",
    "DeadPage",
    "FrameTooLarge",
    "History",
    "HistoryPoint",
    "InternalError",
    "InvalidState",
    "JobNotFound",
    "JobState",
    "JobSummary",
    "JobView",
    "JobsPage",
    "LeaseExpired",
    "LeasedJob",
    "NotFound",
    "Overloaded",
    "PermanentError",
    "QueueConfig",
    "QueueFull",
    "QueueInfo",
    "QueuePage",
    "RelayError",
    "ScheduleInfo",
    "SchedulePage",
    "ShuttingDown",
    "StaleToken",
    "Stats",
    "SubmitResult",
    "TooManyQueues",
    "TooManySchedules",
    "Unauthorized",
    "Unavailable",
    "UnknownOp",
    "Worker",
    "WorkerInfo",
    "WorkersPage",
    "WrongServer",
    "connect",
    "job_fields",
    "open_client",
    "open_local",
    "run_worker",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib import metadata

        value: Any = metadata.version("relay-trio")  # pyproject.toml's
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'relay' has no attribute {name!r}")
    globals()[name] = value  # the next use finds it at once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__, "__version__"])


if TYPE_CHECKING:  # what type checkers and editors see: the same names, eagerly
    from relay.client.blocking import BlockingClient, connect
    from relay.client.client import (
        Client,
        DeadPage,
        History,
        HistoryPoint,
        JobsPage,
        JobSummary,
        JobView,
        LeasedJob,
        QueueConfig,
        QueueInfo,
        QueuePage,
        ScheduleInfo,
        SchedulePage,
        Stats,
        WorkerInfo,
        WorkersPage,
        job_fields,
        open_client,
    )
    from relay.local import open_local
    from relay.protocol.errors import (
        BadRequest,
        Cancelled,
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
        TooManyQueues,
        TooManySchedules,
        Unauthorized,
        Unavailable,
        UnknownOp,
        WrongServer,
    )
    from relay.protocol.model import AttemptEntry, AttemptOutcome, JobState, SubmitResult
    from relay.worker.worker import PermanentError, Worker, run_worker
