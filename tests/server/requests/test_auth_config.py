"""Access control's configuration and helpers (relay/server/requests/auth.py), in process: the token
file and RELAY_AUTH_TOKEN, token lookup, the throttle of failed authentications, the
loopback test and the refusal to listen beyond loopback without tokens, and the bearer
header of the metrics endpoint. No server, no sockets; time is passed in or mocked."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest
import trio

from relay.server.requests.auth import (
    FIRST_DELAY_S,
    FORGET_S,
    FREE_FAILURES,
    MAX_DELAY_S,
    MAX_PEERS,
    MIN_TOKEN_CHARS,
    OP_ROLES,
    AuthConfigError,
    ExposureError,
    Role,
    Throttle,
    Tokens,
    _exposed,
    bearer_guard,
    bearer_token,
    check_exposure,
    is_loopback,
    load_tokens,
    required_role,
)

PRODUCER = "producer-token-0123456789"
WORKER = "worker-token-0123456789ab"
ADMIN = "admin-token-0123456789abcd"


def token_file(tmp_path: Path, text: str, name: str = "tokens") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def roles_file(tmp_path: Path) -> str:
    return token_file(
        tmp_path,
        f"# who may do what\n\nproducer {PRODUCER}\n  worker   {WORKER}  \n"
        f"# the operators\nadmin {ADMIN}\n",
    )


# -- loading tokens --------------------------------------------------------------------------


def test_role_token_lines_with_comments_and_blank_lines(tmp_path):
    tokens = load_tokens(roles_file(tmp_path), None)
    assert tokens is not None and len(tokens) == 3
    assert tokens.role_of(PRODUCER) is Role.PRODUCER
    assert tokens.role_of(WORKER) is Role.WORKER
    assert tokens.role_of(ADMIN) is Role.ADMIN


def test_one_bare_token_is_admin(tmp_path):
    tokens = load_tokens(token_file(tmp_path, f"# the only one\n\n{ADMIN}\n"), None)
    assert tokens is not None and len(tokens) == 1
    assert tokens.role_of(ADMIN) is Role.ADMIN


def test_env_token_is_admin_and_adds_to_the_file(tmp_path):
    only_env = load_tokens(None, ADMIN)
    assert only_env is not None and only_env.role_of(ADMIN) is Role.ADMIN
    extra = "env-admin-token-0123456789"
    both = load_tokens(roles_file(tmp_path), extra)
    assert both is not None and len(both) == 4
    assert both.role_of(extra) is Role.ADMIN
    assert both.role_of(PRODUCER) is Role.PRODUCER


def test_no_file_and_no_env_or_an_empty_env_means_no_tokens():
    assert load_tokens(None, None) is None
    assert load_tokens(None, "") is None


def test_the_same_token_twice_with_the_same_role_is_one_token(tmp_path):
    tokens = load_tokens(token_file(tmp_path, f"admin {ADMIN}\nadmin {ADMIN}\n"), ADMIN)
    assert tokens is not None and tokens.role_of(ADMIN) is Role.ADMIN


def test_a_token_of_exactly_the_minimum_length_is_accepted(tmp_path):
    token = "x" * MIN_TOKEN_CHARS
    tokens = load_tokens(token_file(tmp_path, f"worker {token}\n"), None)
    assert tokens is not None and tokens.role_of(token) is Role.WORKER


SHORT = "x" * (MIN_TOKEN_CHARS - 1)

BAD_FILES = {
    "empty": ("", ["no token"]),
    "only comments and blank lines": ("# nothing here\n\n   \n# still nothing\n", ["no token"]),
    "short bare token": (f"{SHORT}\n", [f"at least {MIN_TOKEN_CHARS}"]),
    "short token with a role": (f"admin {ADMIN}\nworker {SHORT}\n", [f"{MIN_TOKEN_CHARS}"]),
    "unknown role": (f"admin {ADMIN}\nboss {WORKER}\n", ["not a role", ":2"]),
    "token longer than a hello allows": (f"admin {'L' * 257}\n", ["at most 256 bytes"]),
    "two roles for one token": (f"producer {PRODUCER}\nadmin {PRODUCER}\n", ["two roles"]),
    "bare line beside role lines": (f"admin {ADMIN}\n{WORKER}\n", ["ROLE TOKEN", ":2"]),
    "two bare lines": (f"{ADMIN}\n{WORKER}\n", ["ROLE TOKEN"]),
    "three fields": (f"# c\nadmin {ADMIN} extra\n", ["ROLE TOKEN", ":2"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_token_file_is_one_line_naming_the_file(tmp_path, case):
    text, fragments = BAD_FILES[case]
    path = token_file(tmp_path, text)
    with pytest.raises(AuthConfigError) as caught:
        load_tokens(path, None)
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message
    assert path in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_errors_do_not_repeat_the_tokens_they_refuse(tmp_path):
    wrong_way_round = f"{PRODUCER} producer\n{ADMIN} admin\n"
    for text in (f"{SHORT}\n", f"producer {PRODUCER}\nadmin {PRODUCER}\n", wrong_way_round):
        with pytest.raises(AuthConfigError) as caught:
            load_tokens(token_file(tmp_path, text), None)
        assert SHORT not in str(caught.value) and PRODUCER not in str(caught.value)


def test_file_and_env_giving_one_token_two_roles_is_refused(tmp_path):
    path = token_file(tmp_path, f"producer {PRODUCER}\n")
    with pytest.raises(AuthConfigError, match="two roles"):
        load_tokens(path, PRODUCER)


def test_a_short_env_token_is_refused_naming_the_variable():
    with pytest.raises(AuthConfigError, match="RELAY_AUTH_TOKEN") as caught:
        load_tokens(None, SHORT)
    assert f"at least {MIN_TOKEN_CHARS}" in str(caught.value)


@pytest.mark.parametrize("kind", ["missing", "directory", "not utf-8"])
def test_an_unreadable_token_file_is_one_line(tmp_path, kind):
    path = tmp_path / "tokens"
    if kind == "directory":
        path.mkdir()
    elif kind == "not utf-8":
        path.write_bytes(b"admin \xff\xfe" + b"x" * 20 + b"\n")
    with pytest.raises(AuthConfigError) as caught:
        load_tokens(str(path), ADMIN)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and "cannot read" in message


# -- looking tokens up ------------------------------------------------------------------------


def test_role_of_is_none_for_anything_but_a_configured_token(tmp_path):
    tokens = load_tokens(roles_file(tmp_path), None)
    assert tokens is not None
    for other in ("", "wrong-token-0123456789abcdef", ADMIN[:-1], ADMIN[:16], ADMIN + "x",
                  " " + ADMIN, ADMIN.upper(), f"admin {ADMIN}"):  # fmt: skip
        assert tokens.role_of(other) is None, other


def test_roles_and_the_op_they_need():
    assert Role.PRODUCER < Role.WORKER < Role.ADMIN
    assert [r.label for r in (Role.PRODUCER, Role.WORKER, Role.ADMIN)] == [
        "producer", "worker", "admin",
    ]  # fmt: skip
    expected = {
        "hello": Role.NONE,
        **dict.fromkeys(
            (
                "ping",
                "submit",
                "submit_batch",
                "inspect",
                "short_ids",
                "stats",
                "queue_list",
                "cancel",
                "schedule_list",
                "jobs_list",
                "history",
            ),
            Role.PRODUCER,
        ),
        **dict.fromkeys(
            (
                "lease",
                "renew",
                "ack",
                "ack_batch",
                "fail",
                "release",
                "watch",
                "unwatch",
                "workers_list",
            ),
            Role.WORKER,
        ),
        **dict.fromkeys(
            (
                "dead_list",
                "dead_retry",
                "dead_purge",
                "queue_pause",
                "queue_resume",
                "queue_config",
                "schedule_put",
                "schedule_delete",
                "schedule_pause",
                "schedule_resume",
                "reload",
                "promote",
            ),
            Role.ADMIN,
        ),
    }
    assert dict(OP_ROLES) == expected
    assert required_role("an_op_added_later") is Role.ADMIN


# -- the throttle of failed authentications -------------------------------------------------


def test_first_failures_are_free_then_the_delay_grows_to_the_cap():
    throttle = Throttle()
    delays = [throttle.failed("192.0.2.7:40000", "wrong token", 0.0) for _ in range(40)]
    assert delays[:FREE_FAILURES] == [0.0] * FREE_FAILURES
    slowed = delays[FREE_FAILURES:]
    assert slowed[0] == pytest.approx(FIRST_DELAY_S)
    assert slowed[1] > slowed[0]
    assert all(b >= a for a, b in itertools.pairwise(slowed))
    assert max(slowed) == pytest.approx(MAX_DELAY_S)
    assert slowed[-1] == pytest.approx(MAX_DELAY_S)
    assert throttle.failures_total == 40


def test_delays_are_per_host_whatever_the_port():
    throttle = Throttle()
    for port in range(FREE_FAILURES):
        assert throttle.failed(f"192.0.2.7:{40000 + port}", "wrong token", 1.0) == 0.0
    # Another port of the same host is the same guesser; another host is not.
    assert throttle.failed("192.0.2.7:50000", "wrong token", 1.0) >= FIRST_DELAY_S
    assert throttle.failed("192.0.2.8:40000", "wrong token", 1.0) == 0.0
    # IPv6 hosts keep their colons: two ports of one host count together.
    for port in range(FREE_FAILURES):
        assert throttle.failed(f"2001:db8::5:{port + 1}", "no token", 1.0) == 0.0
    assert throttle.failed("2001:db8::5:999", "no token", 1.0) >= FIRST_DELAY_S
    assert throttle.failed("2001:db8::6:999", "no token", 1.0) == 0.0
    assert throttle.failures_total == 2 * FREE_FAILURES + 4


def test_a_host_is_forgotten_forget_s_after_its_last_failure():
    throttle = Throttle()
    now = 100.0
    for _ in range(FREE_FAILURES + 2):
        throttle.failed("192.0.2.7:1", "wrong token", now)
    # Still remembered just within the window (counted from the last failure)...
    now += FORGET_S - 1
    assert throttle.failed("192.0.2.7:1", "wrong token", now) > 0.0
    # ... and that failure starts the window again.
    now += FORGET_S - 1
    assert throttle.failed("192.0.2.7:1", "wrong token", now) > 0.0
    now += FORGET_S + 1
    assert throttle.failed("192.0.2.7:1", "wrong token", now) == 0.0


def test_the_table_of_hosts_is_bounded_and_drops_the_oldest():
    def flood(others: int) -> float:
        """The next delay of a slowed host after ``others`` other hosts failed once."""
        throttle = Throttle()
        for _ in range(FREE_FAILURES + 3):
            throttle.failed("198.51.100.1:1", "wrong token", 0.0)
        for i in range(others):
            throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:1", "no token", 1.0)
        assert throttle.failures_total == FREE_FAILURES + 3 + others
        return throttle.failed("198.51.100.1:1", "wrong token", 2.0)

    assert flood(MAX_PEERS - 1) > 0.0  # still remembered: the table is not full
    assert flood(MAX_PEERS) == 0.0  # the oldest record made room for the newest


def test_failures_are_logged_without_any_token(caplog):
    throttle = Throttle()
    with caplog.at_level(logging.DEBUG, logger="relay.auth"):
        throttle.failed("192.0.2.7:1", "wrong token", 0.0)
    (record,) = [r for r in caplog.records if r.name == "relay.auth"]
    assert record.getMessage() == "auth.failed" and record.levelno == logging.WARNING
    assert record.fields["peer"] == "192.0.2.7:1"  # type: ignore[attr-defined]


# -- the metrics endpoint's bearer header ---------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"authorization", b"Bearer abc-def")], "abc-def"),
        ([(b"authorization", b"bearer abc-def")], "abc-def"),
        ([(b"authorization", b"BEARER  abc-def  ")], "abc-def"),
        ([(b"host", b"x"), (b"authorization", b"Bearer tok"), (b"accept", b"*/*")], "tok"),
        ([(b"authorization", b"Basic YWxhZGRpbjpvcGVu")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"authorization", b"Bearer    ")], None),
        ([(b"authorization", b"abc-def")], None),
        ([(b"x-authorization", b"Bearer tok")], None),
        ([], None),
    ],
)
def test_bearer_token(headers, expected):
    assert bearer_token(headers) == expected


async def test_bearer_guard_passes_any_role_and_slows_repeated_refusals(tmp_path, autojump_clock):
    tokens = load_tokens(roles_file(tmp_path), None)
    assert tokens is not None
    throttle = Throttle()
    guard = bearer_guard(tokens, throttle)
    peer = "192.0.2.9:5555"
    for token in (PRODUCER, WORKER, ADMIN):
        assert await guard([(b"authorization", f"Bearer {token}".encode())], peer) is True
    assert throttle.failures_total == 0
    for _ in range(FREE_FAILURES):
        start = trio.current_time()
        assert await guard([], peer) is False
        assert trio.current_time() == start  # answered at once
    start = trio.current_time()
    assert await guard([(b"authorization", b"Bearer wrong-token-0123456789")], peer) is False
    assert trio.current_time() - start == pytest.approx(FIRST_DELAY_S)
    assert throttle.failures_total == FREE_FAILURES + 1
    # A valid token still passes at once, whatever the peer's record.
    start = trio.current_time()
    assert await guard([(b"authorization", f"Bearer {PRODUCER}".encode())], peer) is True
    assert trio.current_time() == start


# -- listening beyond loopback ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.5.5.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host) is True


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "", "::", "[::]", "192.0.2.1", "10.0.0.1", "no-such-host.invalid"]
)
def test_hosts_that_are_not_only_loopback(host):
    assert is_loopback(host) is False


def test_exposure_without_tokens_is_refused_naming_the_address_and_both_ways_out():
    with pytest.raises(ExposureError) as caught:
        check_exposure([("jobs", "0.0.0.0"), ("metrics", "127.0.0.1")], None, False)
    message = str(caught.value)
    assert "\n" not in message
    assert "0.0.0.0" in message
    assert "--auth-token-file" in message and "RELAY_AUTH_TOKEN" in message
    assert "--insecure" in message


def test_an_exposed_metrics_listener_is_refused_too():
    with pytest.raises(ExposureError, match=r"192\.0\.2\.1"):
        check_exposure([("jobs", "127.0.0.1"), ("metrics", "192.0.2.1")], None, False)


def test_every_interface_is_named_as_0_0_0_0():
    with pytest.raises(ExposureError, match=r"0\.0\.0\.0"):
        check_exposure([("jobs", "")], None, False)


def test_exposure_allowed_with_insecure_returns_the_exposed_hosts():
    exposed = check_exposure([("jobs", "0.0.0.0"), ("metrics", "127.0.0.1")], None, True)
    assert exposed == ["0.0.0.0"]
    assert check_exposure([("jobs", ""), ("metrics", "192.0.2.1")], None, True) == [
        "0.0.0.0", "192.0.2.1",
    ]  # fmt: skip


def test_exposure_allowed_with_tokens():
    tokens = load_tokens(None, ADMIN)
    assert isinstance(tokens, Tokens)
    assert check_exposure([("jobs", "0.0.0.0"), ("metrics", "0.0.0.0")], tokens, False) == []


def test_loopback_only_needs_neither_tokens_nor_insecure():
    assert check_exposure([("jobs", "127.0.0.1"), ("metrics", "::1")], None, False) == []
    assert check_exposure([("jobs", "localhost")], None, False) == []


def test_a_token_file_is_exposed_to_others_to_a_group_not_the_servers_or_to_writers():
    own = os.getegid()
    assert not _exposed(0o600, own) and not _exposed(0o400, own)
    assert not _exposed(0o640, own) and not _exposed(0o440, own)  # root's, the service's group
    assert _exposed(0o640, own + 1) and _exposed(0o440, own + 1)  # a group of other users
    assert _exposed(0o620, own) and _exposed(0o660, own)  # its group may change it
    assert _exposed(0o604, own) and _exposed(0o602, own) and _exposed(0o644, own)
