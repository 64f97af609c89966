"""What the wheel installs: the project's packages under its own names, and nothing a user's
own module could collide with (the repository's cli/ and scripts/ install as relay_cli and
relay_scripts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each folder of the repository goes in the wheel (pyproject.toml's package-dir).
INSTALLED_AS = {"relay": "relay", "cli": "relay_cli", "scripts": "relay_scripts"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in INSTALLED_AS:
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    # No build isolation: setuptools comes from the test extras, nothing is downloaded.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, timeout=300, cwd=source, env={"PATH": "/usr/bin:/bin", "HOME": str(source)},
    )  # fmt: skip
    (path,) = out.glob("relay_trio-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _top_level(archive: zipfile.ZipFile) -> set[str]:
    return {name.split("/", 1)[0] for name in archive.namelist()}


def test_the_wheel_installs_only_names_of_its_own(wheel: zipfile.ZipFile) -> None:
    names = _top_level(wheel)
    dist_info = {name for name in names if name.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert names - dist_info == {"relay", "relay_cli", "relay_scripts"}


def test_every_package_of_the_tree_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    files = set(wheel.namelist())
    for folder, name in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            package = init.parent.relative_to(ROOT / folder)
            installed = Path(name, package, "__init__.py").as_posix()
            assert installed in files, f"{init.relative_to(ROOT)} is missing from the wheel"
        for module in (ROOT / folder).rglob("*.py"):
            installed = Path(name, module.relative_to(ROOT / folder)).as_posix()
            assert installed in files, f"{module.relative_to(ROOT)} is missing from the wheel"
    assert "relay/server/http/dashboard.html" in files  # data, not code


def test_the_console_scripts_name_the_installed_packages(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "relay-trio = relay_cli.main:main" in text
    assert "relay-bench = relay_scripts.bench.main:main" in text


def test_a_users_own_cli_package_is_the_one_a_handler_names(tmp_path: Path) -> None:
    """A user's project with its own cli/jobs.py: ``--handler cli.jobs:send`` imports it
    (it used to find relay-trio's own cli package first)."""
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("")
    (tmp_path / "cli" / "jobs.py").write_text("def send(job):\n    return 'sent'\n")
    code = (
        "from relay_cli.work import load_handler\n"
        "handler = load_handler('cli.jobs:send')\n"
        "print(handler.__module__, handler(None))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cli.jobs", "sent"]
