"""The ids the commands show: asked of the server (``short_ids``), in requests it takes,
and nothing asked of a server without the op."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import trio

import relay
from relay.protocol import wire
from relay.protocol.errors import BadRequest, UnknownOp
from relay_cli.ids import server_short_ids
from tests.conftest import assert_abbreviated_as_git_does
from tests.server.conftest import BOUND_S, start_server
from tests.worker.helpers import serving


async def test_the_ids_of_more_rows_than_the_servers_max_batch_are_asked_in_smaller_requests(
    tmp_path,
):
    start = functools.partial(start_server, limits=wire.Limits(max_batch=3))
    async with serving(start, str(tmp_path / "relay.db")) as server:
        host, port = server.handle.address
        async with relay.open_client(f"{host}:{port}") as client:
            with trio.fail_after(BOUND_S):
                made = [(await client.submit("q", n)).job_id for n in range(7)]
                short = await server_short_ids(client, [*made, made[0]])
    assert list(short) == made
    assert_abbreviated_as_git_does(made, made, [short[job_id] for job_id in made])


class _Asked:
    """A client whose ``short_ids`` raises ``error`` (and records what it was asked)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.asked: list[list[str]] = []

    async def short_ids(self, job_ids: Sequence[str]) -> list[str]:
        self.asked.append(list(job_ids))
        raise self.error


async def test_a_server_without_short_ids_gives_none_and_other_refusals_are_raised():
    older = _Asked(UnknownOp("unknown op 'short_ids'"))
    assert await server_short_ids(older, ["job_0000000000000001"]) is None  # type: ignore[arg-type]
    assert older.asked == [["job_0000000000000001"]]
    refusing = _Asked(BadRequest("job_ids[0]: not a job id"))
    with pytest.raises(BadRequest):
        await server_short_ids(refusing, ["job_0000000000000001"] * 2)  # type: ignore[arg-type]
    assert refusing.asked == [["job_0000000000000001"]]  # (asked once per id)
    assert await server_short_ids(older, []) == {}  # type: ignore[arg-type]
    assert len(older.asked) == 1
