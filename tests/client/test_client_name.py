"""The clients name their process in the hello that begins each connection, so that a
server's workers list (``workers_list``, ``relay-trio workers``, the page) says which
process a worker is: program, host and pid. Both clients, against a real server."""

from __future__ import annotations

import os
import socket

import trio

import relay
from relay import connect
from relay.client.client import open_client
from tests.client.test_client import lease_one
from tests.server.conftest import BOUND_S
from tests.worker.helpers import running


def expected_name() -> str:
    return f"on {socket.gethostname()}, pid {os.getpid()}"


async def test_a_worker_is_listed_with_its_program_host_and_pid(server):
    async with open_client(server.address) as worker, open_client(server.address) as admin:
        await worker.submit("q", 1)
        await lease_one(worker, "q")
        with trio.fail_after(BOUND_S):
            page = await admin.workers_list()
    [entry] = page.workers
    assert entry.client is not None and entry.client.endswith(expected_name()), entry.client


async def test_the_blocking_client_names_itself_too(server):
    def lease_and_list() -> str | None:
        with connect(server.address) as worker, connect(server.address) as admin:
            worker.submit("q", 1)
            assert worker.request("lease", queues=["q"], worker_id="w", lease_ms=30_000)["jobs"]
            [entry] = admin.workers_list().workers
            return entry.client

    with trio.fail_after(BOUND_S):
        client = await trio.to_thread.run_sync(lease_and_list)
    assert client is not None and client.endswith(expected_name()), client


async def test_a_relay_worker_keeps_its_name_after_its_own_hello(server):
    """relay.Worker says hello again to read the limits: that hello names the process too
    (it once cleared the name the connection's first hello gave)."""
    started = trio.Event()
    release = trio.Event()

    async def handler(job: relay.LeasedJob) -> None:
        started.set()
        await release.wait()

    worker = relay.Worker(server.address, queues=["q"], handler=handler, concurrency=1)
    async with open_client(server.address) as admin, running(worker):
        await admin.submit("q", 1)
        with trio.fail_after(BOUND_S):
            await started.wait()
            page = await admin.workers_list()
        release.set()
    [entry] = page.workers
    assert entry.client is not None and entry.client.endswith(expected_name()), entry
