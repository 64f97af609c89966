"""Texts a worker or a client chose (errors, tracebacks, worker ids, client names, keys)
reach the terminal as text: no rich markup read in them ("[/]" once made ``jobs list``
and ``workers`` end in a traceback), and no control character written as it is (an
escape sequence in an error could clear the screen). Through the command line against a
real server, on a terminal and to a pipe."""

from __future__ import annotations

from tests.server.conftest import RunningServer

from .conftest import address_of, cli_env, relay_trio

ERROR = "expected [/] got [bold]x\x1b[2J\x1b]0;pwned\x07 :smile:"
SHOWN = "expected [/] got [bold]x\\x1b[2J\\x1b]0;pwned\\x07 :smile:"


async def test_errors_worker_ids_and_client_names_are_shown_as_given(server: RunningServer):
    address = address_of(server)
    conn = await server.connect()
    await conn.ok("hello", client="svc [/] v2\x1b[31m")
    job = (await conn.ok("submit", queue="q", payload=1, retries=0, idempotency_key="k[/]\x1b"))[
        "job_id"
    ]
    [leased] = (await conn.ok("lease", queues=["q"], worker_id="w[/]\x1b[0m", lease_ms=60_000))[
        "jobs"
    ]
    await conn.ok("fail", job_id=job, worker_id="w[/]\x1b[0m", token=leased["token"],
                  error=ERROR, retryable=False, traceback=f"Traceback\n  {ERROR}\n")  # fmt: skip
    await conn.ok("submit", queue="q", payload=2)
    await conn.ok("lease", queues=["q"], worker_id="w[/]\x1b[0m", lease_ms=60_000)
    env = cli_env(address, COLUMNS="200")
    for args in (("jobs", "list"), ("dead", "list"), ("inspect", job), ("workers",)):
        result = await relay_trio(*args, env=env)
        assert result.code == 0, (args, result)
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, (args, result)
        assert "Traceback" not in result.stderr, (args, result)
        if args[0] in ("jobs", "dead", "inspect"):
            assert SHOWN[:40] in result.stdout, (args, result.stdout)
    shown = (await relay_trio("inspect", job, env=env)).stdout
    assert "w[/]\\x1b[0m" in shown and "k[/]\\x1b" in shown, shown
    assert shown.count(SHOWN) >= 2, shown  # the last error and the traceback, whole
    workers = (await relay_trio("workers", env=env)).stdout
    assert "svc [/] v2\\x1b[31m" in workers and "w[/]\\x1b[0m" in workers, workers
    await conn.aclose()
