"""What a completion's spans say of its answer and of its routing: the GenAI semantic conventions'
response attributes and ours (workers, migrations, time to first token), and the routing decision's
candidates with their scores; and ``ChoiceProgress``, what each choice has sent, which they read.

The server span is the HTTP one (telemetry/http.py); completion.py asks for these only when it records.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.openai_types import UsageInfo
from gateway.request_stream import RequestStream
from telemetry import attributes as attr
from wire.messages import TokenDelta, TokenLogprob

AttributeValue = str | bool | int | float | list[str] | list[float]


@dataclass(slots=True)
class ChoiceProgress:
    """Per choice: what the client has been sent, for the body, usage, latency metrics and spans."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a scored prompt's (echo)
    token_ids: list[int] = field(default_factory=list)  # a whole answer's (vLLM's return_token_ids)
    last: TokenDelta | None = None
    num_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None


def route_attributes(stream: RequestStream) -> dict[str, AttributeValue]:
    """The routing decision: the worker, and the candidates with the scores the policy weighed."""
    attributes: dict[str, AttributeValue] = {attr.WORKER: stream.worker_id}
    if stream.route_scores:
        candidates = sorted(stream.route_scores)
        attributes[attr.ROUTE_CANDIDATES] = candidates
        attributes[attr.ROUTE_SCORES] = [stream.route_scores[w] for w in candidates]
    if stream.expected_cached_tokens is not None:
        attributes[attr.ROUTE_CACHED_TOKENS] = stream.expected_cached_tokens
    return attributes


def response_attributes(
    model: str,
    response_id: str,
    usage: UsageInfo,
    progress: Sequence[ChoiceProgress],
    streams: Sequence[RequestStream],
    arrival: float,
    capture_content: bool,
) -> dict[str, AttributeValue]:
    """The GenAI response attributes (usage as far as it got, whatever the end), the workers and
    migrations, the first token's time after ``arrival``, and the answers' text when captured."""
    reasons: list[str] = [(p.last.finish_reason if p.last else None) or "none" for p in progress]
    workers = list(dict.fromkeys(stream.worker_id for stream in streams))
    attributes: dict[str, AttributeValue] = {
        attr.GEN_AI_RESPONSE_MODEL: model,
        attr.GEN_AI_RESPONSE_ID: response_id,
        attr.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        attr.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        attr.GEN_AI_RESPONSE_FINISH_REASONS: reasons,
        attr.CACHED_TOKENS: usage.prompt_tokens_details.cached_tokens,
        attr.WORKER: ",".join(workers),
        attr.MIGRATIONS: sum(stream.epoch for stream in streams),  # each move is epoch + 1
    }
    first = min((p.first_at for p in progress if p.first_at is not None), default=None)
    if first is not None:
        attributes[attr.TIME_TO_FIRST_TOKEN] = first - arrival
    if capture_content:
        attributes[attr.GEN_AI_OUTPUT_MESSAGES] = json.dumps(["".join(p.text) for p in progress])
    return attributes
