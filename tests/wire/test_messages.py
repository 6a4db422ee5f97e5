"""The message Structs: every type round-trips, tags are distinct, strangers are refused.

The Hypothesis strategies here are reused by ``test_codec.py``.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.codec import encode, gateway_message_decoder, worker_message_decoder
from wire.errors import InvalidRequestError
from wire.messages import (
    MAX_DELTAS_PER_BATCH,
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    Abort,
    DrainNotice,
    GatewayMessage,
    Heartbeat,
    KVEvents,
    KVSnapshot,
    Register,
    Rejected,
    ResyncKV,
    Shutdown,
    Submit,
    TokenBatch,
    TokenDelta,
    TokenLogprob,
    Usage,
    WorkerMessage,
    WorkerStats,
)
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS, Tier

WORKER_TYPES: tuple[type[Any], ...] = get_args(WorkerMessage)
GATEWAY_TYPES: tuple[type[Any], ...] = get_args(GatewayMessage)

# msgpack carries int64 and uint64; NaN is excluded only because NaN != NaN breaks the equality check.
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
counts = st.integers(min_value=0, max_value=2**40)
floats = st.floats(allow_nan=False)
ids = st.text(max_size=40)
token_ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=50)

tiers = st.one_of(
    st.sampled_from(DEFAULT_TIERS),
    st.builds(Tier, name=ids, rank=counts, ttft_ms=st.none() | floats, sheddable=st.booleans()),
)
sampling_params = st.builds(
    SamplingParams,
    max_tokens=counts,
    temperature=floats,
    top_k=st.none() | ints,
    seed=st.none() | ints,
    logprobs=st.none() | st.integers(0, 20),
    stop=st.lists(st.text(max_size=8), max_size=4).map(tuple),
    stop_token_ids=token_ids.map(tuple),
)
usages = st.builds(Usage, prompt_tokens=counts, completion_tokens=counts, cached_tokens=counts)
logprobs = st.builds(
    TokenLogprob,
    token_id=counts,
    logprob=st.floats(allow_nan=False, max_value=0.0),
    top=st.lists(st.tuples(counts, st.floats(allow_nan=False)), max_size=20),
)
deltas = st.builds(
    TokenDelta,
    request_id=ids,
    epoch=counts,
    token_ids=token_ids,
    text=st.text(max_size=20),
    logprobs=st.none() | st.lists(logprobs, max_size=3),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
    error=st.none() | st.text(max_size=20),
    usage=usages,
)
worker_stats = st.builds(
    WorkerStats,
    num_running=counts,
    num_waiting=counts,
    num_free_blocks=counts,
    num_total_blocks=counts,
    step_time_ema_ms=floats,
    num_steps=counts,
    num_preemptions=counts,
    num_evictions=counts,
    num_prefix_query_tokens=counts,
    num_prefix_hit_tokens=counts,
    kv_events_seq=st.integers(-1, 2**40),
)
block_hashes = st.lists(st.binary(min_size=16, max_size=16), max_size=8)

message_strategies: dict[type[Any], st.SearchStrategy[Any]] = {
    Register: st.builds(
        Register,
        worker_id=ids,
        model=ids,
        dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
        device=ids,
        num_kv_blocks=counts,
        block_size=counts,
        kv_capacity_tokens=counts,
        max_model_len=counts,
        max_num_seqs=counts,
        vocab_size=st.none() | counts,
        device_name=st.none() | ids,
        device_memory_bytes=st.none() | st.integers(0, 2**50),
        pid=counts,
    ),
    TokenBatch: st.builds(TokenBatch, worker_id=ids, step=counts, deltas=st.lists(deltas, max_size=4)),
    Heartbeat: st.builds(Heartbeat, worker_id=ids, seq=counts, sent_at=floats, stats=worker_stats),
    DrainNotice: st.builds(DrainNotice, worker_id=ids, reason=ids),
    Rejected: st.builds(
        Rejected, request_id=ids, epoch=counts, status=st.integers(400, 599), field=ids, message=ids
    ),
    Submit: st.builds(
        Submit,
        request_id=ids,
        epoch=counts,
        prompt_token_ids=token_ids,
        resumed_token_ids=token_ids,
        sampling=sampling_params,
        tier=tiers,
        cache_salt=st.none() | ids,
        trace_context=st.dictionaries(st.text(max_size=20), st.text(max_size=60), max_size=3),
        arrival_time=floats,
    ),
    Abort: st.builds(Abort, request_id=ids, epoch=counts),
    Shutdown: st.builds(Shutdown, drain=st.booleans()),
    KVEvents: st.builds(
        KVEvents, worker_id=ids, seq=counts, block_size=counts, stored=block_hashes, removed=block_hashes
    ),
    KVSnapshot: st.builds(
        KVSnapshot,
        worker_id=ids,
        seq=counts,
        block_size=counts,
        part=counts,
        num_parts=counts,
        hashes=block_hashes,
    ),
    ResyncKV: st.builds(ResyncKV),
}
worker_messages = st.one_of(*(message_strategies[t] for t in WORKER_TYPES))
gateway_messages = st.one_of(*(message_strategies[t] for t in GATEWAY_TYPES))


def submit(**overrides: Any) -> Submit:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "epoch": 0,
        "prompt_token_ids": [1, 2, 3],
        "sampling": SamplingParams(max_tokens=8),
        "tier": DEFAULT_TIERS[0],
        "arrival_time": 1.0,
    }
    return Submit(**(fields | overrides))


@settings(max_examples=150, deadline=None)
@given(worker_messages)
def test_worker_messages_round_trip(message: Any) -> None:
    decoder = worker_message_decoder()
    assert decoder.decode(encode(message)) == message
    assert decoder.stats.decoded == 1


@settings(max_examples=150, deadline=None)
@given(gateway_messages)
def test_gateway_messages_round_trip(message: Any) -> None:
    decoder = gateway_message_decoder()
    decoded = decoder.decode(encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_strategies_cover_every_message_type() -> None:
    # A new message added to a union without a strategy would otherwise go untested.
    assert set(message_strategies) == {*WORKER_TYPES, *GATEWAY_TYPES}


def test_tags_are_distinct_snake_case_and_on_the_wire() -> None:
    all_types = (*WORKER_TYPES, *GATEWAY_TYPES)
    tags = [t.__struct_config__.tag for t in all_types]
    assert len(set(tags)) == len(tags)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", tag) for tag in tags)
    assert not set(WORKER_TYPES) & set(GATEWAY_TYPES)
    raw = msgspec.msgpack.decode(encode(Abort(request_id="r", epoch=3)))
    assert raw == {"type": "abort", "v": PROTOCOL_VERSION, "request_id": "r", "epoch": 3}


@pytest.mark.parametrize("cls", [*WORKER_TYPES, *GATEWAY_TYPES, TokenDelta, TokenLogprob, Usage, WorkerStats])
def test_every_struct_is_strict_frozen_and_keyword_only(cls: type[msgspec.Struct]) -> None:
    config = cls.__struct_config__
    assert config.forbid_unknown_fields
    assert config.frozen
    parameters = inspect.signature(cls).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    if cls in WORKER_TYPES or cls in GATEWAY_TYPES:
        assert config.tag_field == "type"
        assert cls.__struct_defaults__[cls.__struct_fields__.index("v")] == PROTOCOL_VERSION


@pytest.mark.parametrize(
    "message",
    [submit(), Abort(request_id="r", epoch=1), DrainNotice(worker_id="w", reason="sigterm"), Shutdown()],
)
def test_unknown_field_is_rejected(message: Any) -> None:
    raw = msgspec.to_builtins(message) | {"surprise": 1}
    decoder = worker_message_decoder() if type(message) in WORKER_TYPES else gateway_message_decoder()
    assert decoder.decode(msgspec.msgpack.encode(raw)) is None
    assert decoder.stats.dropped_malformed == 1
    assert decoder.stats.decoded == 0


def test_unknown_field_in_a_nested_struct_is_rejected() -> None:
    raw = msgspec.to_builtins(submit())
    raw["sampling"]["best_of"] = 4
    decoder = gateway_message_decoder()
    assert decoder.decode(msgspec.msgpack.encode(raw)) is None
    assert decoder.stats.dropped_malformed == 1


def test_other_protocol_version_is_dropped_and_counted() -> None:
    decoder = gateway_message_decoder()
    assert decoder.decode(encode(Abort(request_id="r", epoch=0, v=PROTOCOL_VERSION + 1))) is None
    # A future version with a field we have never heard of is still "version", not "malformed".
    raw = msgspec.to_builtins(submit(v=PROTOCOL_VERSION + 1)) | {"priority_boost": 2}
    assert decoder.decode(msgspec.msgpack.encode(raw)) is None
    assert decoder.stats.dropped_version == 2
    assert decoder.stats.dropped_malformed == 0
    assert decoder.stats.decoded == 0


def test_a_register_from_before_the_device_fields_still_decodes() -> None:
    new = Register(
        worker_id="w", model="m", dtype="float32", device="cpu", num_kv_blocks=8, block_size=16,
        kv_capacity_tokens=128, max_model_len=512, max_num_seqs=4, device_name="EPYC", pid=1,
    )  # fmt: skip
    old = {k: v for k, v in msgspec.to_builtins(new).items() if not k.startswith("device_")}
    decoder = worker_message_decoder()
    message = decoder.decode(msgspec.msgpack.encode(old))
    assert isinstance(message, Register) and decoder.stats.num_dropped == 0
    assert (message.device_name, message.device_memory_bytes) == (None, None)
    assert message == msgspec.structs.replace(new, device_name=None)


def test_size_caps_hold_on_decode() -> None:
    decoder = gateway_message_decoder()
    assert decoder.decode(encode(Abort(request_id="x" * MAX_ID_CHARS, epoch=0))) is not None
    assert decoder.decode(encode(Abort(request_id="x" * (MAX_ID_CHARS + 1), epoch=0))) is None
    delta = TokenDelta(request_id="r", epoch=0, usage=Usage(prompt_tokens=1, completion_tokens=1))
    batch = TokenBatch(worker_id="w", step=1, deltas=[delta] * (MAX_DELTAS_PER_BATCH + 1))
    assert worker_message_decoder().decode(encode(batch)) is None
    assert decoder.stats.dropped_malformed == 1


def test_token_delta_omits_defaults_on_the_hot_path() -> None:
    delta = TokenDelta(
        request_id="r", epoch=0, token_ids=[7], text="a", usage=Usage(prompt_tokens=1, completion_tokens=1)
    )
    assert set(msgspec.msgpack.decode(msgspec.msgpack.encode(delta))) == {
        "request_id",
        "epoch",
        "token_ids",
        "text",
        "usage",
    }


def test_submit_validate_names_the_field_at_fault() -> None:
    submit().validate(vocab_size=100, max_model_len=64)
    cases = [
        (submit(prompt_token_ids=[]), "prompt"),
        (submit(prompt_token_ids=[100]), "prompt"),
        (submit(prompt_token_ids=[1] * 64), "prompt"),
        (submit(sampling=SamplingParams(max_tokens=62)), "max_tokens"),
        (submit(sampling=SamplingParams(max_tokens=2), resumed_token_ids=[5, 6]), "resumed_token_ids"),
    ]
    for message, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            message.validate(vocab_size=100, max_model_len=64)
        assert info.value.field == field


@pytest.mark.parametrize("module", ["messages", "codec", "prompt"])
def test_wire_imports_only_msgspec_stdlib_and_wire(module: str) -> None:
    tree = ast.parse((Path(__file__).parents[2] / "wire" / f"{module}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    for name in names:
        top = name.split(".")[0]
        assert top in {"msgspec", "wire", "__future__"} or top in sys.stdlib_module_names, name
        assert top != "pickle", name
