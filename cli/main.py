"""The relay-trio command line: arguments in, calls out. Rendering lives in cli/views.py.

Every command that talks to a server takes ``--address`` (env ``RELAY_ADDRESS``), ``--tls``
and ``--tls-ca`` (env ``RELAY_TLS_CA``); the read commands take ``--json``. An expected
failure (no server, a bad argument, an error reply) is one line on stderr, "relay-trio:
...", and a non-zero exit: 2 for usage errors, else 1.

This module is the ``relay-trio`` group, the console script's entry point, and the list of
its commands. Each command lives with its own helpers: ``server`` in cli/server.py;
``worker`` and ``demo`` in cli/work.py; ``submit`` in cli/submit.py; ``inspect``,
``stats``, ``watch`` and ``top`` in cli/reads.py; ``dead`` in cli/dead.py. What they share:
the options in cli/options.py, a one-shot command's call and output in cli/calls.py,
failures as one line in cli/errors.py.
"""

from __future__ import annotations

import click

from relay_cli.dead import dead
from relay_cli.errors import PROG, RelayGroup
from relay_cli.options import read_client_token
from relay_cli.reads import inspect_command, stats, top, watch
from relay_cli.server import SPARE_FILES, raise_open_files_limit, server
from relay_cli.submit import parse_backoff, submit
from relay_cli.work import demo, load_handler, worker


@click.group(cls=RelayGroup)
@click.version_option(package_name="relay-trio", prog_name=PROG)
def main() -> None:
    """relay-trio: a durable job queue server with visible failure semantics.

    Start with `relay-trio demo` to see jobs run, retry and die in a few seconds.
    """


main.add_command(server)
main.add_command(worker)
main.add_command(submit)
main.add_command(inspect_command)
main.add_command(watch)
main.add_command(top)
main.add_command(stats)
main.add_command(dead)
main.add_command(demo)


# What tests and scripts import from here, besides the commands.
__all__ = [
    "SPARE_FILES",
    "load_handler",
    "main",
    "parse_backoff",
    "raise_open_files_limit",
    "read_client_token",
]
