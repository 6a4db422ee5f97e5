"""The structured-output check at the door: a schema, regex, choice or grammar the engine would refuse
is a 400 naming its field before the request is queued, never a stalled or failed stream later.

The check (``wire.grammar.check``) runs on a worker thread, two at most, bounded in time
(``CHECK_TIMEOUT_S``: a spec that takes longer is refused as too costly), and remembered: an agent
sends the same schema on every call, which is checked once.
"""

from __future__ import annotations

from collections import OrderedDict

import anyio
import anyio.to_thread

from wire.errors import InvalidRequestError
from wire.grammar import check
from wire.structured import StructuredOutput

CHECK_TIMEOUT_S = 2.0
MAX_REMEMBERED = 512


class StructuredCheck:
    """``await checker(structured)`` raises InvalidRequestError naming the field, or returns."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._limiter = anyio.CapacityLimiter(2)
        self._accepted: OrderedDict[tuple[str, str, str | None], None] = OrderedDict()

    async def __call__(self, structured: StructuredOutput | None) -> None:
        if structured is None:
            return
        key = structured.grammar_key
        if key in self._accepted:
            self._accepted.move_to_end(key)
            return
        try:
            with anyio.fail_after(self.timeout_s):
                await anyio.to_thread.run_sync(
                    check, structured, limiter=self._limiter, abandon_on_cancel=True
                )
        except TimeoutError:
            raise InvalidRequestError(
                structured.field, f"too costly to compile (over {self.timeout_s:g} s)"
            ) from None
        self._accepted[key] = None
        if len(self._accepted) > MAX_REMEMBERED:
            self._accepted.popitem(last=False)
