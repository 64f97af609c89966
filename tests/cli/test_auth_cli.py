"""The relay-trio console script with access control: client commands take their token
from RELAY_AUTH_TOKEN or --token-file (never from argv) and a server with tokens refuses
them without one; ``relay-trio server`` refuses a bad token file and an exposed address
without tokens, each with one line. Commands run as subprocesses; every wait is bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import click
import pytest
import trio

from relay import JobState, open_client
from relay.client.client import Client
from relay.server.requests.auth import load_tokens
from relay_cli.options import read_client_token
from tests.server.conftest import RunningServer, start_server
from tests.server.test_process import server_process
from tests.worker.helpers import serving, wait_for_state

from .conftest import Result, address_of, assert_one_line_error, cli_env, relay_trio
from .test_commands import run_worker_until

PRODUCER = "producer-token-0123456789"
WORKER = "worker-token-0123456789ab"
ADMIN = "admin-token-0123456789abcd"
WRONG = "wrong-token-0123456789abcdef"


@pytest.fixture
async def authed(tmp_path) -> AsyncIterator[RunningServer]:
    path = tmp_path / "server-tokens"
    path.write_text(f"producer {PRODUCER}\nworker {WORKER}\nadmin {ADMIN}\n")
    tokens = load_tokens(str(path), None)

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=tokens)

    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


@pytest.fixture
def address(authed: RunningServer) -> str:
    return address_of(authed)


@pytest.fixture
async def admin(address: str) -> AsyncIterator[Client]:
    async with open_client(address, token=ADMIN) as c:
        yield c


def env_with(address: str | None, token: str | None = None, **extra: str) -> dict[str, str]:
    """The commands' environment, with RELAY_AUTH_TOKEN set to ``token`` or unset."""
    env = cli_env(address, **extra)
    env.pop("RELAY_AUTH_TOKEN", None)
    if token is not None:
        env["RELAY_AUTH_TOKEN"] = token
    return env


def token_file(tmp_path: Path, text: str, name: str = "client-token") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


async def run_all(*commands: tuple[tuple[str, ...], dict[str, str]]) -> list[Result]:
    """Run the commands at once (each bounded); their results in order."""
    results: list[Result | None] = [None] * len(commands)

    async def one(i: int) -> None:
        args, env = commands[i]
        results[i] = await relay_trio(*args, env=env)

    async with trio.open_nursery() as nursery:
        for i in range(len(commands)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


def plain_lines(stderr: str) -> list[str]:
    """stderr without the JSON log lines a server or worker writes."""
    return [line for line in stderr.splitlines() if not line.startswith("{")]


# -- client commands --------------------------------------------------------------------------


async def test_stats_needs_a_token_from_the_env_or_a_file(address, tmp_path):
    good_file = token_file(tmp_path, f"# mine\n\n{PRODUCER}\n")
    results = await run_all(
        (("stats",), env_with(address)),
        (("stats", "--json"), env_with(address, PRODUCER)),
        # The file wins over the environment.
        (("stats", "--json", "--token-file", good_file), env_with(address, WRONG)),
        (("stats", "--token-file", str(tmp_path / "no-such-file")), env_with(address, PRODUCER)),
    )
    no_token, from_env, from_file, missing_file = results
    assert_one_line_error(no_token, "unauthorized")
    for result in (from_env, from_file):
        assert result.code == 0, result
        assert result.json()["queues"] == {}
    assert_one_line_error(missing_file, "--token-file", str(tmp_path / "no-such-file"), code=2)
    for result in results:
        for token in (PRODUCER, WRONG):
            assert token not in result.stdout + result.stderr


def test_the_client_token_comes_from_the_file_else_the_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_AUTH_TOKEN", WRONG)
    assert read_client_token(None) == WRONG
    path = token_file(tmp_path, f"# the producer's\n\n  {PRODUCER}  \n")
    assert read_client_token(path) == PRODUCER
    monkeypatch.setenv("RELAY_AUTH_TOKEN", "")
    assert read_client_token(None) is None  # empty counts as unset
    monkeypatch.delenv("RELAY_AUTH_TOKEN")
    assert read_client_token(None) is None


@pytest.mark.parametrize(
    "text", ["", "# only a comment\n\n", f"{PRODUCER}\n{ADMIN}\n", f"producer {PRODUCER}\n"]
)
def test_a_client_token_file_holds_exactly_one_token(tmp_path, text):
    path = token_file(tmp_path, text)
    with pytest.raises(click.BadParameter) as caught:
        read_client_token(path)
    message = caught.value.format_message()
    assert path in message and "\n" not in message
    assert PRODUCER not in message and ADMIN not in message


def test_a_token_file_the_server_reads_as_one_token_is_one_client_token(tmp_path):
    path = token_file(tmp_path, f"  # the admin token\n{ADMIN}\n")
    tokens = load_tokens(path, None)
    assert tokens is not None and len(tokens) == 1
    assert read_client_token(path) == ADMIN


def test_an_unreadable_client_token_file_is_a_bad_parameter(tmp_path):
    with pytest.raises(click.BadParameter, match="cannot read"):
        read_client_token(str(tmp_path / "missing"))
    with pytest.raises(click.BadParameter, match="cannot read"):
        read_client_token(str(tmp_path))  # a directory


async def test_submit_with_a_producer_token(address, admin):
    result = await relay_trio(
        "submit", "jobs", "--payload", '{"n": 5}', "--json", env=env_with(address, PRODUCER)
    )
    assert result.code == 0, result
    job_id = result.json()["job_id"]
    view = await admin.inspect(job_id)
    assert view.payload == {"n": 5} and view.state == JobState.READY


async def test_queue_pause_needs_an_admin_token_and_queue_list_a_producers(address, admin):
    await admin.submit("jobs", {"n": 1})
    refused, listed, paused = await run_all(
        (("queue", "pause", "jobs"), env_with(address, WORKER)),
        (("queue", "list", "--json"), env_with(address, PRODUCER)),
        (("queue", "pause", "other", "--json"), env_with(address, ADMIN)),
    )
    assert_one_line_error(refused, "unauthorized", "admin")
    assert "jobs" in [q["queue"] for q in listed.json()["queues"]]  # (run at once: "other"?)
    assert paused.json() == {"queue": "other", "paused": True}
    assert [(q.queue, q.paused) for q in (await admin.queue_list()).queues] == [
        ("jobs", False), ("other", True),
    ]  # fmt: skip


async def test_queue_set_needs_an_admin_token_and_queue_show_a_producers(address, admin):
    refused, shown, changed = await run_all(
        (("queue", "set", "jobs", "--max-leased", "2"), env_with(address, WORKER)),
        (("queue", "show", "jobs", "--json"), env_with(address, PRODUCER)),
        (("queue", "set", "other", "--max-leased", "3", "--json"), env_with(address, ADMIN)),
    )
    assert_one_line_error(refused, "unauthorized", "admin")
    assert shown.json()["queue"] == "jobs" and shown.json()["max_leased"] is None
    assert changed.json()["max_leased"] == 3
    assert (await admin.queue_config("jobs")).max_leased is None  # (refused: unchanged)


async def test_schedule_put_needs_an_admin_token_and_schedule_list_a_producers(address, admin):
    await admin.schedule_put("nightly", "@daily", "jobs", {"n": 1})
    refused, listed, put = await run_all(
        (("schedule", "put", "x", "@hourly", "--queue", "q", "--payload", "1"),
         env_with(address, WORKER)),
        (("schedule", "list", "--json"), env_with(address, PRODUCER)),
        (("schedule", "pause", "nightly", "--json"), env_with(address, ADMIN)),
    )  # fmt: skip
    assert_one_line_error(refused, "unauthorized", "admin")
    assert "nightly" in [s["name"] for s in listed.json()["schedules"]]
    assert put.json()["paused"] is True
    assert [s.name for s in (await admin.schedule_list()).schedules] == ["nightly"]


# -- the server command -----------------------------------------------------------------------


def server_args(db: Path, *extra: str) -> tuple[str, ...]:
    return ("server", "--db", str(db), "--address", "127.0.0.1:0", "--metrics-address", "off",
            "--ws-address", "off", *extra)  # fmt: skip


def assert_one_plain_line(result: Result, *fragments: str, code: int = 2) -> str:
    assert result.code == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = plain_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("relay-trio: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


async def test_server_refuses_bad_tokens_with_one_line(tmp_path):
    db = tmp_path / "relay.db"
    short = "short-token"
    short_file = token_file(tmp_path, f"admin {ADMIN}\nworker {short}\n", name="short")
    (result,) = await run_all(
        (server_args(db, "--auth-token-file", short_file), env_with(None, ADMIN))
    )
    line = assert_one_plain_line(result, short_file, "16")
    assert short not in line.removeprefix(f"relay-trio: {short_file}") and ADMIN not in line
    assert not db.exists()


async def test_server_refuses_every_interface_without_tokens(tmp_path):
    db = tmp_path / "relay.db"
    args = (
        "server",
        "--db",
        str(db),
        "--address",
        "0.0.0.0:0",
        "--metrics-address",
        "off",
        "--ws-address",
        "off",
    )
    (result,) = await run_all((args, env_with(None)))
    assert_one_plain_line(result, "0.0.0.0", "--insecure", "--auth-token-file",
                          "RELAY_AUTH_TOKEN")  # fmt: skip
    assert not db.exists()


# -- the worker command -----------------------------------------------------------------------


async def test_worker_with_a_worker_token_runs_jobs(address, admin):
    ids: list[str] = []

    async def body() -> None:
        ids.append((await admin.submit("work", {"hello": 1})).job_id)
        await wait_for_state(admin, ids[0], "succeeded")

    args = ["--queue", "work", "--shutdown-timeout-ms", "2000"]
    worker = await run_worker_until(address, args, body, env=env_with(address, WORKER))
    assert worker.process.returncode == 0, worker.stderr
    assert "worker.started" in worker.events()
    assert WORKER.encode() not in worker.stderr


async def test_worker_without_a_token_fails_with_one_line(address):
    (result,) = await run_all((("worker", "--queue", "work"), env_with(address)))
    assert result.code == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = plain_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("relay-trio: unauthorized"), result.stderr


async def test_worker_with_a_producer_token_fails_with_one_line(address):
    # It could never lease: refused at start rather than retrying forever.
    (result,) = await run_all((("worker", "--queue", "work"), env_with(address, PRODUCER)))
    assert result.code == 1, result
    lines = plain_lines(result.stderr)
    assert len(lines) == 1 and "producer" in lines[0] and "worker" in lines[0], result.stderr


# -- the server command, started ------------------------------------------------------------


async def test_server_with_a_token_file_and_the_env_token_needs_a_hello(tmp_path, monkeypatch):
    path = token_file(tmp_path, f"# producers\nproducer {PRODUCER}\n", name="server-tokens")
    monkeypatch.setenv("RELAY_AUTH_TOKEN", ADMIN)  # inherited by the server: one more token
    async with server_process(tmp_path / "relay.db", "--auth-token-file", path) as server:
        refused = await server.connect()
        await refused.send("stats")
        reply = await refused.read()
        assert reply["error"]["code"] == "unauthorized"
        assert await refused.at_eof()
        client = await server.connect()
        assert (await client.ok("hello", token=PRODUCER))["role"] == "producer"
        assert (await client.error("dead_list"))["code"] == "unauthorized"
        assert (await client.ok("hello", token=ADMIN))["role"] == "admin"
        await client.ok("dead_list")
        for c in (refused, client):
            await c.aclose()
    assert PRODUCER.encode() not in server.stderr and ADMIN.encode() not in server.stderr
    started = next(e for e in server.events if e["event"] == "server.started")
    assert started["tokens"] == 2


async def test_server_with_insecure_listens_on_every_interface_and_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAY_AUTH_TOKEN", raising=False)
    args = ("--address", "0.0.0.0:0", "--insecure")
    async with server_process(tmp_path / "relay.db", *args) as server:
        assert server.address is not None and server.address[0] == "0.0.0.0"
        client = await server.connect()
        assert (await client.ok("hello"))["role"] == "admin"  # no token needed
        await client.aclose()
        warnings = [e for e in server.events if e["event"] == "server.insecure"]
        assert len(warnings) == 1 and warnings[0]["level"] == "warning", server.events
        assert warnings[0]["host"] == "0.0.0.0"
