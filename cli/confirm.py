"""``confirm``: ask on the terminal before a command acts on a whole queue, y or N.

click's ``confirm`` reads the answer with a blocking read, and a Ctrl-C that comes after
the question is shown but before that read begins is lost: Python's signal handler has
run, and the read then waits for a line while the KeyboardInterrupt it owes waits for
the read (a hang until Enter; seen in tests that press Ctrl-C as the question appears).
Here the read waits on the terminal and on the signal wake-up fd together, so a signal
that came at any moment ends the wait.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator

import click

YES = ("y", "yes")


def confirm(question: str) -> None:
    """Show ``question [y/N]:`` on stderr and read the answer from the terminal: return on
    y or yes; anything else, or end of input, raises ``click.Abort`` (and Ctrl-C raises it
    from its KeyboardInterrupt, which ends the command with 130: errors.interrupted)."""
    click.echo(f"{question} [y/N]: ", nl=False, err=True)
    try:
        with _woken_by_signals() as wake:
            answer = _read_line(sys.stdin.fileno(), wake)
    except KeyboardInterrupt:
        raise click.Abort() from None  # (its context: the KeyboardInterrupt)
    if answer is None:  # (Ctrl-D: the terminal showed no newline)
        click.echo(err=True)
    if answer is None or answer.strip().lower() not in YES:
        raise click.Abort()


@contextlib.contextmanager
def _woken_by_signals() -> Iterator[int]:
    """A pipe that Python's signal handling writes a byte to as a signal comes (its
    wake-up fd, set for the block); the end to wait on."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        yield read_end
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)


def _read_line(fd: int, wake: int) -> str | None:
    """A line from ``fd`` (a terminal: a read returns what its line discipline gives), or
    None at end of input. Returns to Python between waits, where a signal's handler runs
    (Ctrl-C: its KeyboardInterrupt)."""
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd, wake], [], [])
        if wake in ready:
            os.read(wake, 512)  # (the handler itself runs as this returns to Python)
        if fd in ready:
            chunk = os.read(fd, 1024)
            if not chunk:
                return None if not data else data.decode(errors="replace")
            data += chunk
    return data.decode(errors="replace")
