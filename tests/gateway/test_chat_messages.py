"""gateway.chat_messages.check_messages: the rules across a chat request's messages, each broken one
named by the field OpenAI's API would name (the served 4xx: tests/e2e/test_bad_requests.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.chat_messages import ChatMessage, check_messages
from wire.errors import InvalidRequestError


def call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def answer(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "42"}


def check(messages: list[dict[str, Any]]) -> None:
    check_messages(msgspec.convert(messages, list[ChatMessage]))


USER = {"role": "user", "content": "hi"}
ASKS_TWO = {"role": "assistant", "content": None, "tool_calls": [call("a"), call("b")]}


@pytest.mark.parametrize(
    "messages",
    [
        [USER],
        [USER, ASKS_TWO, answer("a"), answer("b")],
        [USER, ASKS_TWO, answer("b"), answer("a"), {"role": "assistant", "content": "done"}, USER],
        [USER, {"role": "assistant", "tool_calls": []}, USER],  # no calls: nothing to answer
    ],
)
def test_every_call_answered_passes(messages: list[dict[str, Any]]) -> None:
    check(messages)


@pytest.mark.parametrize(
    ("messages", "missing"),
    [
        ([USER, ASKS_TWO, answer("a"), USER], "'b'"),  # the next turn came first
        ([USER, ASKS_TWO, {"role": "assistant", "content": "x"}], "'a', 'b'"),
        ([USER, ASKS_TWO, answer("b")], "'a'"),  # the conversation ends on it
        ([USER, ASKS_TWO], "'a', 'b'"),
    ],
)
def test_a_call_left_unanswered_names_the_assistant_message_and_the_calls(
    messages: list[dict[str, Any]], missing: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check(messages)
    assert raised.value.field == "messages[1].tool_calls"
    assert raised.value.message.endswith(f"these have none: {missing}")


def test_an_answer_to_no_call_is_named_before_anything_left_unanswered() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check([USER, ASKS_TWO, answer("c")])
    assert raised.value.field == "messages[2].tool_call_id"
