"""The package's layers, read from its source: no import cycle anywhere, each package
imports only the packages below it, and from another package only the modules that are
its interface (docs/architecture.md, "The package map", states the same).

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING``. An
import of a package's module (``from relay.store import commands``) counts as an import
of that module, not of the package's ``__init__``.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the import name it is installed under (pyproject.toml's package-dir).
SOURCES = {"relay": "relay", "cli": "relay_cli", "scripts": "relay_scripts"}

# What each package may import (its own modules always). The most specific name that
# prefixes a module decides. ``relay`` itself is the public API: re-exports only.
BASE = {"relay.util", "relay.protocol"}
MAY_IMPORT = {
    "relay.util": set(),
    "relay.protocol": {"relay.util"},
    "relay.client": BASE,
    "relay.worker": BASE | {"relay.client"},
    "relay.store": BASE,
    "relay.server.requests": BASE | {"relay.store"},
    "relay.server.connections": BASE | {"relay.store", "relay.server.requests"},
    "relay.server.http": BASE
    | {"relay.store", "relay.server.requests", "relay.server.connections"},
    "relay.server.services": BASE | {"relay.store"},
    "relay.server": BASE | {"relay.store", "relay.server"},  # core and serve: all its parts
    "relay.local": BASE | {"relay.client", "relay.server"},
    "relay": {"relay"},
    "relay_cli": {"relay", "relay_cli"},
    "relay_scripts": {"relay", "relay_cli", "relay_scripts"},
}
# The modules another package may import from these; the rest are private to them.
INTERFACE = {
    "relay.client": {
        "relay.client.client",  # Client, open_client and what its calls return
        "relay.client.blocking",  # BlockingClient, connect
        "relay.client.replies",  # the typed replies (the worker's LeasedJob)
        "relay.client.tcp",  # the transport (the worker's), and connect failures in words
        "relay.client.tls",  # which addresses ask for TLS
    },
    "relay.worker": {"relay.worker.worker"},
    "relay.store": {
        "relay.store.base",  # the Store protocol, Changes, the configuration
        "relay.store.commands",  # what the writer runs
        "relay.store.items",  # a request on its way through the writer, and its reply sink
        "relay.store.view",  # the counts per queue as of the last commit
        "relay.store.history",  # the history's values, bounds and histograms
        "relay.store.writer",  # the writer thread's trio side
        "relay.store.sqlite",  # SqliteStore
        "relay.store.postgres",  # PostgresStore
        "relay.store.postgres.notify",  # the feed's payloads, EVERY (services/feed.py, waiters.py)
        "relay.store.postgres.schema",  # the feed's own connection
        "relay.store.backup",  # the online backup of a SQLite file (relay-trio backup)
        "relay.store.rows",  # the job browser's bounds (scripts/bench_browse.py sets them)
    },
    "relay.server": {
        "relay.server.core",  # ServerConfig, open_core (relay.local)
        "relay.server.serve",  # serve, ServerHandle
        "relay.server.connections.listen",  # the listeners, ListenError
        "relay.server.connections.tls",  # TlsConfigError
        "relay.server.requests.auth",  # tokens and roles
    },
}


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for folder, name in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [name, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports, anywhere in its source."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = [f"{base}.{alias.name}" for alias in node.names]
                found = [sub for sub in subs if sub in known]
                wanted.update(found)
                if len(found) < len(subs):  # names from the module itself
                    wanted.add(base)
        graph[name] = {other for other in wanted if other in known and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def owner(module: str, table: dict) -> str | None:
    """The most specific package of ``table`` that holds ``module``."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return ".".join(parts[:n])
    return None


def test_no_module_of_the_tree_takes_part_in_an_import_cycle() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_each_package_imports_only_the_packages_below_it() -> None:
    wrong = []
    for module, imported in sorted(import_graph(ROOT).items()):
        mine = owner(module, MAY_IMPORT)
        assert mine is not None, f"{module} belongs to no layer: add its package to MAY_IMPORT"
        for other in sorted(imported):
            theirs = owner(other, MAY_IMPORT)
            if theirs != mine and not any(
                theirs == allowed or (theirs or "").startswith(allowed + ".")
                for allowed in MAY_IMPORT[mine]
            ):
                wrong.append(f"{module} -> {other}")
    assert wrong == []


def test_another_package_imports_only_a_packages_interface() -> None:
    wrong = []
    for module, imported in sorted(import_graph(ROOT).items()):
        for other in sorted(imported):
            package = owner(other, INTERFACE)
            if package is None or module.startswith(package + ".") or module == "relay":
                continue  # not a guarded package, its own module, or the public API
            if other not in INTERFACE[package]:
                wrong.append(f"{module} -> {other}")
    assert wrong == []


def test_the_interfaces_name_modules_that_exist() -> None:
    known = modules(ROOT)
    assert [m for names in INTERFACE.values() for m in names if m not in known] == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_cycle_hidden_under_type_checking_or_in_a_function_is_found(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "relay/__init__.py": "",
            "relay/a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from relay.b import B\n",
            "relay/b.py": "def f():\n    from relay import c\n",
            "relay/c.py": "from . import a\n",
            "relay/d.py": "import relay.a\n",
            "cli/__init__.py": "",
            "scripts/__init__.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["relay.d"] == {"relay.a"}
    assert cycles(graph) == [["relay.a", "relay.b", "relay.c"]]


def test_importing_a_packages_module_is_not_an_import_of_the_package(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "relay/__init__.py": "",
            "relay/p/__init__.py": "from relay.p.m import X\n",
            "relay/p/m.py": "from relay.p import n\nX = 1\n",
            "relay/p/n.py": "",
            "relay/q.py": "from relay.p import X\n",
            "cli/__init__.py": "",
            "scripts/__init__.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["relay.p.m"] == {"relay.p.n"} and graph["relay.q"] == {"relay.p"}
    assert cycles(graph) == []
