"""Gateway prompt building: byte tokenizer for the mock, and transformers-identical ids for a real model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, TemplateError, chat_ids_async
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
