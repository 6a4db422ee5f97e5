"""The SSE parser: events split anywhere across network chunks still come out whole."""

from __future__ import annotations

import pytest

from loadtest.sse import SSEParser

STREAM = b'data: {"a": 1}\n\n: a comment\n\nevent: x\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
EXPECTED = [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_any_chunking_gives_the_same_events(size: int) -> None:
    parser = SSEParser()
    events = [e for i in range(0, len(STREAM), size) for e in parser.feed(STREAM[i : i + size])]
    assert events == EXPECTED
    assert parser.close() == []


def test_crlf_multiline_data_and_no_space_after_colon() -> None:
    parser = SSEParser()
    assert parser.feed(b"data:one\r\ndata: two\r\n\r\n") == [b"one\ntwo"]


def test_an_event_without_its_final_blank_line_is_kept_on_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: last") == []
    assert parser.close() == [b"last"]
