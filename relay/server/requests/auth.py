"""Access control: tokens with roles, which op each role may use, and slowing guessers.

Tokens come from a file (``ROLE TOKEN`` per line, or one bare token meaning ``admin``) and
from ``RELAY_AUTH_TOKEN`` (one ``admin`` token), never from the command line. With any
token configured, a connection starts with no role: its first request must be a ``hello``
with a valid token, which gives the token's role. Without tokens every connection is
``admin``, as if authenticated (loopback-only unless ``--insecure``, see
``check_exposure``).

Roles include the ones below them: ``producer`` < ``worker`` < ``admin``. An op not named
in ``OP_ROLES`` (one added later) needs ``admin`` unless its docs say otherwise.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs
import trio

from relay.util.log import Summary, event

log = logging.getLogger("relay.auth")

MIN_TOKEN_CHARS = 16
# A hello's token is at most max_id_bytes (256) bytes of UTF-8: a longer one could never
# be said, so it is refused at start.
MAX_TOKEN_BYTES = 256
# A failed hello is answered at once for the first few failures of a peer (a client with
# the wrong token gets its error promptly); after that, each costs a delay that doubles up
# to the cap. A peer's record is forgotten FORGET_S after its last failure.
FREE_FAILURES = 3
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
FORGET_S = 600.0
# Peers remembered at once; the oldest record goes first (a flood from many addresses
# cannot grow the table).
MAX_PEERS = 10_000


class Role(enum.IntEnum):
    NONE = 0  # not authenticated: only hello
    PRODUCER = 1
    WORKER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


OP_ROLES: dict[str, Role] = {
    "hello": Role.NONE,
    "ping": Role.PRODUCER,
    "submit": Role.PRODUCER,
    "submit_batch": Role.PRODUCER,
    "inspect": Role.PRODUCER,
    "short_ids": Role.PRODUCER,  # (an extension: the abbreviations inspect takes back)
    "stats": Role.PRODUCER,
    "lease": Role.WORKER,
    "renew": Role.WORKER,
    "ack": Role.WORKER,
    "ack_batch": Role.WORKER,
    "fail": Role.WORKER,
    "release": Role.WORKER,
    "watch": Role.WORKER,
    # (an extension: the connected workers, with their addresses: not for producers)
    "workers_list": Role.WORKER,
    "unwatch": Role.WORKER,
    "dead_list": Role.ADMIN,
    "dead_retry": Role.ADMIN,
    "dead_purge": Role.ADMIN,
    # Extensions: pausing is an admin's; the list shows what stats shows, and the pauses.
    "queue_pause": Role.ADMIN,
    "queue_resume": Role.ADMIN,
    "queue_list": Role.PRODUCER,
    "queue_config": Role.ADMIN,
    # Extensions: a schedule submits jobs on its own, for as long as it lasts: an admin's;
    # the list shows what stats and inspect show.
    "schedule_put": Role.ADMIN,
    "schedule_delete": Role.ADMIN,
    "schedule_pause": Role.ADMIN,
    "schedule_resume": Role.ADMIN,
    "schedule_list": Role.PRODUCER,
    # (an extension) Counts per minute: what stats shows, over time.
    "history": Role.PRODUCER,
    # (an extension) A producer may cancel one job that has not started; a leased job, or
    # a whole queue, needs admin: the handler checks (relay/server/requests/admin.py).
    "cancel": Role.PRODUCER,
    # (an extension) Reading the token file and the TLS pair again: an admin's.
    "reload": Role.ADMIN,
    # Extensions: the job browser shows what inspect and stats show; a promote changes
    # when a job runs: an admin's.
    "jobs_list": Role.PRODUCER,
    "promote": Role.ADMIN,
}

ROLES_BY_NAME = {role.label: role for role in Role if role is not Role.NONE}


def required_role(op: str) -> Role:
    return OP_ROLES.get(op, Role.ADMIN)


class AuthConfigError(Exception):
    """The tokens cannot be used; the server does not start. The message is one line."""


def _digest(token: str) -> bytes:
    # Compared as digests: every comparison then takes the same time whatever the lengths.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@attrs.frozen
class Tokens:
    """The configured tokens, kept as digests with their roles."""

    entries: tuple[tuple[bytes, Role], ...]

    def role_of(self, token: str) -> Role | None:
        """The role of ``token``, or None. Compares with every configured token, without
        stopping at a match, so the time taken says nothing about which one matched."""
        candidate = _digest(token)
        found: Role | None = None
        for digest, role in self.entries:
            if hmac.compare_digest(candidate, digest):
                found = role
        return found

    def role_of_digest(self, digest: bytes) -> Role | None:
        """The role of the token whose digest is ``digest``, or None (a token removed by a
        reload: relay/server/reload.py). Not for a client's token: see ``role_of``."""
        for known, role in self.entries:
            if known == digest:
                return role
        return None

    def __len__(self) -> int:
        return len(self.entries)


def parse_token_file(text: str, source: str) -> list[tuple[str, Role]]:
    """The (token, role) pairs of a token file's text. ``source`` names it in errors."""
    lines = [
        (n, line.split())
        for n, raw in enumerate(text.splitlines(), 1)
        if (line := raw.strip()) and not line.startswith("#")
    ]
    if not lines:
        raise AuthConfigError(f"{source}: no token in the file")
    if len(lines) == 1 and len(lines[0][1]) == 1:
        return [(lines[0][1][0], Role.ADMIN)]  # one bare token: admin
    pairs = []
    for n, fields in lines:
        if len(fields) != 2:
            raise AuthConfigError(
                f"{source}:{n}: expected 'ROLE TOKEN' (roles: {', '.join(ROLES_BY_NAME)})"
            )
        role = ROLES_BY_NAME.get(fields[0])
        if role is None:
            # Not quoted: a line written the wrong way round would show its token.
            raise AuthConfigError(
                f"{source}:{n}: the first field is not a role (roles: {', '.join(ROLES_BY_NAME)})"
            )
        pairs.append((fields[1], role))
    return pairs


def _exposed(mode: int, group: int) -> bool:
    """Whether users other than the server's may read or write a token file of ``mode``
    owned by ``group``: others may, or its group may write, or read when it is not the
    server's own group. (Root's file, 0640, of the service's group, which docs/operations.md
    installs, lets the server read its tokens and not change them.)"""
    return bool(mode & 0o026) or (bool(mode & 0o040) and group != os.getegid())


def load_tokens(path: str | None, env_token: str | None) -> Tokens | None:
    """The tokens of the file at ``path`` and of ``env_token`` (the value of
    RELAY_AUTH_TOKEN; empty counts as unset), or None if neither gives any."""
    pairs: list[tuple[str, Role, str]] = []
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
                info = os.fstat(f.fileno())
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read the token file {path}: {exc}") from None
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISREG(info.st_mode) and _exposed(mode, info.st_gid):  # (not a pipe's)
            event(
                log, logging.WARNING, "auth.token_file_exposed", path=path, mode=f"{mode:04o}",
                message=f"the token file {path} may be read or written by other users "
                f"(mode {mode:04o}): chmod 600 it, or 640 with the server's group",
            )  # fmt: skip
        pairs += [(token, role, path) for token, role in parse_token_file(text, path)]
    if env_token:
        pairs.append((env_token, Role.ADMIN, "RELAY_AUTH_TOKEN"))
    if not pairs:
        return None
    return _checked(pairs)


def _checked(pairs: Iterable[tuple[str, Role, str]]) -> Tokens:
    roles: dict[str, Role] = {}
    for token, role, source in pairs:
        if len(token) < MIN_TOKEN_CHARS:
            raise AuthConfigError(
                f"{source}: a token must be at least {MIN_TOKEN_CHARS} characters "
                f"(one of {len(token)} found)"
            )
        if len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN_BYTES:
            raise AuthConfigError(
                f"{source}: a token must be at most {MAX_TOKEN_BYTES} bytes (a hello's limit)"
            )
        if roles.get(token, role) is not role:
            raise AuthConfigError(f"{source}: one token is given two roles")
        roles[token] = role
    return Tokens(tuple((_digest(token), role) for token, role in roles.items()))


class Throttle:
    """Counts and logs failed authentications (never with the token), per peer host, and
    says how long to delay the answer to the next one. Trio clock; bounded memory."""

    def __init__(self) -> None:
        self.failures_total = 0
        self._peers: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._logged = Summary()  # logged in summary: guessers come in floods

    def failed(self, peer: str, reason: str, now: float) -> float:
        """Record a failure of ``peer`` ("host:port") at ``now``; the seconds to wait
        before answering it."""
        self.failures_total += 1
        delay = self._delay(peer_host(peer), now)
        if n := self._logged.count(now):
            event(log, logging.WARNING, "auth.failed", peer=peer, reason=reason, failures=n,
                  delay_ms=round(delay * 1000))  # fmt: skip
        return delay

    def _delay(self, host: str, now: float) -> float:
        count, last = self._peers.pop(host, (0, now))
        if now - last > FORGET_S:
            count = 0
        count += 1
        self._peers[host] = (count, now)
        if len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        if count <= FREE_FAILURES:
            return 0.0
        doublings = min(count - FREE_FAILURES - 1, 16)
        return min(FIRST_DELAY_S * 2**doublings, MAX_DELAY_S)


def peer_host(peer: str) -> str:
    """The host part of a ``host:port`` peer name (IPv6 hosts keep their colons)."""
    return peer.rsplit(":", 1)[0]


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (h11's lower-cased names)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def bearer_guard(tokens: Tokens | Callable[[], Tokens | None], throttle: Throttle):
    """An ``authorize`` for the metrics endpoint (relay/server/http/metrics.py): a request
    passes with ``Authorization: Bearer TOKEN`` of any role; a refusal counts as a failed
    authentication, and is slowed like one. ``tokens`` may be a function that gives the
    tokens in force (they change when the token file is reloaded)."""

    async def authorize(headers: Iterable[tuple[bytes, bytes]], peer: str) -> bool:
        token = bearer_token(headers)
        current = tokens() if callable(tokens) else tokens
        if token is not None and current is not None and current.role_of(token) is not None:
            return True
        reason = "metrics without a token" if token is None else "metrics with a wrong token"
        await trio.sleep(throttle.failed(peer, reason, trio.current_time()))
        return False

    return authorize


# -- listening openly -----------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means only loopback addresses: 127.0.0.0/8
    and ::1. A name is resolved; one that resolves to anything else, or not at all, is
    not loopback. The empty host (every interface) is not."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses
    )


class ExposureError(Exception):
    """A listener would be reachable from other machines with no token configured."""


def check_exposure(
    listeners: Iterable[tuple[str, str]], tokens: Tokens | None, insecure: bool
) -> list[str]:
    """Refuse (ExposureError, one line) to listen on a non-loopback address without a
    token, unless ``insecure``. ``listeners`` are (what, host) pairs. Returns the exposed
    hosts that ``insecure`` allowed, for the caller to warn about."""
    if tokens is not None:
        return []
    exposed = [(what, host) for what, host in listeners if not is_loopback(host)]
    if exposed and not insecure:
        what, host = exposed[0]
        raise ExposureError(
            f"refusing to listen on {host or '0.0.0.0'} ({what}) without access control: "
            "configure tokens (--auth-token-file or RELAY_AUTH_TOKEN), or pass --insecure "
            "to accept that anyone who can reach the port may use it"
        )
    return [host or "0.0.0.0" for _, host in exposed]
