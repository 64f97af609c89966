"""``relay-trio server``'s configuration file and environment variables, derived from the
command's own click options: one table of options (the command's), not a second list.

Each option of the command is a key of the TOML file given with ``--config PATH``: its
click parameter name, that is its long name with underscores for dashes (``--max-connections``
is ``max_connections``), and the plural for the two repeatable ones (``ws_origins``,
``queue_depths``: arrays). Each is also an environment variable, ``RELAY_`` and the key in
capitals (``RELAY_MAX_CONNECTIONS``); an option that had a variable of its own keeps it too
(``--log-level`` reads ``RELAY_LOG_LEVEL``, then ``RELAY_LOG``).

The order is click's own order of a parameter's sources: the command line, then the
environment, then the file (the context's ``default_map``), then the option's default.
A key the command does not know, or a value of the wrong type or out of range, is one line
naming the file and the key (exit 2). ``--print-config`` prints the merged configuration as
TOML, with the option's help above each key, keys at their default commented out, secrets
masked: docs/deploy/relay.toml is what it prints for that file.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import textwrap
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import click
from click.core import ParameterSource

from relay_cli.errors import ConfigurationError

ENV_PREFIX = "RELAY_"
# Options about the file itself, not settings of the server: no key, no variable.
FILE_OPTIONS = frozenset({"config", "print_config"})
# A mask for the secret part of a value --print-config shows.
MASK = "***"
# Width of --print-config's comment lines (the option help above each key).
COMMENT_WIDTH = 88
# The environment variable that adds one admin token (cli/server.py): a secret, never shown.
TOKEN_VARIABLE = "RELAY_AUTH_TOKEN"

HEADER = """\
# relay-trio server configuration (TOML), as `relay-trio server --print-config` shows it.
# Each key is an option of `relay-trio server --help` (dashes as underscores); a key at
# its default is commented out. Order: command line > environment (RELAY_<KEY>) > this
# file > defaults. See docs/operations.md.
"""


def mask_url(value: str) -> str:
    """A database URL with its password (in the address or as ``password=`` in the query)
    masked; a file path as it is."""
    if "://" not in value:
        return value
    parts = urllib.parse.urlsplit(value)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(
            f"{k}={MASK if k == 'password' else urllib.parse.quote(v, safe='/:')}" for k, v in pairs
        )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


# The keys whose values may hold a secret, and how --print-config masks it.
SECRETS: dict[str, Callable[[str], str]] = {"db": mask_url}


def keyed_options(command: click.Command) -> dict[str, click.Option]:
    """The command's options that are keys of the file, by key, in the order of --help."""
    return {
        param.name: param
        for param in command.params
        if isinstance(param, click.Option)
        and param.name is not None
        and param.name not in FILE_OPTIONS
        and not param.hidden
        and param.expose_value
    }


def variables(option: click.Option) -> list[str]:
    """The environment variables an option reads, first one first."""
    if option.envvar is None:
        return []
    return [option.envvar] if isinstance(option.envvar, str) else list(option.envvar)


def configurable(command: click.Command) -> click.Command:
    """Give each option of ``command`` its environment variable (RELAY_<KEY>, after the one
    it has, if any) and add ``--config`` and ``--print-config``."""
    for key, option in keyed_options(command).items():
        mine = ENV_PREFIX + key.upper()
        have = variables(option)
        option.envvar = [*have, mine] if have and mine not in have else have or mine
        option.show_envvar = True
    config = click.Option(
        ["--config", "config"], metavar="PATH", envvar=ENV_PREFIX + "CONFIG",
        show_envvar=True, is_eager=True, expose_value=False, callback=_read_file,
        help="A TOML file whose keys are these options (dashes as underscores). The "
        "command line and the environment (RELAY_<KEY>) override it.",
    )  # fmt: skip
    show = click.Option(
        ["--print-config", "print_config"], is_flag=True, expose_value=False,
        callback=_keep_flag,
        help="Print the merged configuration as TOML (secrets masked) and exit.",
    )  # fmt: skip
    command.params += [config, show]
    return command


def _keep_flag(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    ctx.meta[f"relay.{param.name}"] = value


def print_config_requested(ctx: click.Context) -> bool:
    return bool(ctx.meta.get("relay.print_config"))


# -- the file ------------------------------------------------------------------------------


def expected_type(option: click.Option) -> tuple[str, Callable[[Any], bool]]:
    """What a key's value must be in the file: its name in an error, and the check."""
    if option.multiple:
        return (
            "an array of strings",
            lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        )
    if option.is_flag:
        return "true or false", lambda v: isinstance(v, bool)
    if isinstance(option.type, click.types.IntParamType):
        return "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)
    return "a string", lambda v: isinstance(v, str)


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {
        int: "an integer", float: "a float", str: "a string", list: "an array",
        dict: "a table",
    }.get(type(value), "a date or time")  # fmt: skip


def _read_file(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """``--config``: read the file (before every other option: it is eager), check each key
    and value, and make it the defaults the other options fall back to."""
    if path is None:
        return
    ctx.meta["relay.config_path"] = path
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the configuration file {path}: {exc.strerror or exc}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{path} is not valid TOML: not UTF-8 ({exc.reason})") from None
    assert ctx.command is not None
    options = keyed_options(ctx.command)
    for key, value in data.items():
        option = options.get(key)
        if option is None:
            close = difflib.get_close_matches(key, options, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigurationError(
                f"{path}: unknown key {key!r} ({hint}the keys are the options of "
                f"'{ctx.command_path} --help', dashes as underscores)"
            )
        wanted, check = expected_type(option)
        if not check(value):
            raise ConfigurationError(
                f"{path}: {key} must be {wanted}, not {_toml_type(value)}"
                + (f" ({toml_value(value)})" if not isinstance(value, dict | list) else "")
            )
        # The option's own checks (its type's range or choices, its callback's), so that a
        # value they refuse is said with the file's name rather than as the option's.
        try:
            converted = option.type_cast_value(ctx, value)
            if option.callback is not None:
                option.callback(ctx, option, converted)
        except click.BadParameter as exc:
            raise ConfigurationError(f"{path}: {key}: {exc.message}") from None
    ctx.default_map = {**(ctx.default_map or {}), **data}


# -- --print-config ------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """``value`` (a string, integer, boolean, or a list or table of them) as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # A JSON string is a TOML basic string, but for DEL, which TOML wants escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, Mapping):
        return toml_value([f"{k}={v}" for k, v in value.items()])
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _source_note(ctx: click.Context, option: click.Option) -> str:
    """Where a value that overrides the file came from, as a trailing comment."""
    source = ctx.get_parameter_source(option.name or "")
    if source is ParameterSource.COMMANDLINE:
        return "  # from the command line"
    if source is ParameterSource.ENVIRONMENT:
        name = next((v for v in variables(option) if os.environ.get(v)), "the environment")
        return f"  # from {name}"
    return ""


def render(ctx: click.Context, values: Mapping[str, Any]) -> str:
    """The merged configuration of the running command as TOML: each key with its help
    above it, commented out where it is at its default (or not set), secrets masked."""
    assert ctx.command is not None
    lines = [HEADER]
    for key, option in keyed_options(ctx.command).items():
        text = " ".join((option.help or "").split())
        lines.append(textwrap.fill(text, COMMENT_WIDTH, initial_indent="# ",
                                   subsequent_indent="# "))  # fmt: skip
        value = values.get(key)
        if isinstance(value, str) and key in SECRETS:
            value = SECRETS[key](value)
        source = ctx.get_parameter_source(key)
        if value is None:
            lines.append(f"# {key} = (not set)")
        elif source in (ParameterSource.DEFAULT, None):
            lines.append(f"# {key} = {toml_value(value)}")
        else:
            lines.append(f"{key} = {toml_value(value)}{_source_note(ctx, option)}")
        lines.append("")
    if os.environ.get(TOKEN_VARIABLE):
        lines.append(f"# {TOKEN_VARIABLE} is set: one admin token more ({MASK}, not shown).")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def print_config(ctx: click.Context, values: Mapping[str, Any]) -> None:
    """``--print-config``: print the merged configuration and exit 0."""
    sys.stdout.write(render(ctx, values))
    sys.stdout.flush()
    ctx.exit(0)
