"""Gateway prompt building: byte tokenizer for the mock, and transformers-identical ids for a real model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, TemplateError, chat_ids_async
from wire.byte_tokenizer import BOS_ID, hf_tokenizer_json
from worker.mock import MockTokenizer
from worker.models.store import default_model_dir, is_pulled

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi ✓ 東京 <|im_end|>"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces\n\nand newlines  "},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_byte_builder_matches_mock_tokenizer(messages: list[dict[str, str]]) -> None:
    builder = BytePromptBuilder()
    assert builder.chat_ids(messages) == MockTokenizer().apply_chat_template(messages)
    assert asyncio.run(chat_ids_async(builder, messages)) == builder.chat_ids(messages)
    assert builder.text_ids("héllo") == MockTokenizer().encode("héllo")


needs_model = pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`")


@needs_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_hf_builder_matches_transformers(messages: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer

    folder = default_model_dir()
    reference = AutoTokenizer.from_pretrained(folder)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]  # type: ignore[index]
    builder = HFPromptBuilder(folder)
    assert builder.chat_ids(messages) == list(expected)
    text = "plain text, no template"
    assert builder.text_ids(text) == reference.encode(text, add_special_tokens=False)


def test_template_raise_exception_is_a_template_error(tmp_path: Path) -> None:
    import shutil

    if not is_pulled(default_model_dir()):
        pytest.skip("run `tierserve models pull`")
    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="alternate"):
        HFPromptBuilder(tmp_path).chat_ids([{"role": "user", "content": "x"}])


# A template that takes tools, as Qwen2.5's does (shortened): tools in the system turn, calls and
# results in its own tags.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<call>{{ call.function.name }}{{ call.function.arguments | tojson }}</call>
{%- endfor %}
{%- if message.role == 'tool' %}[{{ message.tool_call_id }}]{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@needs_model
def test_a_template_that_takes_tools_renders_them_itself(tmp_path: Path) -> None:
    import shutil

    import msgspec

    from gateway.chat_prompt import chat_prompt
    from gateway.openai_requests import ChatCompletionRequest

    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    builder = HFPromptBuilder(tmp_path)
    assert builder.supports_tools and not HFPromptBuilder(default_model_dir()).supports_tools
    # Its calls are not in a format it names: Hermes, the default. A Llama 3.1-style one is read so.
    assert builder.call_format == HFPromptBuilder(default_model_dir()).call_format == "hermes"
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE + "{# results: ipython turns #}")
    assert HFPromptBuilder(tmp_path).call_format == "llama3_json"
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    body = msgspec.json.decode(
        msgspec.json.encode(
            {
                "model": "m",
                "tools": [
                    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
                ],
                "messages": [
                    {"role": "user", "content": "ping it"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "ping", "arguments": '{"n": 1}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "pong"},
                ],
            }
        ),
        type=ChatCompletionRequest,
    )
    messages, tools = chat_prompt(body.messages, body.tool_spec(), builder.supports_tools)
    text = builder.render(messages, tools=tools)
    assert text.startswith('<|im_start|>system\n{"type": "function", "function": {"name": "ping"')
    assert '<call>ping{"n": 1}</call>' in text and "<|im_start|>tool\npong[c1]<|im_end|>" in text
    assert "<tool_call>" not in text and "# Tools" not in text  # not the default format
    assert builder.chat_ids(messages, tools=tools) == builder.text_ids(text)
    # tool_choice none: the template gets no tools, the history still renders its way.
    body = msgspec.structs.replace(body, tool_choice="none")
    messages, tools = chat_prompt(body.messages, body.tool_spec(), builder.supports_tools)
    assert tools is None and "<call>ping" in builder.render(messages, tools=tools)


PREFILLED = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is "},  # trailing space: the template keeps it
]


@needs_model
@pytest.mark.parametrize("messages", [PREFILLED, [*PREFILLED[:2], {"role": "user", "content": " more\n"}]])
def test_continue_final_message_matches_transformers(messages: list[dict[str, str]]) -> None:
    """The prompt ends where the last message's text does, as transformers cuts it (the template's
    ``<|im_end|>`` after it gone), whatever spacing the message carries."""
    from transformers import AutoTokenizer

    from gateway.tokenizer import ChatOptions

    folder = default_model_dir()
    reference = AutoTokenizer.from_pretrained(folder)
    expected = reference.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    builder = HFPromptBuilder(folder)
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert builder.render(messages, options) == expected
    assert builder.chat_ids(messages, options) == reference.encode(expected, add_special_tokens=False)
    assert not expected.endswith("<|im_end|>\n")


def test_template_kwargs_and_special_tokens(tmp_path: Path) -> None:
    """``chat_template_kwargs`` are the template's variables (a special token's among them, as
    transformers lets them be); ``add_special_tokens`` adds the tokenizer's post-processor's tokens on
    top of the template's, and a text prompt gets them by default (None), as ``tokenizer(text)`` does."""
    import json

    from gateway.tokenizer import ChatOptions

    tokenizer = json.loads(hf_tokenizer_json())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|begin|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin|>": {"id": "<|begin|>", "ids": [BOS_ID], "tokens": ["<|begin|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin|>"}))
    template = (
        "{% if thinking %}[think]{% endif %}{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    builder = HFPromptBuilder(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert builder.render(messages) == "<|begin|>hi"
    assert builder.render(messages, ChatOptions(template_kwargs={"thinking": True})) == "[think]<|begin|>hi"
    assert builder.render(messages, ChatOptions(template_kwargs={"bos_token": "B"})) == "Bhi"
    plain = builder.chat_ids(messages)
    assert plain[0] == BOS_ID and plain[1] != BOS_ID
    assert builder.chat_ids(messages, ChatOptions(add_special_tokens=True)) == [BOS_ID, *plain]
    assert builder.text_ids("hi", None) == [BOS_ID, *builder.text_ids("hi")]
    assert builder.text_ids("hi", True) == builder.text_ids("hi", None)


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """A word as it begins the text; also after a space where that gives other tokens of the same
    count (a byte tokenizer's space is a token of its own: one sequence); limits name the field."""
    from gateway.tokenizer import bad_word_ids
    from wire.errors import InvalidRequestError

    builder = BytePromptBuilder()
    assert bad_word_ids(builder, ["  hi", "x"]) == (
        tuple(builder.text_ids("hi")),
        tuple(builder.text_ids("x")),
    )
    with pytest.raises(InvalidRequestError) as info:
        bad_word_ids(builder, ["ok", " "])
    assert info.value.field == "bad_words[1]"
    with pytest.raises(InvalidRequestError):
        bad_word_ids(builder, ["x" * 65])
    if is_pulled(default_model_dir()):  # SmolLM2's BPE: "Paris" and " Paris" are each one token
        hf = HFPromptBuilder(default_model_dir())
        bare, spaced = hf.text_ids("Paris"), hf.text_ids(" Paris")
        assert len(bare) == len(spaced) == 1 and bare != spaced
        assert bad_word_ids(hf, ["Paris"]) == (tuple(bare), tuple(spaced))
