"""A real server whose database is on a small tmpfs that fills up: submits are answered
``unavailable`` and nothing of them is kept; the server keeps answering pings and reads,
keeps every job it acknowledged, counts the refusals on /metrics, and commits again once
the file system has room (grown with a remount), with no restart.

Mounting needs root (CI runs as root); elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from relay import open_client
from tests.server.conftest import LineClient
from tests.worker.helpers import BOUND_S, Server, start_server, wait_until

# Room for the schema and a few big jobs: the database (and its WAL) fill it in ~10 submits.
SMALL = "2m"
LARGE = "64m"
# Each job's payload: large (so that the disk fills fast) and within max_payload_bytes.
PAD = "x" * 200_000
# The most submits tried before the disk must have refused one.
MAX_SUBMITS = 100


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, Callable[[str], None]]]:
    """A directory on a tmpfs of SMALL bytes, and a function that resizes it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = _run("mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(mount))
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip() or done.returncode}")

    def resize(size: str) -> None:
        done = _run("mount", "-o", f"remount,size={size}", str(mount))
        assert done.returncode == 0, done.stderr

    try:
        yield mount, resize
    finally:
        if _run("umount", str(mount)).returncode != 0:
            _run("umount", "-l", str(mount))  # still busy (a test that failed): detach it


async def submit(client: LineClient, i: int, **fields: object) -> dict:
    return await client.request("submit", queue="big", payload={"i": i, "pad": PAD}, **fields)


async def test_a_full_disk_refuses_writes_keeps_serving_and_recovers_with_room(small_disk, caplog):
    caplog.set_level(logging.INFO, logger="relay.writer")
    mount, resize = small_disk
    with trio.fail_after(4 * BOUND_S):
        async with trio.open_nursery() as nursery:
            server: Server = await start_server(nursery, str(mount / "relay.db"), metrics_port=0)
            host, port = server.handle.address
            client = LineClient(await trio.open_tcp_stream(host, port))

            # Fill the disk: every ok is durable; the first refusal says why.
            acknowledged: dict[str, int] = {}
            for i in range(MAX_SUBMITS):
                reply = await submit(client, i)
                if not reply["ok"]:
                    break
                acknowledged[reply["job_id"]] = i
            else:
                pytest.fail(f"{MAX_SUBMITS} submits of 200 kB fitted in {SMALL}")
            assert reply["error"]["code"] == "unavailable", reply
            message = reply["error"]["message"]
            assert message == "not committed: disk full (SQLITE_FULL); retry later"
            assert len(acknowledged) >= 2

            # Still full: a second refusal, and one more from a keyed submit.
            again = await submit(client, -1)
            assert again["error"]["code"] == "unavailable"
            keyed = await submit(client, -2, idempotency_key="during")
            assert keyed["error"]["code"] == "unavailable"
            # The server answers, and has kept exactly what it acknowledged.
            assert (await client.request("ping"))["ok"]
            stats = await client.request("stats")
            assert stats["ok"] and stats["queues"]["big"]["ready"] == len(acknowledged)
            for job_id, i in acknowledged.items():
                job = (await client.request("inspect", job_id=job_id))["job"]
                assert job["state"] == "ready" and job["payload"]["i"] == i
            assert (await client.request("dead_list"))["jobs"] == []
            assert await server.metric("relay_store_errors_total", kind="full") >= 3
            assert await server.metric("relay_store_errors_total", kind="ioerr") == 0

            # The async client retries a keyed submit until the disk has room.
            retried: dict = {}
            retried_done = trio.Event()

            async def submit_with_retries() -> None:
                async with open_client(server.address) as relay_client:
                    retried["result"] = await relay_client.submit(
                        "big", {"i": "retried", "pad": PAD}, idempotency_key="during"
                    )
                retried_done.set()

            failures_before = await server.metric("relay_store_errors_total", kind="full")
            nursery.start_soon(submit_with_retries)

            async def refused_again() -> bool:
                now = await server.metric("relay_store_errors_total", kind="full")
                return now > failures_before

            await wait_until(refused_again, what="the client's keyed submit refused")
            assert not retried_done.is_set()

            resize(LARGE)  # room again, same server

            after = await submit(client, 1000)
            assert after["ok"], after
            with trio.fail_after(BOUND_S):
                await retried_done.wait()
            result = retried["result"]
            assert result.duplicate is False
            job = (await client.request("inspect", job_id=result.job_id))["job"]
            assert job["payload"]["i"] == "retried" and job["idempotency_key"] == "during"
            stats = await client.request("stats")
            assert stats["queues"]["big"]["ready"] == len(acknowledged) + 2
            for job_id, i in acknowledged.items():
                job = (await client.request("inspect", job_id=job_id))["job"]
                assert job["payload"]["i"] == i

            await client.aclose()
            await server.stop()
    events = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("store.")
    ]
    # One warning for the episode, one info at its end; not one per refused batch.
    assert events == [("WARNING", "store.unavailable"), ("INFO", "store.available")]
