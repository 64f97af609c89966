"""A one-shot client command: ``call`` connects, asks and disconnects; ``print_json`` and
``console`` show the answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
import orjson
import trio
from cattrs.preconf.orjson import make_converter
from rich.console import Console

from relay.client.client import Client, open_client
from relay_cli.errors import run
from relay_cli.options import DEFAULT_TIMEOUT_S, client_target, client_timeout, client_token

T = TypeVar("T")


def call(
    address: str, action: Callable[[Client], Awaitable[T]], *, timeout: float = DEFAULT_TIMEOUT_S
) -> T:
    """Connect to the server at ``address``, run ``action`` with the client, disconnect,
    all within the command's ``--timeout`` (``timeout`` if not given). A one-shot command
    does not reconnect: a dropped connection is an error at once."""

    token = client_token()
    address, tls_ca = client_target(address)
    timeout = client_timeout(timeout)

    async def session() -> T:
        asked = False
        try:
            with trio.fail_after(timeout):  # the connection, its hello and the reply
                async with open_client(
                    address, reconnect=False, token=token, tls_ca=tls_ca, connect_timeout=timeout
                ) as client:
                    asked = True
                    return await action(client)
        except trio.TooSlowError:
            if asked:  # a change may have been made: say so, as the wire contract does
                raise click.ClickException(
                    f"no reply from {address} within {timeout:g} s: the request may or may "
                    "not have taken effect (--timeout SECONDS waits longer)"
                ) from None
            raise click.ClickException(
                f"no answer from {address} within {timeout:g} s (is a relay-trio server "
                "running there? --timeout SECONDS waits longer)"
            ) from None

    return run(session, address=address)


converter = make_converter()


def print_json(value: Any) -> None:
    """``value`` (an attrs result or named tuple, or plain data) as indented JSON on stdout.
    Keys are the result's fields in declaration order, every one present (None as null)."""
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        value = value._asdict()
    data = value if isinstance(value, dict) else converter.unstructure(value)
    click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())


def console() -> Console:
    """The console of a command's output. On a terminal, text is wrapped to its width; to
    a pipe or a file, a paragraph is one line (soft wrap), as ``git`` writes: rich would
    end each wrapped line in the space it broke at, and whatever reads the output wraps
    as it likes. Tables are laid out for the width either way (``views.Fitted``)."""
    out = Console(markup=False, emoji=False)  # (no text from a server is read as markup)
    out.soft_wrap = not out.is_terminal
    return out


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
