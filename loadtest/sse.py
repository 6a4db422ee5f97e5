"""A small incremental parser for ``text/event-stream``: bytes in, the ``data`` of each event out.

Written by hand because it runs once per token of every stream on the same cores as the server under
test: it splits on line ends, joins multi-line ``data:`` fields and skips comments and other fields,
as the WHATWG spec says, and does nothing else.
"""

from __future__ import annotations


class SSEParser:
    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The ``data`` payloads of the events that ``chunk`` completed (possibly none)."""
        self._buffer += chunk
        events: list[bytes] = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:  # a blank line ends the event
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (":...") and other fields (event:, id:, retry:) carry nothing we use
        return events

    def close(self) -> list[bytes]:
        """A stream may end without the final blank line: what it had is still an event."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        return events
