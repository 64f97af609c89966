"""relay/server/http/admission.py's rules, without sockets (under attack, over sockets:
tests/hostile/test_http.py)."""

from __future__ import annotations

import pytest

from relay.server.http.admission import (
    OVER_ADDRESS,
    OVER_CAP,
    RESERVED,
    Admission,
    address_key,
    loopback_host,
)


@pytest.mark.parametrize(
    "host",
    [b"localhost", b"LocalHost:7401", b"localhost.", b"127.0.0.1", b"127.0.0.1:7401",
     b"127.200.1.1", b"[::1]", b"[::1]:7401", b"[::ffff:127.0.0.1]:80", b" localhost "],
)  # fmt: skip
def test_loopback_hosts_are_answered_on_loopback(host):
    assert loopback_host([(b"host", host)])


@pytest.mark.parametrize(
    "host",
    [b"evil.example", b"evil.example:7401", b"localhost.evil.example", b"127.0.0.1.nip.io",
     b"10.0.0.5", b"[::2]", b"::1", b"[127.0.0.1]", b"2130706433", b"0x7f000001",
     b"local host", b"", b"localhost:7401:1", "l\u00f6calhost".encode("latin-1")],
)  # fmt: skip
def test_other_hosts_are_not(host):
    assert not loopback_host([(b"host", host)])


def test_two_host_headers_are_not_and_none_is():
    assert not loopback_host([(b"host", b"localhost"), (b"host", b"evil.example")])
    assert loopback_host([(b"accept", b"*/*")])  # HTTP/1.0 without Host: not a browser


def test_an_ipv6_peer_counts_by_its_64():
    assert address_key("2001:db8:1:2::5") == address_key("2001:db8:1:2:ffff::9")
    assert address_key("2001:db8:1:3::5") != address_key("2001:db8:1:2::5")
    assert address_key("::ffff:10.0.0.5") == "10.0.0.5"
    assert address_key("10.0.0.5") == "10.0.0.5"


def test_admission_keeps_its_reserve_for_local_connections():
    admission = Admission(total=6, per_address=2, reserve=2)
    assert admission.admit("a", local=False) is None
    assert admission.admit("a", local=False) is None
    assert admission.admit("a", local=False) == OVER_ADDRESS
    assert admission.admit("b", local=False) is None
    assert admission.admit("b", local=False) is None
    assert admission.admit("c", local=False) == RESERVED  # 2 left: the reserve
    assert admission.admit("l", local=True) is None
    assert admission.admit("l", local=True) is None
    assert admission.admit("m", local=True) == OVER_CAP
    admission.release("a")
    assert admission.admit("c", local=False) == RESERVED  # still only the reserve free
    admission.release("l")
    admission.release("l")
    assert admission.admit("c", local=False) is None
    assert admission.open == 4
