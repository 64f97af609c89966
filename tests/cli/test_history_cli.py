"""``relay-trio history`` against a server that flushes its history every 20 ms: the table
and its JSON show the jobs that moved; bad durations and queues are one line, exit 2."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import pytest
import trio

from relay.client.client import open_client
from tests.server.conftest import RunningServer, start_server
from tests.worker.helpers import serving

from .conftest import BOUND_S, address_of, assert_one_line_error, cli_env, relay_trio


@pytest.fixture
async def fast_server(tmp_path) -> AsyncIterator[RunningServer]:
    start = functools.partial(start_server, history_flush_ms=20)
    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


async def test_history_shows_the_jobs_of_the_last_hour(fast_server):
    address = address_of(fast_server)
    async with open_client(address) as client:
        await client.submit_batch([{"queue": "mail", "payload": {}} for _ in range(3)])
        await client.submit("other", {})
        leased = await client.lease(["mail"], "w", count=2, lease_ms=60_000)
        for job in leased:
            await client.ack(job.job_id, "w", job.token)
        with trio.fail_after(BOUND_S):  # until the server has flushed them (every 20 ms)
            while sum(p.succeeded for p in (await client.history()).points) < 2:  # noqa: ASYNC110
                await trio.sleep(0.02)
    result = await relay_trio("history", "--queue", "mail", address=address)
    assert result.code == 0, result
    lines = result.stdout.splitlines()
    assert lines[0].startswith("mail · ") and lines[0].endswith("UTC · per 1m")
    total = next(line for line in lines if line.startswith("total")).split()
    assert total[1:5] == ["3", "2", "0", "0"]  # submitted, succeeded, failed, dead
    # A row per minute: the hour before now and the minute under way.
    assert sum(line[:2].isdigit() and line[2] == ":" for line in lines) == 61
    assert any(line.strip().startswith("succeeded") for line in lines)  # the sparklines
    every = (await relay_trio("history", "--json", "--since", "2h", "--step", "5m",
                              address=address)).json()  # fmt: skip
    # 121 minutes (from two hours ago to the end of this minute), the last step shorter.
    assert (every["queue"], every["step"], len(every["points"])) == (None, 300_000, 25)
    assert sum(p["submitted"] for p in every["points"]) == 4
    assert {"at", "run_count", "wait_max_ms"} <= set(every["points"][0])


@pytest.mark.parametrize("width", ["80", "120"])
async def test_history_fits_the_terminal(fast_server, width):
    env = {**cli_env(address_of(fast_server)), "COLUMNS": width}
    result = await relay_trio("history", env=env)
    assert result.code == 0, result
    widest = max(len(line) for line in result.stdout.splitlines())
    assert widest <= int(width)
    rows = [line for line in result.stdout.splitlines() if line[:2].isdigit()]
    assert len(rows) == 61


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--since", "5x"], "--since"),
        (["--since", "8d"], "--since"),
        (["--step", "90s"], "--step"),
        (["--step", "0"], "--step"),
        (["--since", "7d", "--step", "1m"], "--step"),
        (["--queue", "a b"], "--queue"),
    ],
)
def test_history_refuses_bad_options_in_one_line(args, named):
    from .conftest import relay_trio_sync

    assert_one_line_error(relay_trio_sync("history", *args), named, code=2)
