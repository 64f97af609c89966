"""``relay-trio watch``: job events as JSON lines, for scripts."""

from __future__ import annotations

import subprocess

import orjson
import trio

from tests.cli.conftest import RELAY, cli_env
from tests.server.conftest import BOUND_S


async def test_watch_prints_the_events_of_its_queue_as_json_lines(server, address):
    process = await trio.lowlevel.open_process(
        [str(RELAY), "watch", "--queue", "cli"], env=cli_env(address), stdout=subprocess.PIPE
    )
    try:
        c = await server.connect()
        lines = b""
        with trio.fail_after(BOUND_S):
            # Submit until the watch is on (its first event arrives), then one more job.
            while b"\n" not in lines:
                await c.ok("submit", queue="other", payload=0)
                await c.ok("submit", queue="cli", payload=1)
                more = b""
                with trio.move_on_after(0.2):
                    more = await process.stdout.receive_some(65536)
                lines += more
        first = orjson.loads(lines.split(b"\n")[0])
        assert first["event"] == "job" and first["queue"] == "cli" and first["state"] == "ready"
    finally:
        process.terminate()
        with trio.fail_after(BOUND_S):
            await process.wait()
