"""The relay-trio command line: arguments in, calls out. Rendering lives in cli/views.py.

Every command that talks to a server takes ``--address`` (env ``RELAY_ADDRESS``), ``--tls``,
``--tls-ca`` (env ``RELAY_TLS_CA``), ``--token-file`` and ``--timeout``; the read commands
take ``--json``. These may also come before the command word (``relay-trio --json stats``).
An expected failure (no server, a bad argument, an error reply) is one line on stderr,
"relay-trio: ...", and an exit code: 2 for a usage or configuration error, 1 for a failed
operation, 130 for Ctrl-C.

This module is the ``relay-trio`` group and the list of its commands. Each command lives in
a module of its own, imported only when it runs (or its help is asked for): ``server`` in
cli/server.py; ``worker`` and ``demo`` in cli/work.py; ``submit`` in cli/submit.py;
``inspect``, ``stats``, ``watch``, ``top`` and ``history`` in cli/reads.py; ``dead`` in
cli/dead.py; ``jobs`` in cli/jobs.py; ``queue`` in cli/queue.py; ``schedule`` in
cli/schedule.py; ``backup`` in cli/backup.py; ``reload`` in cli/reload.py; ``workers`` in
cli/workers.py. So ``relay-trio --help`` and ``--version`` load click and nothing of the
client or the server.
What the commands share: the options in cli/options.py, a one-shot command's call and output
in cli/calls.py, failures as one line in cli/errors.py.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from relay_cli.errors import PROG, RelayGroup

# name: (module, attribute, the one-line summary that `relay-trio --help` lists). The
# summaries live here, not in the commands, so that the list needs no command imported.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "server": ("relay_cli.server", "server", "Run the server until Ctrl-C or SIGTERM."),
    "worker": ("relay_cli.work", "worker", "Lease jobs from queues and run them."),
    "submit": ("relay_cli.submit", "submit", "Submit a job to a queue."),
    "inspect": ("relay_cli.reads", "inspect_command", "Show one job, its attempts and errors."),
    "stats": ("relay_cli.reads", "stats", "Jobs per queue and state."),
    "dead": ("relay_cli.dead", "dead", "List, retry or purge dead jobs."),
    "queue": ("relay_cli.queue", "queue", "Pause, resume, set, show or list queues."),
    "schedule": ("relay_cli.schedule", "schedule", "Cron schedules: put, list, pause, delete."),
    "cancel": ("relay_cli.cancel", "cancel", "Cancel a job, or a queue's jobs."),
    "jobs": ("relay_cli.jobs", "jobs", "Browse jobs of any state; retry, purge, promote."),
    "watch": ("relay_cli.reads", "watch", "Print job events as JSON lines."),
    "top": ("relay_cli.reads", "top", "A live view of the queues."),
    "workers": ("relay_cli.workers", "workers", "The connected workers and what they hold."),
    "history": ("relay_cli.reads", "history", "Jobs per minute over the last hours."),
    "demo": ("relay_cli.work", "demo", "See jobs run, retry and die in a few seconds."),
    "backup": ("relay_cli.backup", "backup", "Copy a running server's SQLite database."),
    "reload": ("relay_cli.reload", "reload", "Reread the token file and TLS certificate."),
}

# Options of the client commands that may come before the command word, and whether each
# takes a value. ``relay-trio --address H:P stats`` runs as ``relay-trio stats --address
# H:P``: the command parses them, with its own checks and its own errors.
GLOBAL_OPTIONS = {
    "--address": True,
    "--tls": False,
    "--tls-ca": True,
    "--token-file": True,
    "--timeout": True,
    "--json": False,
}


def move_global_options(args: list[str]) -> list[str]:
    """``args`` with the shared options given before the command word moved after the
    command (before a ``--``, if there is one), where the command parses them."""
    moved: list[str] = []
    i = 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name not in GLOBAL_OPTIONS:
            break
        takes_value = GLOBAL_OPTIONS[name] and not eq
        moved += args[i : i + 1 + takes_value]
        i += 1 + takes_value
    rest = args[i:]
    if not moved:
        return args
    end = rest.index("--") if "--" in rest else len(rest)
    return rest[:end] + moved + rest[end:]


class LazyGroup(RelayGroup):
    """The ``relay-trio`` group: imports a command's module only when it is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute, summary = COMMANDS[name]
        command: click.Command = getattr(importlib.import_module(module), attribute)
        command.short_help = summary
        return command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, move_global_options(args))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, summary) for name, (_, _, summary) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


CONTEXT_SETTINGS: dict[str, Any] = {
    "help_option_names": ["-h", "--help"],
    # Help text fills the terminal's width up to this many columns (click's default: 80).
    "max_content_width": 120,
}


@click.group(
    cls=LazyGroup,
    context_settings=CONTEXT_SETTINGS,
    epilog="The options --address, --tls, --tls-ca, --token-file, --timeout and --json may "
    "also come before the command. Exit codes: 0 done, 1 failed, 2 usage or configuration "
    "error, 130 interrupted (Ctrl-C). 'relay-trio COMMAND -h' for a command's options.",
)
@click.version_option(package_name="relay-trio", prog_name=PROG)
def main() -> None:
    """relay-trio: a durable job queue server with visible failure semantics.

    Start with `relay-trio demo` to see jobs run, retry and die in a few seconds.
    """
