"""The systemd unit in docs/deploy/: ``systemd-analyze verify`` accepts it, and its numbers
match the example configuration beside it (the stop timeout covers the server's drain, the
open-files limit its connections), with the settings docs/operations.md promises.

``systemd-analyze`` comes with Debian's systemd package; without it these tests fail,
saying so, rather than skip (.ci/run installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from relay_cli.server import SPARE_FILES

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "docs" / "deploy" / "relay-trio.service"
EXAMPLE = ROOT / "docs" / "deploy" / "relay.toml"
# The relay-trio console script of this environment: a real executable for ExecStart.
RELAY = Path(sys.executable).parent / "relay-trio"
# What the server does after the drain: the writer's last commit and checkpoint, within
# the same timeout again (relay/store/writer.py, open_writer), then the last log lines.
STOPS_IN = 2


def settings(text: str) -> dict[str, list[str]]:
    """The unit's ``Key=value`` lines by key (every value, for keys given more than once)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, f"a duration this test reads: {value!r}"
    return int(match[1]) * (60 if match[2] == "min" else 1)


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path):
    """``verify`` checks that ExecStart's program exists and is executable: the unit names
    where docs/operations.md installs it (/opt/relay-trio/bin/relay-trio), which this
    machine does not have, so a copy of the unit runs this environment's relay-trio. Every
    other line is verified as written, and any warning (an unknown key, a bad value) fails
    the test too."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail(
            "systemd-analyze is missing: install Debian's systemd package "
            "(apt-get install systemd; .ci/run does)"
        )
    text = UNIT.read_text()
    assert "ExecStart=/opt/relay-trio/bin/relay-trio " in text
    assert RELAY.exists(), RELAY
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("/opt/relay-trio/bin/relay-trio", str(RELAY)))
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr
    # It does fail where it should: a program that does not exist.
    copy.write_text(text.replace("/opt/relay-trio/bin/relay-trio", str(tmp_path / "nowhere")))
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0 and "nowhere" in done.stderr, done


def test_the_unit_matches_the_example_configuration():
    unit = settings(UNIT.read_text())
    config = tomllib.loads(EXAMPLE.read_text())
    [start] = unit["ExecStart"]
    assert "server --config /etc/relay-trio/relay.toml" in start
    # The stop timeout covers the drain and the writer's close, each up to the timeout.
    [stop] = unit["TimeoutStopSec"]
    assert seconds(stop) > STOPS_IN * config["shutdown_timeout_ms"] / 1000
    # Every connection has its descriptor, and the server's own files theirs.
    [files] = unit["LimitNOFILE"]
    assert int(files) >= config["max_connections"] + SPARE_FILES
    # The database lives in the state directory the unit gives the user.
    [state] = unit["StateDirectory"]
    assert config["db"].startswith(f"/var/lib/{state}/")


def test_the_unit_runs_as_its_own_user_restarts_on_failure_and_is_hardened():
    unit = settings(UNIT.read_text())
    expected = {
        "User": "relay-trio",
        "Restart": "on-failure",
        "RestartPreventExitStatus": "2",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ExecReload": "/bin/kill -HUP $MAINPID",
    }
    for key, value in expected.items():
        assert unit.get(key) == [value], (key, unit.get(key))
    assert unit["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
