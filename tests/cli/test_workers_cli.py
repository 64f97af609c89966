"""``relay-trio workers``: the view at 80, 120 and 200 columns (one line per worker, its
numbers whole, the texts cut in the middle; a queue with ready jobs and no worker in a
table of its own), and the command against a real server with workers connected, its
``--json``, and its refusal for a producer token."""

from __future__ import annotations

import pytest

from relay.client.client import ServerInfo, Stats, WorkerInfo, WorkersPage
from relay.client.replies import HeldJob
from relay_cli import views
from tests.cli.test_auth_cli import PRODUCER, WORKER, authed, env_with
from tests.cli.test_views import QUEUE_40, WIDTHS, counts, lines_of, row
from tests.conftest import T0
from tests.server.conftest import RunningServer

from .conftest import address_of, assert_one_line_error, relay_trio

__all__ = ["authed"]  # (a fixture)

NOW = T0 + 3_600_000


def worker(worker_id: str, queues: list[str], held: list[int | None], **fields) -> WorkerInfo:
    jobs = [HeldJob(f"job_34454878800000{i:02x}", queues[0], worker_id, ms, NOW + 30_000)
            for i, ms in enumerate(held)]  # fmt: skip
    known = [ms for ms in held if ms is not None]
    defaults = dict(
        worker_id=worker_id, worker_ids=[worker_id], client="relay.Worker/0.1",
        peer="10.0.12.7:51234", queues=queues, queues_total=len(queues), jobs=jobs,
        jobs_held=len(jobs), longest_held_ms=max(known) if known else None,
        connected_at=T0, first_lease_at=T0, last_request_at=NOW - 2_500, parked=0,
    )  # fmt: skip
    return WorkerInfo(**(defaults | fields))


def page(*workers: WorkerInfo) -> WorkersPage:
    return WorkersPage(server="build-7:7400", workers=list(workers), total=len(workers),
                       next_cursor=None, at=NOW)  # fmt: skip


def server_stats(**queues: dict[str, int]) -> Stats:
    info = ServerInfo(version="0.1.0", uptime_ms=3_723_000, connections=2)
    return Stats(queues=queues, server=info, oldest_ready_ms={"reports": 754_000})


@pytest.mark.parametrize("width", WIDTHS)
def test_each_worker_is_one_line_with_its_jobs_and_longest_hold(width):
    shown = page(
        worker("mailer-host-a-1234", ["email", "sms"], [65_000, 3_000]),
        worker("resizer-7f3a9c", [QUEUE_40], [None], client=None, parked=1,
               peer="[2001:db8::17]:40022"),
        worker("idle-one", ["email"], [], last_request_at=NOW - 90_000),
    )  # fmt: skip
    stats = server_stats(email=counts(ready=3), reports=counts(ready=12, leased=1))
    lines = lines_of(views.workers_table(shown, stats), width)
    assert "Workers of build-7:7400" in lines[0]
    first = row(lines, "mailer-h")
    assert "rela" in first and "10.0.12.7:51234" in first and "email,sms" in first
    assert first.split()[-5:] == ["2", "1m", "05s", "2.5", "s"]  # jobs, longest held, idle
    second = row(lines, "resizer")
    assert second.split()[-4:] == ["1", "?", "2.5", "s", "*"][-4:]  # held since unknown
    assert second.endswith("s *")  # a long-poll parked
    idle = row(lines, "idle-one")
    assert idle.split()[-4:] == ["0", "-", "1m", "30s"]
    if width >= 120:
        assert QUEUE_40 in second and "mailer-host-a-1234" in first
        assert "[2001:db8::17]:40022" in second
    if width >= 200:
        assert "relay.Worker/0.1" in first
    # A queue with ready jobs that no worker asks for is flagged with its oldest wait.
    title = next(x for x in lines if "Ready jobs and no worker on this server" in x)
    flagged = lines[lines.index(title) :]
    assert "reports" in row(flagged, "reports") and "12m 34s" in row(flagged, "reports")
    assert not [x for x in flagged if "email" in x]


def test_no_workers_and_no_idle_queue_say_so():
    lines = lines_of(views.workers_table(page(), server_stats(email=counts(leased=2))), 80)
    assert any("no worker connected to this server" in line for line in lines)
    assert any("every queue with ready jobs has a worker" in line for line in lines)


def test_a_paused_queue_is_not_flagged_and_more_workers_are_counted():
    stats = server_stats(reports=counts(ready=3))
    stats = Stats(queues=stats.queues, server=stats.server, paused=["reports"])
    lines = lines_of(views.workers_table(page(worker("a", ["x"], [])), stats, more=7), 80)
    assert any("and 7 more: --limit N" in line for line in lines)
    assert not any("Ready jobs and no worker" in line for line in lines)


async def test_the_command_lists_connected_workers_and_flags_an_idle_queue(
    server: RunningServer,
):
    address = address_of(server)
    feeder = await server.connect()
    for queue in ("busy", "busy", "stuck"):
        await feeder.ok("submit", queue=queue, payload=1)
    conn = await server.connect()
    await conn.ok("hello", client="pump/2")
    await conn.ok("lease", queues=["busy"], worker_id="pump-1", count=1, lease_ms=60_000)
    result = await relay_trio("workers", address=address)
    assert result.code == 0, result
    lines = result.stdout.splitlines()
    assert "pump-1" in row(lines, "pump/2")
    assert "stuck" in row(lines[lines.index(row(lines, "no worker")) :], "stuck")
    as_json = (await relay_trio("workers", "--json", address=address)).json()
    [entry] = as_json["workers"]
    assert (entry["worker_id"], entry["client"], entry["jobs_held"]) == ("pump-1", "pump/2", 1)
    assert as_json["idle_queues"] == ["stuck"] and as_json["server"].endswith(
        f":{server.handle.address[1]}"
    )
    for each in (feeder, conn):
        await each.aclose()


async def test_a_producer_token_is_refused_and_a_worker_token_is_not(authed: RunningServer):
    address = address_of(authed)
    refused = await relay_trio("workers", env=env_with(address, PRODUCER))
    assert_one_line_error(refused, "unauthorized", "worker")
    listed = await relay_trio("workers", "--json", env=env_with(address, WORKER))
    assert listed.code == 0 and listed.json()["workers"] == [], listed
