"""A chat request's messages as a chat template is rendered with them, tools and tool history included.

A template that takes ``tools`` gets them in Hugging Face's conventions and renders them itself; any
other gets them written into the messages in the default tool format (gateway/tools.py). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway import tools
from gateway.chat_messages import ChatMessage
from gateway.tools import ToolSpec

__all__ = ["chat_prompt", "template_messages"]


def template_messages(messages: Sequence[ChatMessage], spec: ToolSpec | None = None) -> list[dict[str, str]]:
    """The messages as a chat template takes them: the template's role names, content as text; tools,
    earlier calls and tool results in the default tool format (gateway/tools.py)."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            block = tools.response_text(m.text())
            if i and messages[i - 1].role == "tool":  # consecutive results: one user message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        content = m.text()
        if m.tool_calls:
            calls = tools.history_calls_text(m.tool_calls, f"messages[{i}]")
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.template_role(), "content": content})
    if spec is not None and spec.in_prompt:
        section = tools.system_prompt(spec)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def chat_prompt(
    messages: Sequence[ChatMessage], spec: ToolSpec | None, template_takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a chat template is rendered with: for a template that takes tools, in
    Hugging Face's conventions (an assistant's ``tool_calls`` with ``arguments`` as an object, ``tool``
    messages with their ``tool_call_id``; the tools unless tool_choice is ``none``); for any other,
    the default tool format (``template_messages``) and no tools."""
    if not template_takes_tools:
        return list(template_messages(messages, spec)), None
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.template_role(), "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
                for call, arguments in zip(
                    m.tool_calls, tools.history_arguments(m.tool_calls, f"messages[{i}]"), strict=True
                )
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out, tools.template_tools(spec) if spec is not None and spec.in_prompt else None
