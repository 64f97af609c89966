"""Access control on the request path: the handlers a connection's role may use, the
token check of a hello, and refusals.

A connection holds the handler table of its role (``Access.set_role``), in which an op the
role does not allow is ``forbidden``: checking access costs the dispatcher no lookup per
request. With tokens configured (relay/server/requests/auth.py) a connection starts with no role,
and its table lets only ``hello`` through; any failure before a valid hello is a refusal
(``refuse``): answered unauthorized, after a delay if its peer keeps failing, and the
connection closed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from relay.protocol import wire
from relay.protocol.errors import Unauthorized
from relay.server.requests.auth import Role, Throttle, Tokens, _digest, required_role
from relay.util.histogram import Histogram

if TYPE_CHECKING:
    from relay.server.requests.connection import Connection

Handler = Callable[["Connection", Any, float, dict], None]


class Access:
    """Who may do what, for every connection of one dispatcher.

    ``handlers`` are the dispatcher's, by op; ``answer_now`` and ``histogram`` its
    accounting (``Dispatcher._answer_now``, ``Dispatcher._histogram``), so that a refused
    request is counted as every other is.
    """

    def __init__(
        self,
        tokens: Tokens | None,
        handlers: dict[str, Handler],
        answer_now: Callable[[Connection, str, float, bytes], None],
        histogram: Callable[[str], Histogram],
    ) -> None:
        # With tokens, a connection starts with no role and must say hello with one.
        self.tokens = tokens
        self.first_role = Role.NONE if tokens is not None else Role.ADMIN
        self.throttle = Throttle()  # failed hellos, per peer host
        # The digest of the token each connection said hello with: a reload of the token
        # file (``use_tokens``) finds those whose token is gone or has another role.
        self._said: weakref.WeakKeyDictionary[Connection, bytes] = weakref.WeakKeyDictionary()
        self._answer_now = answer_now
        self._histogram = histogram
        # The handlers each role may use; the others answer unauthorized.
        self._tables = {
            role: {
                name: handler if role >= required_role(name) else self.forbidden
                for name, handler in handlers.items()
            }
            for role in Role
        }

    def set_role(self, connection: Connection, role: Role) -> None:
        connection.role = role
        connection.ops = self._tables[role]

    def admit(self, connection: Connection, rid: Any, started: float, token: str | None) -> bool:
        """The token check of a hello (also a later one: a valid token sets the
        connection's role anew). False if the hello was refused and is answered."""
        if self.tokens is None:
            return True
        role = None if token is None else self.tokens.role_of(token)
        if role is None:
            reason = "no token" if token is None else "wrong token"
            self.refuse(connection, "hello", started, rid, reason)
            return False
        assert token is not None
        self._said[connection] = _digest(token)
        self.set_role(connection, role)
        return True

    def use_tokens(self, tokens: Tokens) -> int:
        """From now on, hellos are checked against ``tokens`` (a reload of the token file;
        tokens stay on: a server started without them keeps none). Returns how many open
        connections said hello with a token that is gone or now has another role:
        ``stale`` names them, for closing after the grace (relay/server/reload.py)."""
        assert self.tokens is not None, "tokens are configured at start, never turned on"
        self.tokens = tokens
        return len(self.stale())

    def stale(self) -> list[Connection]:
        """The open connections whose hello's token the tokens in force no longer give
        their role (removed, or given another role). A later hello with a valid token
        makes a connection current again."""
        tokens = self.tokens
        if tokens is None:
            return []
        return [
            connection
            for connection, digest in list(self._said.items())
            if not connection.closed and tokens.role_of_digest(digest) is not connection.role
        ]

    def forbidden(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        """An op the connection's role does not allow: unauthorized, and the connection
        stays open; before a hello, unauthorized and closed."""
        name = fields["op"]
        if connection.role is Role.NONE:
            self.refuse(connection, name, started, rid, f"{name} before hello")
            return
        need = required_role(name).label
        error = Unauthorized(f"{name} needs the {need} role; this token is {connection.role.label}")
        self._answer_now(connection, name, started, wire.encode_error(rid, error))

    def refuse(
        self, connection: Connection, op: str, started: float, rid: Any, reason: str
    ) -> None:
        """A failed authentication: counted, logged (never with a token), answered
        unauthorized, after a delay if the peer keeps failing, and the connection closed."""
        now = trio.current_time()
        delay = self.throttle.failed(connection.peer, reason, now)
        error = Unauthorized("a hello with a valid token must come first")
        if reason == "wrong token":
            error = Unauthorized("invalid token")
        self._histogram(op).observe(now - started)
        connection.refuse(wire.encode_error(rid, error), delay)
