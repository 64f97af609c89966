"""``Connection``: what the request side needs of a client connection.

The dispatcher and its handlers (dispatch.py, access.py, admin.py) are transport-free: they
answer a ``Connection``, which a TCP or WebSocket session (relay/server/connections/) and
the embedded transport (relay/local.py) each are. It lives here, below all of them, so that
neither side imports the other to name it.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from relay.server.requests.auth import Role
from relay.store.items import Item


class Connection(Protocol):
    nursery: trio.Nursery
    closed: bool  # replies are dropped
    can_wait: bool  # a long-poll may park for this connection
    peer: str  # "host:port", for logs and for slowing repeated failed hellos
    role: Role  # what the connection may do (Access.set_role)
    ops: dict[str, Any]  # the handlers of its role (Access.set_role)

    def begin_request(self) -> None: ...
    def reserve(self, nbytes: int) -> None: ...  # a large reply is coming
    def release(self, nbytes: int) -> None: ...
    def reply_room(self) -> int: ...  # reply bytes it may still be owed (see LongPolls.run)
    def reply(self, data: bytes) -> None: ...
    def deliver(self, pairs: list[tuple[Item, Any]]) -> None: ...
    def still_wanted(self) -> bool: ...  # asked by the writer thread (Session.still_wanted)
    # Answer with ``data`` after ``delay`` seconds and close: read and run nothing more.
    def refuse(self, data: bytes, delay: float) -> None: ...
    # Its token was removed (or given another role) by a reload and the grace is over:
    # take no more requests, answer those taken, and close (relay/server/reload.py).
    def revoke(self) -> None: ...
