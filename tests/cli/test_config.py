"""``relay-trio server --config FILE``, its environment variables and ``--print-config``,
through the console script as a subprocess (``--print-config`` exits before anything is
opened): the command line overrides the environment, which overrides the file, which
overrides the defaults; an unknown key or a value of the wrong type is one line naming the
file and the key; secrets are masked; docs/deploy/relay.toml is what ``--print-config``
prints for it.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from relay_cli.config import keyed_options
from relay_cli.server import server

from .conftest import RELAY, Result, assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "deploy" / "relay.toml"
SECRET = "s3cret-password"
TOKEN = "an-admin-token-nobody-may-read"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any RELAY_ variable (a developer's own would leak into the
    merged configuration), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(extra)
    return env


def run(*args: str, **env: str) -> Result:
    done = subprocess.run(
        [str(RELAY), "server", *args], capture_output=True, text=True, env=clean_env(**env),
        stdin=subprocess.DEVNULL, timeout=60, check=False,
    )  # fmt: skip
    return Result(done.returncode, done.stdout, done.stderr)


def printed(*args: str, **env: str) -> dict:
    """The active keys of ``--print-config``'s output (it must parse as TOML)."""
    result = run(*args, "--print-config", **env)
    assert result.code == 0, result
    assert result.stderr == "", result.stderr
    return tomllib.loads(result.stdout)


@pytest.fixture
def config(tmp_path: Path):
    def write(text: str) -> Path:
        path = tmp_path / "relay.toml"
        path.write_text(text)
        return path

    return write


def test_the_command_line_beats_the_environment_beats_the_file_beats_the_default(config):
    path = str(config("max_connections = 100\nmax_in_flight = 7\n"))
    assert "max_connections" not in printed()  # the default: commented out
    assert printed("--config", path)["max_connections"] == 100
    env = {"RELAY_MAX_CONNECTIONS": "200"}
    assert printed("--config", path, **env)["max_connections"] == 200
    both = printed("--config", path, "--max-connections", "300", **env)
    assert both["max_connections"] == 300
    # A key the others leave alone keeps the file's value.
    assert both["max_in_flight"] == 7


def test_each_override_says_where_it_came_from(config):
    path = str(config("max_connections = 100\nmax_in_flight = 7\n"))
    result = run("--config", path, "--max-in-flight", "9", "--print-config",
                 RELAY_MAX_CONNECTIONS="200")  # fmt: skip
    lines = result.stdout.splitlines()
    assert "max_connections = 200  # from RELAY_MAX_CONNECTIONS" in lines
    assert "max_in_flight = 9  # from the command line" in lines


def test_the_environment_variables_of_before_still_work(config):
    # RELAY_ADDRESS (the clients' too) and RELAY_LOG (every command's level) keep their
    # meaning; the new names of the rule work beside them.
    path = str(config('address = "127.0.0.1:1"\nlog_level = "debug"\n'))
    keys = printed("--config", path, RELAY_ADDRESS="127.0.0.1:2", RELAY_LOG="warning")
    assert (keys["address"], keys["log_level"]) == ("127.0.0.1:2", "warning")
    assert printed("--config", path, RELAY_LOG_LEVEL="info")["log_level"] == "info"
    assert printed(RELAY_LOG_FORMAT="json")["log_format"] == "json"


def test_the_config_file_may_come_from_the_environment(config):
    path = str(config("max_batch = 5\n"))
    assert printed(RELAY_CONFIG=path)["max_batch"] == 5


def test_repeatable_options_are_arrays_and_flags_booleans(config):
    path = str(config('ws_origins = ["https://a.example"]\nqueue_depths = ["emails=10"]\n'
                      "insecure = true\n"))  # fmt: skip
    keys = printed("--config", path)
    assert keys["ws_origins"] == ["https://a.example"]
    assert keys["queue_depths"] == ["emails=10"]
    assert keys["insecure"] is True
    # The command line replaces the file's array, as for any other key.
    keys = printed("--config", path, "--ws-origin", "https://b.example")
    assert keys["ws_origins"] == ["https://b.example"]


def test_an_unknown_key_is_one_line_naming_the_key_and_the_file(config):
    path = str(config("max_connections = 10\nmax_conections = 5\n"))
    result = run("--config", path)
    assert_one_line_error(result, path, "unknown key 'max_conections'", "max_connections",
                          code=2)  # fmt: skip
    # The options about the file itself are no keys of it, and neither is a table.
    for text in ("print_config = true\n", "config = 'other.toml'\n", "[server]\nport = 1\n"):
        assert_one_line_error(run("--config", str(config(text))), path, "unknown key", code=2)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('max_connections = "many"', ["max_connections must be an integer", "a string"]),
        ("max_connections = true", ["max_connections must be an integer", "a boolean"]),
        ("max_connections = 0", ["max_connections", "not in the range"]),
        ("insecure = 1", ["insecure must be true or false", "an integer"]),
        ('ws_origins = "https://a.example"', ["ws_origins must be an array of strings"]),
        ("ws_origins = [1]", ["ws_origins must be an array of strings"]),
        ("db = { path = 'x' }", ["db must be a string", "a table"]),
        ('log_format = "xml"', ["log_format", "'xml' is not one of"]),
        ('db = ""', ["db: is empty"]),
        ('queue_depths = ["emails"]', ["queue_depths: 'emails' is not QUEUE=N"]),
        ("db = ", ["is not valid TOML", "line 1"]),
    ],
)
def test_a_wrong_value_is_one_line_naming_the_key_the_file_and_the_type(config, text, fragments):
    path = str(config(text + "\n"))
    assert_one_line_error(run("--config", path), path, *fragments, code=2)


def test_a_missing_file_is_one_line(tmp_path):
    path = str(tmp_path / "nowhere.toml")
    assert_one_line_error(run("--config", path), path, "No such file", code=2)


def test_print_config_masks_secrets_and_prints_valid_toml(config):
    url = f"postgresql://relay:{SECRET}@db.example:5432/relay?password={SECRET}&sslmode=require"
    path = str(config(f'db = "{url}"\n'))
    result = run("--config", path, "--print-config", RELAY_AUTH_TOKEN=TOKEN)
    assert result.code == 0, result
    assert SECRET not in result.stdout and TOKEN not in result.stdout, result.stdout
    db = tomllib.loads(result.stdout)["db"]
    assert db == "postgresql://relay:***@db.example:5432/relay?password=***&sslmode=require"
    assert "RELAY_AUTH_TOKEN is set" in result.stdout


def test_print_config_shows_every_key(config):
    """Every option of the command is a key, commented out at its default: the printed
    text, uncommented, is a complete file."""
    result = run("--print-config")
    for key in keyed_options(server):
        assert f"# {key} = " in result.stdout, key


def test_the_example_is_what_print_config_shows_for_it():
    """docs/deploy/relay.toml parses, every key in it is known, and it is exactly what
    ``--print-config`` shows for it (help texts and defaults included): it stays true to
    the command. After changing an option, write it again with
    ``relay-trio server --config docs/deploy/relay.toml --print-config > /tmp/relay.toml``
    (RELAY_ variables unset) and move it over the example."""
    keys = tomllib.loads(EXAMPLE.read_text())
    assert set(keys) <= set(keyed_options(server)), set(keys) - set(keyed_options(server))
    result = run("--config", str(EXAMPLE), "--print-config")
    assert result.code == 0, result
    assert result.stdout == EXAMPLE.read_text()
