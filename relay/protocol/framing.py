"""Line framing: a byte stream cut into lines, never holding more than one frame's worth."""

from __future__ import annotations


def _strip_cr(lines: list[bytes]) -> list[bytes]:
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


class LineSplitter:
    """Splits a byte stream into lines, never holding more than one frame's worth.

    ``feed`` returns the complete lines (newline and a trailing \\r removed) and keeps the
    rest. Once a line is longer than ``max_frame_bytes`` (as soon as that many bytes have
    arrived without a newline), ``overflow`` is set and nothing more is returned: the
    lines before it are still returned, and the buffer never grows past the limit.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self.overflow = False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        if self.overflow:
            return []
        buffer = self._buffer
        if b"\n" not in data:  # no line ends here: keep it (a bytearray grows cheaply)
            buffer += data
            self._check_rest()
            return []
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        # bytes.split does the scanning; Python looks at each line only when one could
        # be too long (a read and the buffer are usually far below the limit) or ends
        # with \r.
        lines = data.split(b"\n")
        buffer += lines.pop()
        if len(data) > self.max_frame_bytes:
            for i, line in enumerate(lines):
                if len(line) - line.endswith(b"\r") > self.max_frame_bytes:
                    self._overflowed()
                    return _strip_cr(lines[:i])
        self._check_rest()
        return _strip_cr(lines) if b"\r" in data else lines

    def _check_rest(self) -> None:
        # The rest has no newline yet; a \r at its end may be the first half of \r\n.
        buffer = self._buffer
        if len(buffer) - buffer.endswith(b"\r") > self.max_frame_bytes:
            self._overflowed()

    def _overflowed(self) -> None:
        self.overflow = True
        self._buffer = bytearray()
