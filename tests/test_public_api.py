"""The public API is what docs/client.md says it is, and importing it stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import trio

import relay
from tests.server.test_process import server_process

DOCS = Path(__file__).resolve().parent.parent / "docs"
# What `import relay` (and a blocking client's calls) must not load: the server, the
# stores and their drivers. A web application that only submits pays for none of them.
HEAVY = ("relay.server", "relay.store", "psycopg", "sqlite_utils", "numpy")


def _documented_names() -> set[str]:
    """The names of the table that opens docs/client.md."""
    text = (DOCS / "client.md").read_text()
    table = re.search(r"\| kind \| names \|\n\|---\|---\|\n((?:\|.*\n)+)", text)
    assert table is not None, "docs/client.md lost its table of names"
    return set(re.findall(r"`(\w+)`", table.group(1)))


def test_the_documented_names_are_relays_all() -> None:
    assert _documented_names() == set(relay.__all__) == set(relay._EXPORTS)
    for name in relay.__all__:
        assert getattr(relay, name) is not None
    assert relay.NotFound is relay.JobNotFound
    assert isinstance(relay.__version__, str)


def test_every_relay_name_the_docs_use_is_importable() -> None:
    readme = DOCS.parent / "README.md"
    for path in [readme, *DOCS.glob("*.md")]:
        for name in set(re.findall(r"`relay\.(\w+)", path.read_text())):
            if name in ("db",):  # relay.db, the default database file
                continue
            assert hasattr(relay, name) or _is_module(f"relay.{name}"), (
                f"{path.name} names relay.{name}, which relay does not export"
            )


def _is_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _probe(code: str) -> list[str]:
    return [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"]


def _heavy(stdout: str) -> list[str]:
    return [m for m in stdout.split() if m.startswith(HEAVY)]


def _loaded_after(code: str) -> list[str]:
    done = subprocess.run(_probe(code), capture_output=True, text=True, timeout=60, check=True)
    return _heavy(done.stdout)


def test_import_relay_loads_no_server_store_or_driver() -> None:
    assert _loaded_after("import relay") == []


async def test_a_blocking_client_that_submits_loads_no_server_store_or_driver(
    tmp_path: Path,
) -> None:
    # The server runs in a process of its own: only the client's modules count.
    async with server_process(tmp_path / "relay.db") as server:
        host, port = server.address
        code = (
            "import relay\n"
            f"with relay.connect('{host}:{port}') as client:\n"
            "    assert client.submit('email', {'to': 'ada'}).state == 'ready'\n"
        )
        with trio.fail_after(60):
            done = await trio.run_process(_probe(code), capture_stdout=True, capture_stderr=True)
        assert _heavy(done.stdout.decode()) == []


def test_a_server_on_sqlite_loads_nothing_of_postgresql(tmp_path: Path) -> None:
    code = (
        "import trio\n"
        "from relay.server.serve import ServerConfig, serve\n"
        "async def main():\n"
        "    async with trio.open_nursery() as n:\n"
        f"        h = await n.start(serve, ServerConfig(db={str(tmp_path / 'r.db')!r}, port=0,"
        " metrics_port=0, ws_port=0))\n"
        "        h.shutdown()\n"
        "trio.run(main)\n"
    )
    loaded = _loaded_after(code)
    assert not [m for m in loaded if m.startswith(("psycopg", "relay.store.postgres", "numpy"))]
    assert "relay.store.sqlite" in loaded  # the probe did run a server
