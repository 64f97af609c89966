"""Expected failures as one line on stderr, "relay-trio: ...", and a non-zero exit: 2 for
usage errors and a refused database, else 1. ``RelayGroup`` does it for click's errors,
``run`` for what a command's trio code raises (no server, an error reply, a database
refused); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import socket
import sqlite3
import ssl
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import click
import orjson
import trio

from relay.errors import RelayError, StoreError

T = TypeVar("T")

PROG = "relay-trio"
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a SIGINT death
EXIT_CONFIGURATION = 2  # a database refused, as click's usage errors


def fail(message: str, code: int = 1) -> NoReturn:
    """Print "relay-trio: message" (on one line) to stderr and exit with ``code``."""
    click.echo(f"{PROG}: {' '.join(message.split())}", err=True)
    sys.exit(code)


class RelayGroup(click.Group):
    """A click group whose errors are one line on stderr, usage errors included (click's
    own are three: usage, hint, error). The exit codes stay click's: 2 for usage, else 1."""

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
            if isinstance(exc.__context__, KeyboardInterrupt):
                fail("interrupted", EXIT_INTERRUPTED)
            fail("aborted")
        except BrokenPipeError:
            # The reader went away (`relay-trio stats | head`): nothing left to say.
            sys.stderr.close()
            os._exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``exc``, exception groups flattened (trio's nurseries group)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _reason(exc: BaseException) -> str:
    """Why a connection could not be made, without trio's "all attempts failed" wrapper."""
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc.__cause__, BaseExceptionGroup):
        first = next(_leaves(exc.__cause__), None)
        if isinstance(first, OSError):
            exc = first
    if isinstance(exc, socket.gaierror) and exc.strerror:
        return exc.strerror
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not the system's
        return f"TLS handshake failed: {(exc.reason or str(exc)).lower().replace('_', ' ')}"
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__


def _explain(exc: BaseException, address: str | None) -> click.ClickException | None:
    """The one-line error for an expected failure, or None for anything else (a bug)."""
    for leaf in _leaves(exc):
        if isinstance(leaf, click.ClickException):
            return leaf
        if isinstance(leaf, StoreError):  # a configuration error, as for the server
            refused = click.ClickException(f"refusing to open {leaf.path}: {leaf.problem}")
            refused.exit_code = EXIT_CONFIGURATION
            return refused
        if isinstance(leaf, RelayError):
            return click.ClickException(f"{leaf.code}: {leaf.message}")
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
    an OSError is a failure to reach the server there."""
    try:
        return trio.run(async_fn, *args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        problem = _explain(exc, address)
        if problem is None:
            raise
        raise problem from None
