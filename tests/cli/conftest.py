"""The relay-trio console script as a subprocess, against a real server in this process.

``server`` serves on 127.0.0.1 port 0 from the test's own trio loop, so every command runs
through ``trio.run_process`` (the loop keeps serving while the command waits). Commands get
a wide terminal (COLUMNS=200) so that tables are not cut, and the server's address in
RELAY_ADDRESS. Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import orjson
import pytest
import trio

from relay import open_client
from relay.client.client import Client
from tests.server.conftest import RunningServer
from tests.server.conftest import line_server as line_server  # the `server` fixture

RELAY = Path(sys.executable).parent / "relay-trio"
# A command that talks to a local server finishes in about a second (most of it imports).
COMMAND_TIMEOUT_S = 20.0
BOUND_S = 10.0


def address_of(server: RunningServer) -> str:
    host, port = server.handle.address
    return f"{host}:{port}"


def cli_env(address: str | None = None, **extra: str) -> dict[str, str]:
    # The tests read the commands' logs as JSON lines: what they write to a pipe, unless
    # RELAY_LOG_FORMAT says otherwise (a developer's own setting must not).
    skip = ("FORCE_COLOR", "RELAY_LOG", "RELAY_LOG_FORMAT")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update({"COLUMNS": "200", "NO_COLOR": "1", **extra})
    if address is not None:
        env["RELAY_ADDRESS"] = address
    else:
        env.pop("RELAY_ADDRESS", None)
    return env


@attrs.frozen
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return orjson.loads(self.stdout)


async def relay_trio(
    *args: str, address: str | None = None, stdin: str | None = None, env: dict | None = None
) -> Result:
    """Run ``relay-trio *args`` to completion (bounded) and return its exit code and output."""
    with trio.fail_after(COMMAND_TIMEOUT_S):
        done = await trio.run_process(
            [str(RELAY), *args],
            stdin=(stdin or "").encode(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env or cli_env(address),
        )
    return Result(done.returncode, done.stdout.decode(), done.stderr.decode())


def relay_trio_sync(*args: str, address: str | None = None, timeout: float = 60) -> Result:
    """The same for tests without a server: a plain blocking subprocess."""
    done = subprocess.run(
        [str(RELAY), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=cli_env(address),
        timeout=timeout,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def assert_one_line_error(result: Result, *fragments: str, code: int = 1) -> None:
    """Exit ``code``, nothing on stdout, one "relay-trio: ..." line on stderr naming each
    fragment, and no traceback."""
    assert result.code == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("relay-trio: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def address(server: RunningServer) -> str:
    return address_of(server)


@pytest.fixture
async def client(address: str) -> AsyncIterator[Client]:
    async with open_client(address) as c:
        yield c
