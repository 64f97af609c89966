"""``printable``: a text someone else chose, made safe to write to a terminal.

Error messages, tracebacks, worker ids and client names come from workers and clients; an
escape sequence in one of them, written as it is, could clear an operator's screen, move
the cursor over earlier lines or set the window's title. The command line's views and the
server's human log lines show each control character as its escape instead.
"""

from __future__ import annotations

import re

# C0 and C1 control characters and DEL, but the newline (a traceback has lines); and the
# bidirectional controls, which reorder what a terminal shows after them.
_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with each control character but the newline shown as its escape: ESC as
    the four characters ``\\x1b``, a right-to-left override as ``\\u202e``."""
    return _CONTROLS.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"
