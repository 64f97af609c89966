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
