"""The codec: whatever arrives, decode returns a message or None, counts it, and never raises."""

from __future__ import annotations

import logging
import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.wire.test_messages import gateway_messages, submit, worker_messages
from wire.codec import (
    LOG_EVERY_N_DROPS,
    MAX_FRAME_BYTES,
    Decoder,
    DecodeStats,
    encode,
    gateway_message_decoder,
    worker_message_decoder,
)
from wire.messages import Abort, DrainNotice, GatewayMessage, Heartbeat, WorkerMessage, WorkerStats


def assert_accounted(decoder: Decoder[Any], num_frames: int) -> None:
    """Every frame fed in is in exactly one counter."""
    assert decoder.stats.decoded + decoder.stats.num_dropped == num_frames


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(frame: bytes) -> None:
    for decoder in (worker_message_decoder(), gateway_message_decoder()):
        message = decoder.decode(frame)
        assert message is None or decoder.stats.decoded == 1
        assert_accounted(decoder, 1)


@settings(max_examples=100, deadline=None)
@given(st.one_of(worker_messages, gateway_messages), st.data())
def test_truncated_frames_are_malformed(message: Any, data: st.DataObject) -> None:
    frame = encode(message)
    cut = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    decoder: Decoder[Any] = Decoder(type(message))
    assert decoder.decode(frame[:cut]) is None
    assert decoder.stats == DecodeStats(dropped_malformed=1)


@settings(max_examples=100, deadline=None)
@given(worker_messages, st.data())
def test_corrupted_frames_never_raise(message: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    decoder = worker_message_decoder()
    decoder.decode(bytes(frame))
    assert_accounted(decoder, 1)


@settings(max_examples=100, deadline=None)
@given(gateway_messages)
def test_gateway_frames_are_not_worker_messages(message: GatewayMessage) -> None:
    decoder = worker_message_decoder()
    assert decoder.decode(encode(message)) is None
    assert decoder.stats == DecodeStats(dropped_malformed=1)


@settings(max_examples=100, deadline=None)
@given(worker_messages)
def test_worker_frames_are_not_gateway_messages(message: WorkerMessage) -> None:
    decoder = gateway_message_decoder()
    assert decoder.decode(encode(message)) is None
    assert decoder.stats == DecodeStats(dropped_malformed=1)


@settings(max_examples=100, deadline=None)
@given(gateway_messages, st.text(min_size=1, max_size=10), st.integers(-(2**63), 2**63 - 1))
def test_an_extra_field_is_malformed(message: Any, key: str, value: int) -> None:
    raw = msgspec.to_builtins(message)
    if key in raw:
        return
    decoder = gateway_message_decoder()
    assert decoder.decode(msgspec.msgpack.encode(raw | {key: value})) is None
    assert decoder.stats == DecodeStats(dropped_malformed=1)


def test_wrong_types_are_malformed() -> None:
    decoder = gateway_message_decoder()
    bad = [
        {"type": "abort", "v": 1, "request_id": "r", "epoch": "0"},
        {"type": "abort", "v": 1, "request_id": 5, "epoch": 0},
        {"type": "abort", "v": "1", "request_id": "r", "epoch": 0},
        {"type": "abort", "v": 1, "request_id": "r"},  # missing field
        {"type": "nonsense", "v": 1},
        {"v": 1, "request_id": "r", "epoch": 0},  # no tag
        [1, 2, 3],
        None,
    ]
    for raw in bad:
        assert decoder.decode(msgspec.msgpack.encode(raw)) is None, raw
    assert decoder.stats == DecodeStats(dropped_malformed=len(bad))


def test_pickle_and_deep_nesting_are_malformed() -> None:
    decoder = gateway_message_decoder()
    assert decoder.decode(pickle.dumps(Abort(request_id="r", epoch=0))) is None
    # An unknown field's value is skipped recursively: 100k nested arrays must not blow the stack.
    deep = b"\x83\xa4type\xa5abort\xa1v\x01\xa1x" + b"\x91" * 100_000 + b"\xc0"
    assert decoder.decode(deep) is None
    assert decoder.stats == DecodeStats(dropped_malformed=2)


def test_oversize_frames_are_dropped_before_parsing() -> None:
    frame = encode(Abort(request_id="r", epoch=0))
    decoder = gateway_message_decoder(max_frame_bytes=len(frame))
    assert decoder.decode(frame) == Abort(request_id="r", epoch=0)
    assert decoder.decode(frame + b"\x00") is None
    assert decoder.decode(b"\xff" * (len(frame) + 1)) is None
    assert decoder.stats == DecodeStats(decoded=1, dropped_oversize=2)
    assert gateway_message_decoder().max_frame_bytes == MAX_FRAME_BYTES


def test_encode_refuses_a_frame_over_the_limit() -> None:
    message = submit(prompt_token_ids=list(range(1000)))
    assert len(encode(message)) > 1000
    with pytest.raises(ValueError, match="frame limit"):
        encode(message, max_frame_bytes=1000)


def test_memoryview_frames_decode() -> None:
    # pyzmq hands out Frame buffers; decoding must not need a bytes copy.
    beat = Heartbeat(
        worker_id="w",
        seq=1,
        sent_at=1.5,
        stats=WorkerStats(
            num_running=1,
            num_waiting=2,
            num_free_blocks=3,
            num_total_blocks=4,
            step_time_ema_ms=5.0,
            num_steps=6,
            num_preemptions=0,
        ),
    )
    assert worker_message_decoder().decode(memoryview(encode(beat))) == beat


def test_drops_are_logged_first_and_then_one_in_n(caplog: pytest.LogCaptureFixture) -> None:
    decoder = worker_message_decoder()
    good = encode(DrainNotice(worker_id="w", reason="sigterm"))
    with caplog.at_level(logging.WARNING, logger="wire.codec"):
        for _ in range(2 * LOG_EVERY_N_DROPS + 5):
            decoder.decode(b"\xc1")  # reserved msgpack byte: never valid
            decoder.decode(good)
    assert len(caplog.records) == 3  # drops number 1, N and 2N
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert decoder.stats == DecodeStats(
        decoded=2 * LOG_EVERY_N_DROPS + 5, dropped_malformed=2 * LOG_EVERY_N_DROPS + 5
    )


def test_stats_are_slotted() -> None:
    with pytest.raises(AttributeError):
        DecodeStats().typo = 1  # type: ignore[attr-defined]
