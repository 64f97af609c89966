"""Expected failures as one line on stderr, "relay-trio: ...", and an exit code: 2 for a
usage or configuration error (a bad option, a refused database, a request the server calls
malformed), 1 for a failed operation (no server, an error reply), 130 for Ctrl-C.
``RelayGroup`` does it for click's errors and for Ctrl-C, ``run`` for what a command's trio
code raises; anything else is a bug and keeps its traceback.

Imports only click at module level: ``relay-trio --help`` loads this module, and should
not pay for trio or the client.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import click

from relay.util import log as relay_log
from relay.util.log import LogConfigError

T = TypeVar("T")

PROG = "relay-trio"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a SIGINT death


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print "relay-trio: message" (on one line) to stderr, after the log lines still
    waiting to be written, and exit with ``code``."""
    relay_log.flush()
    click.echo(f"{PROG}: {' '.join(message.split())}", err=True)
    sys.exit(code)


def exit_interrupted() -> NoReturn:
    """End the command after Ctrl-C: exit code 130 and nothing more to say (the terminal
    shows the ^C), but a newline, so that the shell's prompt starts on a line of its own."""
    if sys.stderr.isatty():
        click.echo(err=True)
    sys.exit(EXIT_INTERRUPTED)


class ConfigurationError(click.ClickException):
    """A mistake the user must fix in what they gave (exit code 2), found after parsing:
    a database refused, a request the server calls malformed."""

    exit_code = EXIT_USAGE


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C, also inside an exception group (a nursery wraps the
    KeyboardInterrupt that trio delivers to a task inside it)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return isinstance(exc, KeyboardInterrupt) or (
        isinstance(exc, click.Abort) and isinstance(exc.__context__, KeyboardInterrupt)
    )


class RelayGroup(click.Group):
    """A click group whose errors are one line on stderr, usage errors included (click's
    own are three: usage, hint, error), and whose Ctrl-C ends the command with exit code 130
    and no traceback wherever it lands."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # the help text, as click prints it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            fail(exc.format_message() + hint, exc.exit_code)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort as exc:
            if interrupted(exc):
                exit_interrupted()  # (click ends a prompt's line only for hidden input)
            fail("aborted")
        except LogConfigError as exc:  # RELAY_LOG or RELAY_LOG_FORMAT, as any command reads them
            fail(str(exc), EXIT_USAGE)
        except BrokenPipeError:
            # The reader went away (`relay-trio stats | head`): nothing left to say.
            sys.stderr.close()
            os._exit(EXIT_FAILED)
        except BaseException as exc:
            if interrupted(exc):
                exit_interrupted()
            raise
        sys.exit(code if isinstance(code, int) else 0)


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``exc``, exception groups flattened (trio's nurseries group)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _reason(exc: BaseException) -> str:
    """Why a connection could not be made (relay/client/tcp.py's words), with what to do where
    the reason says it."""
    import ssl

    from relay.client.tcp import connect_failure, connect_failure_text, tls_reason

    failure = connect_failure(exc)
    text = connect_failure_text(failure)
    if isinstance(failure, ssl.SSLCertVerificationError):
        if getattr(failure, "verify_code", None) in UNTRUSTED_ISSUER_CODES:
            text += (
                " (if the server's certificate comes from a private CA, give that CA's"
                " certificate with --tls-ca PATH)"
            )
    elif isinstance(failure, ssl.SSLError) and tls_reason(failure) in PLAIN_SERVER_REASONS:
        text = "the server does not speak TLS there (connect without --tls or tls://)"
    elif isinstance(failure, ConnectionRefusedError):
        text += " (is the server running there? or give --address)"
    return text


# OpenSSL's verify codes for a chain that ends at an issuer the client does not trust:
# unable to get local issuer certificate, self-signed certificate (in the chain).
UNTRUSTED_ISSUER_CODES = frozenset({18, 19, 20})
# What OpenSSL says when the peer answers a TLS ClientHello with plain bytes.
PLAIN_SERVER_REASONS = frozenset(
    {"wrong version number", "record layer failure", "packet length too long"}
)

# What to do after an error reply of these codes, where the message alone does not say.
REPLY_HINTS: dict[str, dict[str, str]] = {
    "unauthorized": {
        "a hello with a valid token must come first": "the server needs a token: give one "
        "with --token-file PATH or the RELAY_AUTH_TOKEN environment variable",
        "invalid token": "the server refused the token from --token-file or RELAY_AUTH_TOKEN",
    },
}


def _reply_message(code: str, message: str) -> str:
    hint = REPLY_HINTS.get(code, {}).get(message)
    if hint is None and code == "unauthorized" and " role; this token is " in message:
        hint = "give a token of that role with --token-file PATH or RELAY_AUTH_TOKEN"
    return f"{code}: {message}" + (f" ({hint})" if hint else "")


def _explain(exc: BaseException, address: str | None) -> click.ClickException | None:
    """The one-line error for an expected failure, or None for anything else (a bug)."""
    import sqlite3

    import orjson
    import trio

    from relay.protocol.errors import (
        BadRequest,
        RelayError,
        StoreError,
        StoreUnreachable,
        WrongServer,
    )

    for leaf in _leaves(exc):
        if isinstance(leaf, click.ClickException):
            return leaf
        if isinstance(leaf, StoreUnreachable):  # (a failure that may pass: exit 1)
            return click.ClickException(f"cannot open {leaf.path}: {leaf.problem}")
        if isinstance(leaf, StoreError):
            return ConfigurationError(f"refusing to open {leaf.path}: {leaf.problem}")
        if isinstance(leaf, BadRequest):
            # The server calls the request malformed: it is what the user gave (a queue
            # name, a payload too large...), as when the command line refuses it itself.
            return ConfigurationError(_reply_message(leaf.code, leaf.message))
        if isinstance(leaf, WrongServer):
            return click.ClickException(f"cannot talk to {address or 'the server'}: {leaf.message}")
        if isinstance(leaf, RelayError):
            return click.ClickException(_reply_message(leaf.code, leaf.message))
        if isinstance(leaf, sqlite3.Error):
            # The embedded queue's database (demo): e.g. a directory that does not exist.
            return click.ClickException(f"database error: {leaf}")
        if address is not None and isinstance(leaf, orjson.JSONDecodeError):
            # The client's reader got a line that is not JSON: another kind of server.
            return click.ClickException(f"{address} does not answer as a relay-trio server: {leaf}")
        if address is not None and isinstance(leaf, OSError | trio.TooSlowError):
            return click.ClickException(f"cannot connect to {address}: {_reason(leaf)}")
    return None


def run(async_fn: Callable[..., Awaitable[T]], *args: Any, address: str | None = None) -> T:
    """``trio.run``, with expected failures turned into one-line errors. With ``address``,
    an OSError is a failure to reach the server there. Ctrl-C comes out as itself (or in a
    group) for ``RelayGroup`` to end the command with."""
    import trio

    try:
        return trio.run(async_fn, *args)
    except BaseException as exc:
        if interrupted(exc) or isinstance(exc, SystemExit):
            raise
        problem = _explain(exc, address)
        if problem is None:
            raise
        raise problem from None
