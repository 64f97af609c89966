"""The pools of unauthenticated connections (connections/prehello.py), by themselves: who
is refused, who gives way, and what counts as one source."""

from __future__ import annotations

import trio

from relay.server.connections.prehello import (
    PreHello,
    Ticket,
    default_per_address,
    default_total,
    source_of,
)


def test_sources_are_ipv4_addresses_and_ipv6_networks():
    assert source_of(("10.0.0.1", 5000)) == "10.0.0.1"
    assert source_of(("::ffff:10.0.0.1", 5000, 0, 0)) == "10.0.0.1"
    assert source_of(("2001:db8:1:2::5", 1, 0, 0)) == source_of(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert source_of(("2001:db8:1:3::5", 1, 0, 0)) != source_of(("2001:db8:1:2::5", 1, 0, 0))
    assert source_of(None) == source_of("/tmp/socket") == "?"


def test_the_defaults_follow_max_connections():
    assert (default_total(1024), default_per_address(1024)) == (128, 16)
    assert (default_total(10_000), default_per_address(10_000)) == (1250, 156)
    assert (default_total(4), default_per_address(4)) == (4, 4)  # all of a small server


async def test_one_source_past_its_share_is_refused():
    pool = PreHello(total=8, per_address=2, timeout_s=2.0)
    a, b = pool.admit("a"), pool.admit("a")
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    assert pool.admit("a") == (
        "max_prehello_per_address",
        "too many unauthenticated connections from one address (max 2)",
    )
    a.release()
    a.release()  # (once only)
    assert isinstance(pool.admit("a"), Ticket)
    assert pool.count == 2


async def test_when_full_a_newcomer_displaces_the_oldest_of_the_heaviest_source():
    pool = PreHello(total=5, per_address=3, timeout_s=2.0)
    tickets = {name: [pool.admit(name) for _ in range(n)] for name, n in (("a", 3), ("b", 2))}
    newcomer = pool.admit("c")
    assert isinstance(newcomer, Ticket)
    oldest_of_a = tickets["a"][0]
    assert oldest_of_a.released and oldest_of_a.scope.cancel_called
    assert not any(t.scope.cancel_called for t in tickets["a"][1:] + tickets["b"])
    assert (pool.count, pool.evicted) == (5, 1)
    # a and b hold 2 each, c 1: another from c still displaces one of theirs...
    assert isinstance(pool.admit("c"), Ticket)
    assert pool.evicted == 2
    # ...but one from b, which holds as many as any, is refused.
    assert pool.admit("b") == ("max_prehello", "too many unauthenticated connections (max 5)")


async def test_a_ticket_is_due_the_timeout_after_it_was_admitted(mock_clock):
    pool = PreHello(total=4, per_address=4, timeout_s=2.0)
    ticket = pool.admit("a")
    assert isinstance(ticket, Ticket)
    assert ticket.deadline == trio.current_time() + 2.0
