"""A server whose open-files limit is below what max_connections needs (issue: past it the
metrics listener logged ~10 tracebacks a second, and new clients timed out without the
overloaded line): ``relay-trio server`` as a subprocess with RLIMIT_NOFILE lowered (its
hard limit too, so it cannot raise it), flooded on every listener past the limit. Every
wait is bounded."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import trio

from tests.server.conftest import BOUND_S, LineClient

RELAY = Path(sys.executable).parent / "relay-trio"
# Descriptors the server may open: ~20 go to its own files (the database, its listeners,
# trio's), the rest to connections: far below --max-connections' default (1,024).
OPEN_FILES = 64
FLOOD = 3 * OPEN_FILES  # connections per listener


def _lower_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


@contextlib.asynccontextmanager
async def starved_server(db: Path) -> AsyncIterator[tuple[trio.Process, dict, list[bytes]]]:
    """The server, its listeners' addresses (from its server.started line), and the list
    its stderr lines go into."""
    command = [
        str(RELAY), "server", "--db", str(db), "--address", "127.0.0.1:0",
        "--metrics-address", "127.0.0.1:0", "--ws-address", "127.0.0.1:0",
        "--shutdown-timeout-ms", "1000",
    ]  # fmt: skip
    lines: list[bytes] = []
    started = trio.Event()
    addresses: dict[str, tuple[str, int]] = {}

    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "RELAY_LOG_FORMAT": "json"}, preexec_fn=_lower_open_files,
        )  # fmt: skip

        async def pump() -> None:
            assert process.stderr is not None
            rest = b""
            while data := await process.stderr.receive_some(65536):
                *complete, rest = (rest + data).split(b"\n")
                for line in complete:
                    lines.append(line)
                    if b'"server.started"' in line:
                        entry = orjson.loads(line)
                        for name in ("address", "metrics", "websocket"):
                            host, _, port = entry[name].rpartition(":")
                            addresses[name] = (host, int(port))
                        started.set()
            started.set()

        nursery.start_soon(pump)
        try:
            with trio.fail_after(BOUND_S):
                await started.wait()
            assert addresses, b"\n".join(lines)
            yield process, addresses, lines
        finally:
            process.send_signal(2)
            with trio.move_on_after(BOUND_S):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _open(address: tuple[str, int], n: int) -> list[trio.SocketStream]:
    streams = []
    with trio.fail_after(BOUND_S):
        for _ in range(n):
            streams.append(await trio.open_tcp_stream(*address))
    return streams


async def _what_it_said(stream: trio.SocketStream) -> bytes:
    """What the server sent before closing; b"" if it did not close within a short wait
    (it serves this one: an idle session)."""
    data = b""
    with trio.move_on_after(1.0):
        try:
            while chunk := await stream.receive_some(4096):
                data += chunk
        except trio.BrokenResourceError:
            pass
        return data or b"(closed)"
    return data


async def test_out_of_file_descriptors_every_listener_refuses_without_a_traceback(tmp_path):
    async with starved_server(tmp_path / "relay.db") as (_process, addresses, lines):
        began = trio.current_time()
        jobs = await _open(addresses["address"], FLOOD)
        websockets = await _open(addresses["websocket"], FLOOD)
        metrics = await _open(addresses["metrics"], FLOOD)
        # The last to connect found no descriptor: each is told it is refused (the jobs
        # and WebSocket ports), or closed (the metrics port), rather than left waiting.
        said = [await _what_it_said(s) for s in jobs[-5:]]
        refusals = [orjson.loads(s)["error"] for s in said if s.startswith(b"{")]
        assert refusals and all(e["code"] == "overloaded" for e in refusals), said
        assert "out of file descriptors" in refusals[0]["message"]
        said = [await _what_it_said(s) for s in websockets[-5:]]
        assert any(s.startswith(b"HTTP/1.1 503") for s in said), said
        said = [await _what_it_said(s) for s in metrics[-5:]]
        assert all(s == b"(closed)" for s in said), said
        flood_s = trio.current_time() - began
        for stream in jobs + websockets + metrics:
            await trio.aclose_forcefully(stream)
        # Once the flood is over, the server serves again.
        with trio.fail_after(BOUND_S):
            while True:
                client = LineClient(await trio.open_tcp_stream(*addresses["address"]))
                try:
                    reply = await client.request("ping")
                except (AssertionError, trio.BrokenResourceError):
                    reply = {}
                await client.aclose()
                if reply.get("ok"):
                    break
                await trio.sleep(0.1)
        failures = [line for line in lines if b'"listener.accept_failed"' in line]
    text = b"\n".join(lines)
    assert b"Traceback (most recent call last)" not in text, text[-3000:]
    assert not [line for line in lines if b'"traceback":' in line or b'"crit' in line]
    assert all(line.startswith(b"{") for line in lines if line), "every line is an event"
    assert b'"server.open_files_limit"' in text  # it said so at start
    assert failures, "the flood went past the limit"
    assert b"ulimit -n" in failures[0]
    # In summary: at most about one line a second per listener.
    assert len(failures) <= 3 * (flood_s + 2), len(failures)
