"""What the PostgreSQL store's modules share: the wrapper that gives a call outside the
writer's transaction one of its own, and the codec of texts PostgreSQL cannot hold as given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from relay.store.postgres.base import PostgresBase

F = TypeVar("F", bound=Callable[..., Any])


def atomic(method: F) -> F:
    """Run ``method`` in the open transaction (the writer's batch) or, outside one, in a
    transaction of its own that commits when it returns and rolls back if it raises.

    SQLite commits each statement of a call made outside ``begin`` on its own; here a call
    is several statements that must stand together (a row lock, then the writes, then the
    counts), so it gets its own transaction: the synchronous tests and tools see the same
    outcome either way.
    """

    @functools.wraps(method)
    def run(self: PostgresBase, *args: Any, **kwargs: Any) -> Any:
        if self._journal is not None:
            return method(self, *args, **kwargs)
        return self._on_its_own(method, args, kwargs)

    return run  # type: ignore[return-value]


def opaque(value: str) -> str:
    """``value`` (a placeholder and its cast, ``%b::bigint[]``) read through a sub-select,
    so that the planner does not see it.

    The store prepares a statement at its first run (pipe.py); PostgreSQL plans a prepared
    statement with its values for five runs, then keeps the generic plan unless the
    plans with values cost less on average. An array's length (in ``unnest``), a LIMIT or
    a count of rows make those plans cheaper than the generic one's guess, whose cost they
    then never reach: such a statement was planned anew on every run for as long as the
    connection lived (a claim's candidates: 0.35-0.4 ms of the database's CPU a time, as
    long as the statement took to run). Through a sub-select the value is unknown to every
    plan alike; they cost the same, and the generic plan holds from then on
    (tests/store/test_postgres.py asserts it of the statements of every batch).
    """
    return f"(SELECT {value})"


# Texts that clients choose freely (worker ids, error texts, idempotency keys) may hold
# NUL, which a PostgreSQL text value cannot. They are stored escaped: \x01 becomes \x01 A
# and NUL becomes \x01 B, so that distinct texts stay distinct (keys and worker ids are
# compared) and every text reads back as given. A text with neither character, nearly
# every one, is stored as it is, after two scans in C.
_ESCAPE = "\x01"


def encode_text(text: str) -> str:
    if "\x00" not in text and _ESCAPE not in text:
        return text
    return text.replace(_ESCAPE, "\x01A").replace("\x00", "\x01B")


def decode_text(text: str | None) -> str | None:
    if text is None or _ESCAPE not in text:
        return text
    # Every \x01 of a stored text starts a pair (\x01 A or \x01 B), so neither replacement
    # can match across two pairs.
    return text.replace("\x01B", "\x00").replace("\x01A", _ESCAPE)
