"""A chat request's messages: their shape (``ChatMessage``) and the rules across them
(``check_messages``), shared by the chat and tokenize endpoints.

The roles are OpenAI's (``developer`` rendered as ``system``); content is text or text parts. The
rules are OpenAI's API's: only an assistant's message carries tool calls, a tool message answers
one of the calls of the assistant message before it, and each call is answered before the next turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gateway.tools import ToolCallIn
from wire.errors import InvalidRequestError


class TextPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str = ""


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def template_role(self) -> str:
        """The role as chat templates know it: ``developer`` (OpenAI's newer name) is ``system``."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """Content as one string: parts of type text joined (images and audio are not served)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(
                    "messages", f"content parts of type {part.type!r} are not supported"
                )
        return "".join(part.text for part in self.content)


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Each message's role known (``messages[i].role`` named otherwise); only an assistant's message
    carries calls; a tool message answers one of them (``tool_call_id``), as OpenAI's API has it: it
    follows the assistant message with the call, only other answers between them; and every call is
    answered before any other message, or the end of the list (``messages[i].tool_calls`` of the
    assistant message names the calls left unanswered)."""
    calls: list[str] = []  # the ids a tool message here may answer
    unanswered: dict[str, None] = {}  # of the last assistant message's calls, in its order
    asked_at = -1  # that message's index
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}"
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}].tool_calls", "only an assistant's message has tool calls"
            )
        if message.role == "tool":
            _check_answer(i, message.tool_call_id, calls)
            unanswered.pop(message.tool_call_id or "", None)
            continue
        _check_all_answered(asked_at, unanswered)
        calls = [call.id for call in message.tool_calls or ()]
        unanswered, asked_at = dict.fromkeys(calls), i
    _check_all_answered(asked_at, unanswered)


def _check_all_answered(asked_at: int, unanswered: dict[str, None]) -> None:
    if unanswered:
        raise InvalidRequestError(
            f"messages[{asked_at}].tool_calls",
            "an assistant message with tool_calls must be followed by a tool message answering each "
            f"call; these have none: {', '.join(map(repr, unanswered))}",
        )


def _check_answer(i: int, call_id: str | None, calls: list[str]) -> None:
    field = f"messages[{i}].tool_call_id"
    if not call_id:
        raise InvalidRequestError(field, "a tool message must name the call it answers")
    if not calls:
        raise InvalidRequestError(
            field, "a tool message must follow an assistant message with tool_calls (or another answer)"
        )
    if call_id not in calls:
        raise InvalidRequestError(
            field, f"{call_id!r} is none of the calls before it ({', '.join(map(repr, calls))})"
        )
