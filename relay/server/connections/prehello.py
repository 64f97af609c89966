"""The pools of unauthenticated connections: per source address and server-wide.

A connection is unauthenticated from its accept until it has a role: until its ``hello``
with a valid token succeeds (with tokens configured), else until its transport is ready
(TLS or the WebSocket opening handshake; a plain TCP connection has a role at once).
Each one holds a ``Ticket`` of the listeners' ``PreHello`` meanwhile, and gives it back
when it has a role or closes; it is closed if it has none by the ticket's ``deadline``.

Idle sockets cost an attacker nothing, so without these pools one host could hold every
slot of ``max_connections`` and lock authenticated clients out. Two bounds keep it small:

- ``per_address``: a source address (an IPv6 one by its /64, which one host usually has
  whole) past it is refused, with the ``overloaded`` line. That address is the one
  flooding; others are not touched.
- ``total``: when the server-wide pool is full, a new connection takes the place of the
  oldest unauthenticated one of the address holding the most (closed without a line, as
  at its deadline), unless the newcomer's own address holds that many: then it is refused.
  So a client from an address that is not flooding always gets its chance to say hello,
  however many addresses flood, and the flood only churns its own connections.

By default ``total`` is an eighth of ``max_connections``, so unauthenticated connections
never take the slots authenticated ones need (a small server, of 16 connections or fewer,
lets them take all).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict

import trio

from relay.util.log import Summary, event

log = logging.getLogger("relay.listener")

# How long a connection may take, from its accept, to have a role (the server's
# hello_timeout_ms, --hello-timeout-ms): a hello is one round trip after the handshakes.
HELLO_TIMEOUT_MS = 2_000

# The source of every peer that is not an IP address, or that the socket could not name:
# they count as one.
UNKNOWN = "?"


def default_total(max_connections: int) -> int:
    """The server-wide pool's default: an eighth of ``max_connections``, but at least 16
    (all of them, when there are fewer)."""
    return max(max_connections // 8, min(max_connections, 16))


def default_per_address(max_connections: int) -> int:
    """The per-address default: a 64th of ``max_connections``, but at least 8 (at most the
    server-wide pool)."""
    return min(max(max_connections // 64, 8), default_total(max_connections))


def address_key(host: str) -> str:
    """What a per-address limit counts ``host`` (a peer's address) under: an IPv6 address
    by its /64, an IPv4-mapped one as IPv4, any other as it is. (The HTTP listener's
    per-address limit counts the same way.)"""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def source_of(sockname: object) -> str:
    """The source an address counts against: an IPv4 address (also one mapped into
    IPv6), or an IPv6 address's /64 network (``address_key``)."""
    host = sockname[0] if isinstance(sockname, tuple) and sockname else None
    if not isinstance(host, str):
        return UNKNOWN  # not an IP socket's address
    return address_key(host)


class Ticket:
    """One unauthenticated connection's place in the pools: given back once (``release``),
    when the connection has a role or closes. ``scope`` is the connection's task's cancel
    scope: cancelled when another connection takes its place."""

    __slots__ = ("_pool", "deadline", "released", "scope", "source")

    def __init__(self, pool: PreHello, source: str, deadline: float) -> None:
        self._pool = pool
        self.source = source
        self.deadline = deadline  # trio time by which it must have a role
        self.scope = trio.CancelScope()
        self.released = False

    def release(self) -> None:
        """The connection has a role (or has closed): it leaves the pools. Idempotent."""
        if not self.released:
            self.released = True
            self._pool._remove(self)

    def timed_out(self, peer: str) -> None:
        """The connection had no role by its deadline and is being closed (logged in
        summary: idle sockets come in floods)."""
        self._pool.timed_out += 1
        if n := self._pool._timeouts.count(trio.current_time()):
            event(log, logging.INFO, "connection.hello_timeout", peer=peer, timed_out=n)


class PreHello:
    """The pools, shared by every listener of one server (TCP and WebSocket)."""

    def __init__(self, total: int, per_address: int, timeout_s: float) -> None:
        self.total = total
        self.per_address = per_address
        self.timeout_s = timeout_s
        # Source -> its tickets, oldest first (the oldest is the first taken over).
        self._by_source: dict[str, OrderedDict[Ticket, None]] = {}
        self.count = 0
        self.evicted = 0
        self.timed_out = 0
        self._evictions = Summary()
        self._timeouts = Summary()

    def admit(self, source: str) -> Ticket | tuple[str, str]:
        """A ticket for a new connection from ``source``; or, if it is refused, the limit
        it is over and the message of its ``overloaded`` line."""
        mine = self._by_source.get(source)
        held = 0 if mine is None else len(mine)
        if held >= self.per_address:
            return "max_prehello_per_address", (
                f"too many unauthenticated connections from one address (max {self.per_address})"
            )
        if self.count >= self.total and not self._make_room(held):
            return "max_prehello", f"too many unauthenticated connections (max {self.total})"
        ticket = Ticket(self, source, trio.current_time() + self.timeout_s)
        if mine is None:
            mine = self._by_source[source] = OrderedDict()
        mine[ticket] = None
        self.count += 1
        return ticket

    def _make_room(self, held: int) -> bool:
        """Close the oldest ticket of the source holding the most, if it holds more than
        ``held`` (the newcomer's source's count); True if one was closed."""
        heaviest = max(self._by_source.values(), key=len)
        if len(heaviest) <= held:
            return False
        oldest = next(iter(heaviest))
        oldest.release()
        oldest.scope.cancel()
        self.evicted += 1
        if n := self._evictions.count(trio.current_time()):
            event(log, logging.WARNING, "connection.prehello_evicted", source=oldest.source,
                  reason="max_prehello", evicted=n)  # fmt: skip
        return True

    def _remove(self, ticket: Ticket) -> None:
        tickets = self._by_source[ticket.source]
        del tickets[ticket]
        if not tickets:
            del self._by_source[ticket.source]
        self.count -= 1
