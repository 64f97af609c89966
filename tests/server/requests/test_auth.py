"""Access control on a real server (127.0.0.1, port 0) through real sockets: roles and the
ops they may use, refused first requests (closed, counted, logged without the token, nothing
pipelined behind them run), re-authentication, slowing repeated failures, the hello
deadline, the refusal to listen beyond loopback without tokens, and the bearer token of the
metrics endpoint beyond loopback. Every wait is bounded."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from relay.server.requests import auth
from relay.server.requests.auth import FREE_FAILURES, OP_ROLES, ExposureError, Tokens, load_tokens
from relay.server.serve import ServerConfig, serve
from tests.server.conftest import BOUND_S, LineClient, RunningServer, start_server
from tests.worker.helpers import serving

PRODUCER = "producer-token-0123456789"
WORKER = "worker-token-0123456789ab"
ADMIN = "admin-token-0123456789abcd"
WRONG = "wrong-token-0123456789abcdef"
ALL_TOKENS = (PRODUCER, WORKER, ADMIN, WRONG)
TOKEN_OF = {"producer": PRODUCER, "worker": WORKER, "admin": ADMIN}


def make_tokens(tmp_path: Path) -> Tokens:
    path = tmp_path / "tokens"
    path.write_text(f"# test tokens\nproducer {PRODUCER}\nworker {WORKER}\nadmin {ADMIN}\n")
    tokens = load_tokens(str(path), None)
    assert tokens is not None
    return tokens


@pytest.fixture
def tokens(tmp_path) -> Tokens:
    return make_tokens(tmp_path)


@pytest.fixture
async def authed(tmp_path, tokens) -> AsyncIterator[RunningServer]:
    """A server with the three tokens; metrics on 127.0.0.1 (no token needed there)."""

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=tokens)

    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


@pytest.fixture
def logs(caplog, monkeypatch) -> pytest.LogCaptureFixture:
    """Every record of the ``relay`` loggers (also if relay.util.log.configure ran here)."""
    monkeypatch.setattr(logging.getLogger("relay"), "propagate", True)
    caplog.set_level(logging.DEBUG)
    return caplog


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record's message and structured fields."""
    return "\n".join(
        f"{r.name} {r.getMessage()} {getattr(r, 'fields', {})!r} {r.args!r}" for r in caplog.records
    )


def assert_no_token_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    text = log_text(caplog)
    for token in ALL_TOKENS:
        assert token not in text, token


async def authenticate(server: RunningServer, token: str) -> LineClient:
    client = await server.connect()
    await client.ok("hello", token=token)
    return client


async def http_get(
    address: tuple[str, int], path: str = "/metrics", authorization: str | None = None
) -> tuple[int, bytes, bytes]:
    """GET ``path``: (status, head, body)."""
    host, port = address
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    lines = [f"GET {path} HTTP/1.0", "Host: localhost"]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def sample(metrics: bytes, name: str) -> float | None:
    for line in metrics.decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


async def auth_failures(server: RunningServer, authorization: str | None = None) -> float | None:
    assert server.handle.metrics_address is not None
    status, _, body = await http_get(server.handle.metrics_address, authorization=authorization)
    assert status == 200, body
    return sample(body, "relay_auth_failures_total")


async def assert_refused_and_closed(client: LineClient) -> dict[str, Any]:
    """The next line is an unauthorized error, and then the connection ends."""
    line = await client.read_line()
    assert line is not None, "closed without an answer"
    reply = orjson.loads(line)
    assert reply["ok"] is False and reply["error"]["code"] == "unauthorized", reply
    assert await client.at_eof()
    return reply


# -- roles ------------------------------------------------------------------------------------

JOB = "job_0000000000000000000000000000"  # no such job
REQUESTS: dict[str, Callable[[str], dict[str, Any]]] = {
    "hello": lambda token: {"token": token, "client": "test"},
    "ping": lambda token: {},
    "submit": lambda token: {"queue": "q", "payload": 1},
    "submit_batch": lambda token: {"jobs": [{"queue": "q", "payload": 1}]},
    "inspect": lambda token: {"job_id": JOB},
    "short_ids": lambda token: {"job_ids": ["job_0000000000000001"]},
    "stats": lambda token: {},
    "lease": lambda token: {"queues": ["q"], "worker_id": "w", "wait_ms": 0},
    "renew": lambda token: {"job_id": JOB, "worker_id": "w", "token": "t"},
    "ack": lambda token: {"job_id": JOB, "worker_id": "w", "token": "t"},
    "ack_batch": lambda token: {"worker_id": "w", "acks": [{"job_id": JOB, "token": "t"}]},
    "fail": lambda token: {"job_id": JOB, "worker_id": "w", "token": "t", "error": "x"},
    "release": lambda token: {"job_id": JOB, "worker_id": "w", "token": "t"},
    "dead_list": lambda token: {},
    "dead_retry": lambda token: {"job_id": JOB},
    "dead_purge": lambda token: {"job_id": JOB},
    "cancel": lambda token: {"job_id": JOB},
    "jobs_list": lambda token: {"queue": "q"},
    "promote": lambda token: {"job_id": JOB},
    "watch": lambda token: {"queues": ["q"]},
    "unwatch": lambda token: {},
    "queue_pause": lambda token: {"queue": "q"},
    "queue_resume": lambda token: {"queue": "q"},
    "queue_list": lambda token: {},
    "queue_config": lambda token: {"queue": "q", "max_leased": 5},
    "schedule_put": lambda token: {"name": "s", "cron": "@daily", "queue": "q", "payload": 1},
    "schedule_delete": lambda token: {"name": "s"},
    "schedule_pause": lambda token: {"name": "s"},
    "schedule_resume": lambda token: {"name": "s"},
    "schedule_list": lambda token: {},
    "reload": lambda token: {},
    "workers_list": lambda token: {},
    "history": lambda token: {"queue": "q"},
}
PRODUCER_OPS = {
    "hello", "ping", "submit", "submit_batch", "inspect", "short_ids", "stats", "queue_list",
    "cancel", "schedule_list", "jobs_list", "history",
}  # fmt: skip
WORKER_OPS = PRODUCER_OPS | {
    "lease", "renew", "ack", "ack_batch", "fail", "release", "watch", "unwatch",
    "workers_list",
}  # fmt: skip
ADMIN_OPS = WORKER_OPS | {
    "dead_list", "dead_retry", "dead_purge", "queue_pause", "queue_resume", "queue_config",
    "schedule_put", "schedule_delete", "schedule_pause", "schedule_resume", "reload",
    "promote",
}  # fmt: skip
ALLOWED = {"producer": PRODUCER_OPS, "worker": WORKER_OPS, "admin": ADMIN_OPS}


def test_the_matrix_covers_every_op():
    assert set(REQUESTS) == set(OP_ROLES) == ADMIN_OPS
    assert len(REQUESTS) == 33


@pytest.mark.parametrize("op", list(REQUESTS))
@pytest.mark.parametrize("role", list(ALLOWED))
async def test_a_role_may_use_its_ops_and_is_refused_the_others(authed, role, op):
    client = await authenticate(authed, TOKEN_OF[role])
    reply = await client.request(op, **REQUESTS[op](TOKEN_OF[role]))
    if op in ALLOWED[role]:
        # Allowed: answered by the op itself (not_found for a made-up job is fine).
        assert reply["ok"] or reply["error"]["code"] != "unauthorized", reply
    else:
        assert reply["ok"] is False and reply["error"]["code"] == "unauthorized", reply
    # Either way the connection stays open and keeps its role.
    await client.ok("ping")
    assert (await client.ok("hello", token=TOKEN_OF[role]))["role"] == role
    await client.aclose()


@pytest.mark.parametrize("role", list(ALLOWED))
async def test_the_hello_reply_carries_the_role(authed, role):
    client = await authed.connect()
    reply = await client.ok("hello", token=TOKEN_OF[role])
    assert reply["role"] == role
    assert reply["server"] == "relay-trio" and reply["protocol"] == 1
    await client.aclose()


async def test_a_refused_op_changes_nothing(authed):
    admin = await authenticate(authed, ADMIN)
    job_id = (await admin.ok("submit", queue="q", payload=1))["job_id"]
    producer = await authenticate(authed, PRODUCER)
    error = await producer.error("lease", queues=["q"], worker_id="w", wait_ms=0)
    assert error["code"] == "unauthorized"
    worker = await authenticate(authed, WORKER)
    leased = (await worker.ok("lease", queues=["q"], worker_id="w", lease_ms=60_000))["jobs"]
    assert [job["job_id"] for job in leased] == [job_id]
    (job,) = leased
    await worker.ok("fail", job_id=job_id, worker_id="w", token=job["token"], error="x",
                    retryable=False)  # fmt: skip
    error = await worker.error("dead_purge", job_id=job_id)
    assert error["code"] == "unauthorized"
    assert (await admin.ok("inspect", job_id=job_id))["job"]["state"] == "dead"
    assert (await admin.ok("dead_purge", job_id=job_id))["count"] == 1
    for c in (admin, producer, worker):
        await c.aclose()


async def test_only_an_admin_pauses_a_queue_and_a_refused_pause_changes_nothing(authed):
    admin = await authenticate(authed, ADMIN)
    job_id = (await admin.ok("submit", queue="q", payload=1))["job_id"]
    for token in (PRODUCER, WORKER):
        other = await authenticate(authed, token)
        for op in ("queue_pause", "queue_resume"):
            error = await other.error(op, queue="q")
            assert error["code"] == "unauthorized" and "admin" in error["message"], error
        # Any role may list the queues, as it may read stats.
        (listed,) = (await other.ok("queue_list"))["queues"]
        assert (listed["queue"], listed["paused"]) == ("q", False)
        await other.aclose()
    worker = await authenticate(authed, WORKER)
    leased = (await worker.ok("lease", queues=["q"], worker_id="w"))["jobs"]
    assert [job["job_id"] for job in leased] == [job_id]
    assert (await admin.ok("queue_pause", queue="q"))["paused"] is True


async def test_every_token_the_config_accepts_can_say_hello(tmp_path):
    long_token = "L" * 300  # e.g. from `openssl rand -hex 150`
    path = tmp_path / "long-tokens"
    path.write_text(f"admin {long_token}\n")
    try:
        tokens = load_tokens(str(path), None)
    except auth.AuthConfigError:
        return  # refusing it at start-up, with one line, would be fine too
    async with serving(
        lambda nursery, db: start_server(nursery, db, tokens=tokens), str(tmp_path / "relay.db")
    ) as server:
        client = await server.connect()
        reply = await client.request("hello", token=long_token)
        await client.aclose()
    assert reply["ok"] is True and reply["role"] == "admin", reply


# -- a first request that is not a valid hello -------------------------------------------------

REFUSED_FIRST: dict[str, bytes] = {
    "ping without hello": b'{"op":"ping","id":1}\n',
    "submit without hello": b'{"op":"submit","id":1,"queue":"q","payload":1}\n',
    "wrong token": orjson.dumps({"op": "hello", "id": 1, "token": WRONG}) + b"\n",
    "hello without a token": b'{"op":"hello","id":1,"client":"x"}\n',
    "empty token": b'{"op":"hello","id":1,"token":""}\n',
    "token that is not a string": b'{"op":"hello","id":1,"token":12345678901234567890}\n',
    "a prefix of a valid token": orjson.dumps({"op": "hello", "id": 1, "token": ADMIN[:-1]})
    + b"\n",
    "invalid JSON": f'{{"op":"hello","id":1,"token":"{WRONG}"\n'.encode(),
    "not an object": b"[1, 2, 3]\n",
    "unknown op": b'{"op":"frobnicate","id":1}\n',
}


@pytest.mark.parametrize("case", list(REFUSED_FIRST))
async def test_a_first_request_that_is_not_a_valid_hello_is_refused_and_closed(authed, logs, case):
    assert await auth_failures(authed) == 0
    client = await authed.connect()
    await client.send_raw(REFUSED_FIRST[case])
    await assert_refused_and_closed(client)
    await client.aclose()
    assert await auth_failures(authed) == 1
    # Logged (by relay.auth), and never with a token.
    assert any(r.name == "relay.auth" and r.getMessage() == "auth.failed" for r in logs.records)
    assert_no_token_in_logs(logs)
    status, _, body = await http_get(authed.handle.metrics_address)  # type: ignore[arg-type]
    assert status == 200
    for token in ALL_TOKENS:
        assert token.encode() not in body


SUBMIT = {"op": "submit", "queue": "q", "payload": 1}
PIPELINED = {
    "wrong hello, then submit": [{"op": "hello", "token": WRONG}, SUBMIT],
    "submit, then submit": [SUBMIT, SUBMIT],
    "wrong hello, valid hello, submit": [
        {"op": "hello", "token": WRONG},
        {"op": "hello", "token": ADMIN},
        SUBMIT,
    ],
    "ping, valid hello, submit_batch": [
        {"op": "ping"},
        {"op": "hello", "token": ADMIN},
        {"op": "submit_batch", "jobs": [{"queue": "q", "payload": 2}]},
    ],
}


@pytest.mark.parametrize("case", list(PIPELINED))
async def test_nothing_pipelined_behind_a_refused_first_request_runs(authed, case):
    requests = PIPELINED[case]
    data = b"".join(orjson.dumps({"id": i, **r}) + b"\n" for i, r in enumerate(requests, 1))
    client = await authed.connect()
    await client.send_raw(data)  # one write
    reply = await assert_refused_and_closed(client)  # one answer, then the end
    assert reply["id"] == 1
    await client.aclose()
    admin = await authenticate(authed, ADMIN)
    stats = await admin.ok("stats")
    assert stats["queues"] == {}, stats
    assert await auth_failures(authed) == 1
    await admin.aclose()


# -- hello again ----------------------------------------------------------------------------


async def test_a_later_hello_with_a_valid_token_changes_the_role(authed):
    client = await authenticate(authed, PRODUCER)
    assert (await client.error("lease", queues=["q"], worker_id="w"))["code"] == "unauthorized"
    assert (await client.ok("hello", token=WORKER))["role"] == "worker"
    assert (await client.ok("lease", queues=["q"], worker_id="w"))["jobs"] == []
    assert (await client.error("dead_list"))["code"] == "unauthorized"
    # Down as well as up.
    assert (await client.ok("hello", token=PRODUCER))["role"] == "producer"
    assert (await client.error("lease", queues=["q"], worker_id="w"))["code"] == "unauthorized"
    assert await auth_failures(authed) == 0
    await client.aclose()


@pytest.mark.parametrize("token", [WRONG, None])
async def test_a_later_hello_without_a_valid_token_ends_the_connection(authed, logs, token):
    client = await authenticate(authed, ADMIN)
    await client.ok("submit", queue="q", payload=1)
    fields = {} if token is None else {"token": token}
    # The requests after it in the same write do not run.
    data = orjson.dumps({"op": "hello", "id": 7, **fields}) + b"\n"
    data += b'{"op":"dead_purge","id":8,"queue":"q","all":true}\n'
    data += b'{"op":"submit","id":9,"queue":"q","payload":2}\n'
    await client.send_raw(data)
    reply = await assert_refused_and_closed(client)
    assert reply["id"] == 7
    await client.aclose()
    assert await auth_failures(authed) == 1
    admin = await authenticate(authed, ADMIN)
    assert (await admin.ok("stats"))["queues"]["q"]["ready"] == 1
    await admin.aclose()
    assert_no_token_in_logs(logs)


async def test_replies_owed_before_a_refused_hello_are_still_sent(authed):
    client = await authenticate(authed, WORKER)
    # A long-poll is parked when the bad hello arrives: it is answered, then the refusal.
    await client.send("lease", queues=["q"], worker_id="w", wait_ms=200)
    await client.send("hello", token=WRONG)
    first = await client.read()
    assert first["id"] == 2 and first["ok"] is True and first["jobs"] == []
    await assert_refused_and_closed(client)
    await client.aclose()


# -- slowing guessers -------------------------------------------------------------------------

DELAY_S = 1.0


async def refusal_time(
    server: RunningServer, local_address: str | None = None, sent: trio.Event | None = None
) -> float:
    """How long a wrong hello takes to be answered (unauthorized, then closed)."""
    host, port = server.handle.address
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream(host, port, local_address=local_address)
    client = LineClient(stream)
    start = trio.current_time()
    await client.send("hello", token=WRONG)
    if sent is not None:
        sent.set()
    line = await client.read_line()
    elapsed = trio.current_time() - start
    assert line is not None and orjson.loads(line)["error"]["code"] == "unauthorized"
    assert await client.at_eof()
    await client.aclose()
    return elapsed


async def test_repeated_failures_of_one_host_are_slowed_and_others_are_not(authed, monkeypatch):
    monkeypatch.setattr(auth, "FIRST_DELAY_S", DELAY_S)
    monkeypatch.setattr(auth, "MAX_DELAY_S", DELAY_S)
    for _ in range(FREE_FAILURES):
        assert await refusal_time(authed) < DELAY_S
    timings: dict[str, float] = {}
    sent = trio.Event()

    async def slowed() -> None:
        timings["slowed"] = await refusal_time(authed, sent=sent)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slowed)
        with trio.fail_after(BOUND_S):
            await sent.wait()  # its hello is on its way (and waits for its answer)
        # Meanwhile the server answers others at once: another host's failure, and a
        # valid client.
        timings["other host"] = await refusal_time(authed, local_address="127.0.0.2")
        start = trio.current_time()
        client = await authenticate(authed, PRODUCER)
        await client.ok("ping")
        timings["valid client"] = trio.current_time() - start
        await client.aclose()
        assert "slowed" not in timings, timings
    assert DELAY_S <= timings["slowed"] < DELAY_S + BOUND_S / 2, timings
    assert timings["other host"] < DELAY_S and timings["valid client"] < DELAY_S, timings
    assert await auth_failures(authed) == FREE_FAILURES + 2


# -- the hello deadline ---------------------------------------------------------------------

HELLO_TIMEOUT_S = 0.3


@pytest.fixture
async def hurried(tmp_path, tokens) -> AsyncIterator[RunningServer]:
    """The server with tokens, and a hello timeout of HELLO_TIMEOUT_S."""

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        timeout_ms = int(HELLO_TIMEOUT_S * 1000)
        return await start_server(nursery, db, tokens=tokens, hello_timeout_ms=timeout_ms)

    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


async def test_a_connection_that_says_nothing_is_closed_after_the_hello_timeout(hurried):
    start = trio.current_time()
    silent = await hurried.connect()
    partial = await hurried.connect()
    await partial.send_raw(b'{"op":"hello","tok')  # a line that never ends
    assert await silent.at_eof()
    assert await partial.at_eof()
    assert HELLO_TIMEOUT_S <= trio.current_time() - start < HELLO_TIMEOUT_S + BOUND_S / 2
    for c in (silent, partial):
        await c.aclose()


async def test_an_authenticated_connection_outlives_the_hello_timeout(hurried):
    client = await authenticate(hurried, PRODUCER)
    await trio.sleep(HELLO_TIMEOUT_S * 2)
    await client.ok("ping")
    await client.aclose()


async def test_without_tokens_a_silent_connection_is_not_closed(tmp_path):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, hello_timeout_ms=int(HELLO_TIMEOUT_S * 1000))

    async with serving(start, str(tmp_path / "relay.db")) as server:
        client = await server.connect()
        await trio.sleep(HELLO_TIMEOUT_S * 2)
        await client.ok("ping")
        await client.aclose()


# -- without tokens -------------------------------------------------------------------------


async def test_without_tokens_no_hello_is_needed_and_every_op_is_allowed(server):
    client = await server.connect()
    await client.ok("ping")
    await client.ok("submit", queue="q", payload=1)
    assert (await client.ok("dead_list"))["jobs"] == []
    reply = await client.ok("hello")
    assert reply["role"] == "admin"
    # A client that brings a token anyway is welcome.
    assert (await client.ok("hello", token=WRONG))["role"] == "admin"
    await client.ok("dead_purge", queue="q", all=True)
    await client.aclose()


# -- listening beyond loopback ----------------------------------------------------------------


async def test_serve_on_every_interface_without_tokens_refuses_before_starting(tmp_path):
    db = tmp_path / "relay.db"
    config = ServerConfig(db=str(db), host="0.0.0.0", port=0, metrics_port=None)
    with trio.fail_after(BOUND_S), pytest.raises(ExposureError) as caught:
        await serve(config)
    assert "0.0.0.0" in str(caught.value) and "--insecure" in str(caught.value)
    assert not db.exists()


async def test_serve_with_metrics_on_every_interface_without_tokens_refuses(tmp_path):
    db = tmp_path / "relay.db"
    config = ServerConfig(db=str(db), host="127.0.0.1", port=0, metrics_host="0.0.0.0",
                          metrics_port=0)  # fmt: skip
    with trio.fail_after(BOUND_S), pytest.raises(ExposureError, match="metrics"):
        await serve(config)
    assert not db.exists()


async def test_serve_on_every_interface_with_insecure_starts_and_warns(tmp_path, logs):
    config = ServerConfig(db=str(tmp_path / "relay.db"), host="0.0.0.0", port=0,
                          metrics_port=None, insecure=True)  # fmt: skip
    async with trio.open_nursery() as nursery:
        with trio.fail_after(BOUND_S):
            handle = await nursery.start(serve, config)
        try:
            with trio.fail_after(BOUND_S):
                stream = await trio.open_tcp_stream("127.0.0.1", handle.address[1])
            client = LineClient(stream)
            await client.ok("ping")  # no hello needed
            await client.aclose()
        finally:
            handle.shutdown()
    warnings = [r for r in logs.records if r.getMessage() == "server.insecure"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert warnings[0].fields["host"] == "0.0.0.0"  # type: ignore[attr-defined]


async def test_serve_on_every_interface_with_tokens_starts_and_needs_a_hello(
    tmp_path, tokens, logs
):
    config = ServerConfig(db=str(tmp_path / "relay.db"), host="0.0.0.0", port=0,
                          metrics_port=None, tokens=tokens)  # fmt: skip
    async with trio.open_nursery() as nursery:
        with trio.fail_after(BOUND_S):
            handle = await nursery.start(serve, config)
        try:
            port = handle.address[1]
            with trio.fail_after(BOUND_S):
                refused = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
                client = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
            await refused.send("ping")
            await assert_refused_and_closed(refused)
            assert (await client.ok("hello", token=WORKER))["role"] == "worker"
            for c in (refused, client):
                await c.aclose()
        finally:
            handle.shutdown()
    assert "server.insecure" not in [r.getMessage() for r in logs.records]


# -- /metrics, /healthz and /livez ---------------------------------------------------------


@pytest.fixture
async def exposed_metrics(tmp_path, tokens, monkeypatch) -> AsyncIterator[RunningServer]:
    """A server with tokens and its metrics endpoint on every interface."""
    monkeypatch.setattr(auth, "FREE_FAILURES", 100)  # the refusals here are not slowed

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=tokens, metrics_host="0.0.0.0")

    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


async def test_metrics_beyond_loopback_need_a_bearer_token(exposed_metrics, logs):
    address = exposed_metrics.handle.metrics_address
    assert address is not None
    refusals = [
        ("/metrics", f"Bearer {WRONG}"),  # first: failures are logged in summary
        ("/metrics", None),
        ("/healthz", None),
        ("/healthz", f"Bearer {WRONG}"),
        ("/livez", None),
        ("/metrics", f"Basic {ADMIN}"),
        ("/metrics", "Bearer"),
        ("/nowhere", None),
    ]
    for path, authorization in refusals:
        status, head, body = await http_get(address, path, authorization)
        assert status == 401, (path, authorization, head, body)
        assert b"relay_" not in body and b"#" not in body, body
        assert len(body) < 40, body
        for token in ALL_TOKENS:
            assert token.encode() not in head + body
    for token in (PRODUCER, WORKER, ADMIN):
        for path in ("/healthz", "/livez"):
            status, _, body = await http_get(address, path, f"Bearer {token}")
            assert status == 200, (path, body)
    status, _, body = await http_get(address, "/metrics", f"Bearer {PRODUCER}")
    assert status == 200
    assert sample(body, "relay_auth_failures_total") == len(refusals)
    assert sample(body, "relay_connections") is not None
    for token in ALL_TOKENS:
        assert token.encode() not in body
    assert_no_token_in_logs(logs)
    assert any(r.name == "relay.auth" for r in logs.records)


async def test_hello_and_metrics_failures_count_together(exposed_metrics):
    address = exposed_metrics.handle.metrics_address
    assert address is not None
    client = await exposed_metrics.connect()
    await client.send("hello", token=WRONG)
    await assert_refused_and_closed(client)
    await client.aclose()
    assert (await http_get(address))[0] == 401
    assert await auth_failures(exposed_metrics, f"Bearer {ADMIN}") == 2


async def test_metrics_on_loopback_need_no_token_even_with_tokens(authed):
    address = authed.handle.metrics_address
    assert address is not None
    status, _, body = await http_get(address, "/metrics")
    assert status == 200 and sample(body, "relay_auth_failures_total") == 0
    assert (await http_get(address, "/healthz"))[0] == 200


def test_the_roles_table_of_the_protocol_names_each_op_once_in_its_roles_row():
    """docs/protocol.md's table of roles says what the server enforces (``OP_ROLES``):
    each op in the row of the least role that may use it (``cancel`` also in admin's, for
    a leased job or a whole queue), no row twice."""
    text = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()
    table = text[text.index("| role | ops |") :].split("\n\n", 1)[0].splitlines()[2:]
    rows = [line.split(" | ", 1) for line in table]
    roles = [role.strip("| `") for role, _ in rows]
    assert roles == ["producer", "worker", "admin"], roles
    listed = {
        role: set(re.findall(r"`([a-z_]+)`", ops))
        for role, (_, ops) in zip(roles, rows, strict=True)
    }
    expected = {
        role: {
            op
            for op, r in OP_ROLES.items()
            if r.label == role or (op, role) == ("hello", "producer")
        }
        for role in roles
    }
    expected["admin"].add("cancel")
    assert listed == expected
