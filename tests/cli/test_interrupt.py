"""Ctrl-C, timeouts and servers that go away, as a user meets them: each command a
subprocess, sent SIGINT while it works, or pointed at a server that is down, silent or of
the wrong kind. Every command ends with exit code 130 after Ctrl-C and no traceback, waits
no longer than its --timeout, and ends at once on what no retry can fix. (The server's own
Ctrl-C is tests/cli/test_server_startup.py's.)"""

from __future__ import annotations

import contextlib
import functools
import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import orjson
import pytest
import trio

from relay.client.client import Client, open_client
from relay.server.requests.auth import load_tokens
from tests.conftest import answer_hello
from tests.server.conftest import start_server
from tests.server.test_process import server_process
from tests.tls_helpers import TlsFiles
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker.helpers import serving

from .conftest import (
    BOUND_S,
    COMMAND_TIMEOUT_S,
    RELAY,
    address_of,
    assert_one_line_error,
    cli_env,
    relay_trio,
)
from .test_commands import free_port


@attrs.define
class Command:
    """``relay-trio ...`` running, its output collected as it comes."""

    process: trio.Process
    stdout: bytes = b""
    stderr: bytes = b""
    changed: trio.Event = attrs.Factory(trio.Event)

    async def pump(self, stream: trio.abc.ReceiveStream, name: str) -> None:
        while data := await stream.receive_some(65536):
            setattr(self, name, getattr(self, name) + data)
            self.changed.set()
            self.changed = trio.Event()

    async def wait_for(self, what: Callable[[Command], bool]) -> None:
        with trio.fail_after(BOUND_S):
            while not what(self):
                assert self.process.returncode is None, (self.stdout, self.stderr)
                await self.changed.wait()

    async def interrupt(self) -> int:
        """SIGINT, as Ctrl-C sends it; the exit code."""
        self.process.send_signal(signal.SIGINT)
        with trio.fail_after(BOUND_S):
            return await self.process.wait()

    def log_events(self) -> list[str]:
        return [orjson.loads(line)["event"] for line in self.stderr.splitlines()
                if line.startswith(b"{")]  # fmt: skip


@asynccontextmanager
async def command(*args: str, env: dict[str, str]) -> AsyncIterator[Command]:
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            [str(RELAY), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        running = Command(process)
        assert process.stdout is not None and process.stderr is not None
        nursery.start_soon(running.pump, process.stdout, "stdout")
        nursery.start_soon(running.pump, process.stderr, "stderr")
        try:
            yield running
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(BOUND_S):
                await process.wait()


async def connections(client: Client) -> int:
    return (await client.stats()).server.connections


async def wait_for_connections(client: Client, count: int) -> None:
    """Until the server counts ``count`` connections (the test's own included)."""
    await until(lambda: connections(client), lambda n: n >= count)


async def until(read, done) -> None:
    """Poll ``read()`` until ``done(value)``, within BOUND_S."""
    with trio.fail_after(BOUND_S):
        while True:
            if done(await read()):
                return
            await trio.sleep(0.02)


@asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[str, list[trio.SocketStream]]]:
    """A server that accepts connections and never answers a byte."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    accepted: list[trio.SocketStream] = []

    async def accept() -> None:
        while True:
            accepted.append(await listeners[0].accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        yield f"127.0.0.1:{listeners[0].socket.getsockname()[1]}", accepted
        nursery.cancel_scope.cancel()


def assert_interrupted(code: int, running: Command) -> None:
    assert code == 130, (code, running.stderr)
    assert b"Traceback" not in running.stderr, running.stderr.decode()


# -- Ctrl-C ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["top"], ["watch"]], ids=["top", "watch"])
async def test_ctrl_c_ends_a_live_command_with_130(address, client, args):
    async with command(*args, env=cli_env(address)) as running:
        await wait_for_connections(client, 2)
        assert_interrupted(await running.interrupt(), running)


async def test_ctrl_c_ends_the_demo_with_130_and_no_traceback():
    env = cli_env(None)
    async with command("demo", "--jobs", "200", env=env) as running:
        await running.wait_for(lambda c: b"relay-trio demo" in c.stdout)
        assert_interrupted(await running.interrupt(), running)


ONE_SHOTS = [["stats"], ["inspect", "job_0000000000000001"], ["dead", "list"],
             ["queue", "set", "q", "--max-leased", "1"], ["queue", "show", "q"]]  # fmt: skip


@pytest.mark.parametrize(
    "args", ONE_SHOTS, ids=["stats", "inspect", "dead list", "queue set", "queue show"]
)
async def test_ctrl_c_ends_a_one_shot_command_waiting_for_its_server(args):
    async with silent_server() as (address, accepted), command(*args, env=cli_env(address)) as c:

        async def count() -> int:
            return len(accepted)

        await until(count, bool)
        assert_interrupted(await c.interrupt(), c)
        assert c.stderr.strip() == b"", c.stderr  # nothing to say: the terminal shows ^C


async def test_ctrl_c_drains_the_worker_and_says_for_how_long_then_exits_130(address, client):
    args = ["worker", "--queue", "slow", "--shutdown-timeout-ms", "20000"]
    async with command(*args, env=cli_env(address)) as worker:
        await worker.wait_for(lambda c: b'"worker.started"' in c.stderr)
        await client.submit("slow", {"sleep_ms": 800})
        await wait_for_state(client, "slow", "leased")
        worker.process.send_signal(signal.SIGINT)
        await worker.wait_for(lambda c: b'"worker.draining"' in c.stderr)
        draining = next(
            orjson.loads(line) for line in worker.stderr.splitlines()
            if b'"worker.draining"' in line
        )  # fmt: skip
        assert draining["timeout_s"] == 20.0 and draining["running"] == 1
        with trio.fail_after(BOUND_S):
            code = await worker.process.wait()
    assert_interrupted(code, worker)
    # It drained: the running job finished and was acked, not cut short.
    assert (await client.stats()).queues["slow"]["succeeded"] == 1


async def test_a_second_ctrl_c_stops_the_worker_at_once_and_releases_its_job(address, client):
    args = ["worker", "--queue", "stuck", "--shutdown-timeout-ms", "60000"]
    async with command(*args, env=cli_env(address)) as worker:
        await worker.wait_for(lambda c: b'"worker.started"' in c.stderr)
        job = await client.submit("stuck", {"sleep_ms": 60_000})
        await wait_for_state(client, "stuck", "leased")
        worker.process.send_signal(signal.SIGINT)
        await worker.wait_for(lambda c: b'"worker.draining"' in c.stderr)
        assert_interrupted(await worker.interrupt(), worker)
    assert "worker.stopping_now" in worker.log_events()
    assert (await client.inspect(job.job_id)).state == "ready"  # released, not left leased


async def test_sigterm_drains_the_worker_and_exits_0(address):
    async with command("worker", "--queue", "q", env=cli_env(address)) as worker:
        await worker.wait_for(lambda c: b'"worker.started"' in c.stderr)
        worker.process.send_signal(signal.SIGTERM)
        with trio.fail_after(BOUND_S):
            assert await worker.process.wait() == 0, worker.stderr


async def wait_for_state(client: Client, queue: str, state: str) -> None:
    await until(client.stats, lambda stats: stats.queues.get(queue, {}).get(state, 0) >= 1)


# -- servers that are down, silent, or of the wrong kind ------------------------------------


async def test_a_one_shot_command_gives_up_on_a_silent_server_after_its_timeout():
    async with silent_server() as (address, _):
        started = trio.current_time()
        result = await relay_trio("stats", "--timeout", "0.5", address=address)
        assert trio.current_time() - started < BOUND_S
    assert_one_line_error(result, f"no answer from {address} within 0.5 s", "--timeout")


async def test_the_worker_waits_for_a_server_that_is_not_up_yet(tmp_path):
    """One rule, at start as later: the worker retries with backoff and logs each try."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    async with command("worker", "--queue", "q", env=cli_env(address)) as worker:
        await worker.wait_for(lambda c: c.stderr.count(b'"worker.connect_failed"') >= 2)
        failed = orjson.loads(next(line for line in worker.stderr.splitlines()
                                   if b'"worker.connect_failed"' in line))  # fmt: skip
        assert failed["error"] == "Connection refused" and failed["retry_in_s"] > 0
        async with server_process(tmp_path / "relay.db", "--address", address) as server:
            await worker.wait_for(lambda c: b'"worker.started"' in c.stderr)
            line = await server.connect()
            reply = await line.request("submit", queue="q", payload={"n": 1})
            job_id = reply["job_id"]

            async def state() -> str:
                return (await line.request("inspect", job_id=job_id))["job"]["state"]

            await until(state, lambda value: value == "succeeded")
        # The server went away under it: it logs the loss and keeps trying.
        await worker.wait_for(lambda c: b'"client.connection_lost"' in c.stderr)
        assert_interrupted(await worker.interrupt(), worker)


async def test_the_worker_gives_up_on_a_silent_server_hello_and_retries():
    async with silent_server() as (address, _):
        env = cli_env(address)
        async with command("worker", "--queue", "q", "--timeout", "0.3", env=env) as worker:
            await worker.wait_for(lambda c: b'"worker.connect_failed"' in c.stderr)
            assert_interrupted(await worker.interrupt(), worker)


# -- what no retry fixes ---------------------------------------------------------------------

PRODUCER = "producer-token-0123456789"
WORKER = "worker-token-0123456789ab"


@pytest.fixture
async def authed(tmp_path) -> AsyncIterator[str]:
    path = tmp_path / "tokens"
    path.write_text(f"producer {PRODUCER}\nworker {WORKER}\n")
    tokens = load_tokens(str(path), None)
    start = functools.partial(start_server, tokens=tokens)
    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield address_of(running)


def token_file(tmp_path: Path, token: str) -> str:
    path = tmp_path / "client-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


async def test_top_ends_at_once_on_a_token_that_may_not_watch(authed, tmp_path):
    result = await relay_trio("top", "--token-file", token_file(tmp_path, PRODUCER),
                              address=authed)  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.code == 1 and "Traceback" not in result.stderr, result
    assert lines[-1].startswith("relay-trio: unauthorized"), lines


async def test_top_ends_at_once_without_a_token_and_says_how_to_give_one(authed):
    result = await relay_trio("top", address=authed)
    assert result.code == 1 and "Traceback" not in result.stderr, result
    last = result.stderr.splitlines()[-1]
    assert "RELAY_AUTH_TOKEN" in last and "--token-file" in last, last


async def test_commands_without_a_token_say_how_to_give_one(authed):
    result = await relay_trio("stats", address=authed)
    assert_one_line_error(result, "unauthorized", "RELAY_AUTH_TOKEN", "--token-file")


@pytest.fixture
async def tls_address(tmp_path, tls_files: TlsFiles) -> AsyncIterator[str]:
    start = functools.partial(start_server, **tls_files.server_options())
    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield address_of(running)


async def test_plain_commands_against_a_tls_server_end_at_once_saying_so(tls_address):
    for args in (["top"], ["stats"]):
        result = await relay_trio(*args, address=tls_address)
        assert result.code == 1 and "Traceback" not in result.stderr, result
        assert "tls://" in result.stderr.splitlines()[-1], result.stderr


async def test_tls_against_a_plain_server_says_it_does_not_speak_tls(address, tls_files):
    result = await relay_trio("stats", "--tls-ca", tls_files.ca, address=address)
    assert_one_line_error(result, "does not speak TLS")


async def test_tls_without_the_private_ca_suggests_tls_ca(tls_address):
    result = await relay_trio("stats", "--tls", address=tls_address)
    assert_one_line_error(result, "certificate verification failed", "--tls-ca")


# -- options and messages ----------------------------------------------------------------------


async def test_shared_options_may_come_before_the_command_word(address, client):
    await client.submit("before", 1)
    result = await relay_trio("--address", address, "--json", "--timeout", "5", "stats",
                              address=None)  # fmt: skip
    assert result.code == 0, result
    assert result.json()["queues"]["before"]["ready"] == 1
    result = await relay_trio("--json", "dead", "list", address=address)
    assert result.code == 0 and result.json()["jobs"] == [], result


async def test_dash_h_is_help_everywhere():
    for args in (["-h"], ["stats", "-h"], ["dead", "list", "-h"]):
        result = await relay_trio(*args)
        assert result.code == 0 and "Usage:" in result.stdout, (args, result)


async def test_an_address_with_another_scheme_is_refused_naming_the_schemes():
    result = await relay_trio("stats", "--address", "http://127.0.0.1:7400")
    assert_one_line_error(result, "http://", "tcp://", "tls://", code=2)
    result = await relay_trio("stats", "--address", "tcp://127.0.0.1:1", "--timeout", "2")
    assert_one_line_error(result, "cannot connect to 127.0.0.1:1")


async def test_purging_a_whole_queue_without_a_terminal_asks_for_yes(address, client):
    await client.submit("doomed", {"fail": True}, retries=0)
    result = await relay_trio("dead", "purge", "--queue", "doomed", "--all", address=address)
    assert_one_line_error(result, "no terminal to confirm on", "--yes", code=2)
    result = await relay_trio("dead", "purge", "--queue", "doomed", "--all", "--yes",
                              address=address)  # fmt: skip
    assert result.code == 0 and result.stdout.startswith("purged"), result


@asynccontextmanager
async def fake_server(after_accept) -> AsyncIterator[str]:
    """A server that runs ``after_accept(stream)`` on each connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def accept() -> None:
        async with trio.open_nursery() as each:
            while True:
                each.start_soon(after_accept, await listeners[0].accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        yield f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def test_a_timeout_after_the_request_was_sent_says_it_may_have_taken_effect():
    async def hello_then_silence(stream: trio.SocketStream) -> None:
        await answer_hello(stream)
        await trio.sleep_forever()

    async with fake_server(hello_then_silence) as address:
        result = await relay_trio("stats", "--timeout", "0.5", address=address)
    assert_one_line_error(result, f"no reply from {address} within 0.5 s", "may or may not")


async def test_a_peer_that_answers_hello_with_no_end_of_line_is_not_read_forever():
    async def endless(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        with contextlib.suppress(trio.BrokenResourceError):
            while True:
                await stream.send_all(b"x" * 65536)

    async with fake_server(endless) as address:
        result = await relay_trio("stats", address=address)
    assert_one_line_error(result, f"cannot talk to {address}", "no line of a relay-trio server")


async def test_watch_ends_with_one_line_when_its_server_goes(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = address_of(server)
        async with command("watch", env=cli_env(address)) as watching:
            async with open_client(address) as client:
                await wait_for_connections(client, 2)
                # Watching (its hello answered, its watch begun), not only connected: a
                # loaded machine could otherwise shut the server down inside its hello.
                job = (await client.submit("q", 1)).job_id
                await watching.wait_for(lambda c: job.encode() in c.stdout)
            server.handle.shutdown()
            with trio.fail_after(BOUND_S):
                code = await watching.process.wait()
        lines = watching.stderr.decode().splitlines()
        assert code == 1 and len(lines) == 1, (code, lines)
        assert lines[0].startswith("relay-trio: the connection to") and "watch again" in lines[0]


async def test_what_the_user_must_fix_locally_is_a_usage_error_naming_it(tmp_path):
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("not a certificate\n")
    cases = {
        ("server", "--db", ""): ("--db", "is empty"),
        ("server", "--db", "mysql://x@h/db"): ("--db", "mysql://", "postgresql://"),
        ("stats", "--tls-ca", str(not_pem)): ("--tls-ca", "no CA certificate"),
    }
    for args, fragments in cases.items():
        assert_one_line_error(await relay_trio(*args), *fragments, code=2)


async def test_a_token_of_the_wrong_role_is_told_which_to_give(authed, tmp_path):
    result = await relay_trio("top", "--token-file", token_file(tmp_path, PRODUCER),
                              address=authed)  # fmt: skip
    last = result.stderr.splitlines()[-1]
    assert "needs the worker role" in last and "give a token of that role" in last, last


def _ctrl_c_at_the_prompt(argv: list[str], env: dict[str, str]) -> tuple[bytes, int]:
    """Run ``argv`` on a terminal (a pty), answer its confirmation prompt with Ctrl-C, and
    return what the terminal showed and the exit code. Every read is bounded."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, on the pty
        os.execve(argv[0], argv, env)
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    shown = b""
    try:
        while b"[y/N]" not in shown:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, shown
            shown += os.read(fd, 4096)
        os.write(fd, b"\x03")
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, shown
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the command ended: the pty is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    return shown, os.waitstatus_to_exitcode(status)


async def test_ctrl_c_at_a_confirmation_ends_its_line_and_exits_130(address, client):
    """The shell's prompt starts on a line of its own after a Ctrl-C answered to "[y/N]"
    (click writes no newline for it)."""
    await client.submit("doomed", {"fail": True}, retries=0)
    argv = [str(RELAY), "jobs", "purge", "--queue", "doomed", "--state", "dead"]
    shown, code = await trio.to_thread.run_sync(
        _ctrl_c_at_the_prompt, argv, cli_env(address, TERM="xterm")
    )
    assert code == 130, shown
    assert shown.rstrip(b" ").endswith(b"\r\n") and b"Traceback" not in shown, shown
