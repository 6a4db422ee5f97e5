"""Errors a request can cause: user mistakes, each naming the field at fault."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run; the gateway turns it into a 4xx.

    ``field`` names the offending field the way a client wrote it (``max_tokens``,
    ``top_p``, ``prompt``) so the message is actionable.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
