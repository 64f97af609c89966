"""``relay-trio top``: its view, drawn into a recording Console, shows what the server says."""

from __future__ import annotations

import trio
from rich.console import Console

import relay
from relay_cli.top import TopView, _follow, age, follow
from tests.server.conftest import BOUND_S, start_server

W = "top-worker"


def draw(view: TopView) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(view.render())
    return console.export_text()


async def test_top_shows_the_counts_rates_and_failures_the_server_reports(server):
    now = [0.0]
    view = TopView(clock=lambda: now[0])
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client, trio.open_nursery() as nursery:
        nursery.start_soon(_follow, client, view)
        with trio.fail_after(BOUND_S):
            while view.server is None:  # noqa: ASYNC110 (its first stats)
                await trio.sleep(0.01)
        for n in range(5):
            await client.submit("mail", {"n": n}, retries=0)
        leased = await client.lease(["mail"], W, count=2)
        await client.ack(leased[0].job_id, W, leased[0].token)
        await client.fail(leased[1].job_id, W, leased[1].token, "smtp said no\ntrace")
        stats = await client.stats()
        with trio.fail_after(BOUND_S):
            while view.queues.get("mail") != stats.queues["mail"] or not view.failures:  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    text = draw(view)
    row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("mail"))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    counts = dict(zip(["pending", "ready", "leased", "retrying", "succeeded", "dead"],
                      cells[1:7], strict=True))  # fmt: skip
    assert counts == {s: str(n) for s, n in stats.queues["mail"].items()}
    assert counts["ready"] == "3" and counts["succeeded"] == "1" and counts["dead"] == "1"
    # 5 submitted, 1 succeeded, 1 failed within the 10 s window: per second.
    assert cells[7] == age(view.oldest_ready_ms["mail"])  # the 3 ready jobs' wait
    assert cells[8:11] == ["0.5", "0.1", "0.1"]
    assert leased[1].job_id in text and "smtp said no" in text and "trace" not in text
    now[0] += 11  # the window moves on: the rates fall to zero, the counts stay
    assert [c.strip() for c in next(
        line for line in draw(view).splitlines() if line.lstrip("│ ").startswith("mail")
    ).strip("│ ").split("│")][8:11] == ["0.0", "0.0", "0.0"]  # fmt: skip


def test_top_says_when_it_reconnects_and_what_it_lost():
    view = TopView(clock=lambda: 0.0)
    view.status = "reconnecting to 127.0.0.1:7400 (ConnectionLost)"
    view.event({"event": "lagged", "dropped": 12})
    text = draw(view)
    assert "reconnecting to 127.0.0.1:7400" in text and "12 events lost to lag" in text


async def test_top_follows_the_server_across_a_restart(tmp_path):
    """The server goes away: top says it is reconnecting; the server comes back on the same
    address: top says connected again and shows the new counts."""
    db = str(tmp_path / "relay.db")
    view = TopView()

    async def until(done) -> None:
        with trio.fail_after(BOUND_S):
            while not done():  # noqa: ASYNC110 (the view is fed by its own task)
                await trio.sleep(0.01)

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            first = await start_server(nursery, db, shutdown_timeout_ms=1000)
            host, port = first.handle.address
            address = f"{host}:{port}"
            async with relay.open_client(address) as client:
                await client.submit("mail", {"n": 1})
            outer.start_soon(follow, address, None, None, view)
            await until(lambda: view.queues.get("mail", {}).get("ready") == 1)
            assert view.status == f"connected to {address}"
            first.handle.shutdown()
        await until(lambda: view.status.startswith("reconnecting"))
        assert "reconnecting" in draw(view)
        async with trio.open_nursery() as nursery:
            second = await start_server(nursery, db, port=port, shutdown_timeout_ms=1000)
            async with relay.open_client(address) as client:
                await client.submit("mail", {"n": 2})
            await until(lambda: view.queues.get("mail", {}).get("ready") == 2)
            assert view.status == f"connected to {address}"
            outer.cancel_scope.cancel()
            second.handle.shutdown()


def test_only_a_job_just_made_counts_as_submitted():
    view = TopView(clock=lambda: 0.0)
    base = {"event": "job", "job_id": "job_1", "queue": "q", "attempt": 0, "at": 1}
    view.event({**base, "state": "ready"})  # submitted
    view.event({**base, "state": "pending", "job_id": "job_2"})  # submitted, delayed
    view.event({**base, "state": "ready", "from": "dead"})  # dead_retry: not a new job
    view.event({**base, "state": "ready", "from": "leased"})  # its first lease released
    view.event({**base, "state": "ready", "from": "pending", "job_id": "job_2"})  # due
    assert view.rates() == {"q": {"submitted": 2 / 10}}
