"""The console script over TLS: --tls, --tls-ca and RELAY_TLS_CA on the client commands,
--tls-cert and --tls-key on the server, and their failures as one line each."""

from __future__ import annotations

import functools
import ssl
import subprocess
from collections.abc import AsyncIterator

import click
import pytest
import trio

from relay import JobState, open_client
from relay.client.client import Client
from relay_cli.errors import _explain
from relay_cli.main import main
from tests.server.conftest import RunningServer, start_server
from tests.server.test_process import RELAY, server_process
from tests.tls_helpers import TlsFiles
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker.helpers import serving

from .conftest import BOUND_S, address_of, assert_one_line_error, cli_env, relay_trio
from .test_commands import run_worker_until, wait_for_states


@pytest.fixture
async def tls_server(tmp_path, tls_files: TlsFiles) -> AsyncIterator[RunningServer]:
    start = functools.partial(start_server, **tls_files.server_options())
    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


@pytest.fixture
async def tls_client(tls_server, tls_files) -> AsyncIterator[Client]:
    async with open_client(address_of(tls_server), tls_ca=tls_files.ca) as client:
        yield client


def test_every_client_command_takes_tls_and_tls_ca():
    def commands(group: click.Group) -> list[click.Command]:
        found = []
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            found += commands(command) if isinstance(command, click.Group) else [command]
        return found

    clients = [c for c in commands(main) if any(p.name == "address" for p in c.params)]
    clients = [c for c in clients if c.name != "server"]
    assert {c.name for c in clients} >= {"submit", "stats", "inspect", "worker", "list"}
    for command in clients:
        options = {p.name: p for p in command.params}
        assert "tls" in options and "tls_ca" in options, command.name
        assert options["tls_ca"].envvar == "RELAY_TLS_CA"


def test_a_certificate_failure_is_explained_with_the_address_and_reason():
    exc = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] ...")
    exc.verify_message = "self-signed certificate in certificate chain"
    problem = _explain(exc, "tls://h:1")
    assert problem is not None
    assert problem.message == (
        "cannot connect to tls://h:1: TLS certificate verification failed: self-signed "
        "certificate in certificate chain"
    )


async def test_commands_use_tls_with_tls_ca_or_relay_tls_ca(tls_server, tls_files, tls_client):
    address = address_of(tls_server)
    submitted = await relay_trio(
        "submit", "tls", "--payload", '{"n": 1}', "--tls-ca", tls_files.ca, address=address
    )
    assert submitted.code == 0, submitted
    job_id = submitted.stdout.split()[0]
    # The env alone implies TLS; a tls:// address says so as well.
    stats = await relay_trio("stats", "--json", env=cli_env(address, RELAY_TLS_CA=tls_files.ca))
    assert stats.code == 0, stats
    assert stats.json()["queues"]["tls"]["ready"] == 1
    inspected = await relay_trio(
        "inspect", job_id, "--json", env=cli_env(f"tls://{address}", RELAY_TLS_CA=tls_files.ca)
    )
    assert inspected.code == 0, inspected
    assert inspected.json()["payload"] == {"n": 1}
    assert (await tls_client.inspect(job_id)).payload == {"n": 1}


async def test_worker_leases_over_tls(tls_server, tls_files, tls_client):
    address = address_of(tls_server)
    submitted = await tls_client.submit("tls", {"n": 2})

    async def body() -> None:
        await wait_for_states(tls_client, [submitted.job_id], JobState.SUCCEEDED)

    env = cli_env(address, RELAY_TLS_CA=tls_files.ca)
    worker = await run_worker_until(address, ["--queue", "tls"], body, env=env)
    assert worker.process.returncode == 0, worker.stderr


async def test_an_untrusted_server_is_one_line_naming_the_address_and_reason(tls_server):
    address = address_of(tls_server)
    result = await relay_trio("stats", "--tls", address=address)
    assert_one_line_error(
        result, f"cannot connect to tls://{address}", "TLS certificate verification failed"
    )


async def test_a_tls_ca_that_does_not_exist_is_a_usage_error(tmp_path, tls_server):
    result = await relay_trio(
        "stats", "--tls-ca", str(tmp_path / "nope.pem"), address=address_of(tls_server)
    )
    assert_one_line_error(result, "--tls-ca", "nope.pem", code=2)


# -- the server -----------------------------------------------------------------------------


async def test_server_serves_tls_with_tls_cert_and_tls_key(tmp_path, tls_files):
    args = ["--tls-cert", tls_files.cert, "--tls-key", tls_files.key]
    async with server_process(tmp_path / "relay.db", *args) as server:
        assert server.address is not None
        address = "{}:{}".format(*server.address)
        started = [e for e in server.events if e.get("event") == "server.started"]
        assert started[0]["tls"] is True
        stats = await relay_trio("stats", "--json", "--tls-ca", tls_files.ca, address=address)
        assert stats.code == 0, stats
        plain = await relay_trio("stats", address=address)
        assert plain.code == 1 and "Traceback" not in plain.stderr, plain


@pytest.mark.parametrize(
    ("make_args", "fragments", "code"),
    [
        (lambda f, tmp: ["--tls-cert", str(tmp / "nope.pem"), "--tls-key", f.key],
         ["cannot load TLS certificate", "nope.pem", "no such file"], 2),
        (lambda f, tmp: ["--tls-cert", f.cert, "--tls-key", f.cert],
         ["cannot load TLS key", "cert.pem", "no PEM private key"], 2),
        (lambda f, tmp: ["--tls-cert", f.cert], ["--tls-cert and --tls-key together"], 2),
    ],
    ids=["missing certificate", "certificate as key", "certificate alone"],
)  # fmt: skip
async def test_server_refuses_tls_files_it_cannot_use_at_start(
    tmp_path, tls_files, make_args, fragments, code
):
    db = tmp_path / "relay.db"
    command = [
        str(RELAY), "server", "--db", str(db), "--address", "127.0.0.1:0",
        "--metrics-address", "off", "--ws-address", "off", *make_args(tls_files, tmp_path),
    ]  # fmt: skip
    with trio.fail_after(BOUND_S):
        done = await trio.run_process(
            command, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True,
            check=False, env=cli_env(),
        )  # fmt: skip
    stderr = done.stderr.decode(errors="replace")
    lines = [line for line in stderr.splitlines() if line.startswith("relay-trio: ")]
    assert done.returncode == code, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not db.exists()  # stopped before opening the database
