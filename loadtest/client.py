"""One request against an OpenAI-compatible server, timed as the client sees it.

httpx (async) and the hand-written SSE parser in ``sse.py`` keep the client's CPU per token small: it
shares cores with the server in our benchmarks. The body asks for usage in the stream
(``stream_options.include_usage``) so output and cached-prompt token counts come from the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
import msgspec

from loadtest.records import Outcome, RequestRecord
from loadtest.sse import SSEParser
from loadtest.workloads import Api, RequestSpec

TIER_HEADER = "X-SLA-Tier"
_DONE = b"[DONE]"
_ERROR_SNIPPET = 300
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class Target:
    label: str  # "base" or "compare"
    base_url: str  # up to the host[:port] (a trailing /v1 is accepted and dropped)
    model: str
    default_tier: str  # what a request is judged against when no tier is asked for or echoed


@dataclass(frozen=True, slots=True)
class RequestOptions:
    api: Api
    stream: bool
    temperature: float
    ignore_eos: bool  # vLLM's extension; tierserve honours it, servers that do not know it ignore it
    headers: Mapping[str, str]  # Authorization, -H headers
    timeout_s: float
    # tier → the body's "priority" (vLLM's extension, lower is more urgent); None: no priority sent
    priorities: Mapping[str, int] | None = None


def api_url(base_url: str, api: Api) -> str:
    root = base_url.rstrip("/").removesuffix("/v1")
    return root + api.path


def request_body(spec: RequestSpec, model: str, options: RequestOptions) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "temperature": options.temperature}
    if options.api is Api.RESPONSES:  # the usage comes in the last event, unasked
        body["input"] = spec.messages
        body["max_output_tokens"] = spec.max_tokens
    else:
        body["max_tokens"] = spec.max_tokens
        if options.api is Api.CHAT:
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt
    if options.stream:
        body["stream"] = True
        if options.api is not Api.RESPONSES:
            body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.priorities is not None and spec.tier is not None and spec.tier in options.priorities:
        body["priority"] = options.priorities[spec.tier]
    return body


async def send(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, options: RequestOptions, t0: float
) -> RequestRecord:
    """Send ``spec`` and wait for the whole answer; never raises for what the server or network did."""
    headers = dict(options.headers)
    if spec.tier is not None:
        headers[TIER_HEADER] = spec.tier
    asked = next((v for k, v in headers.items() if k.lower() == TIER_HEADER.lower()), None)
    record = RequestRecord(
        index=spec.index,
        target=target.label,
        tier=asked or target.default_tier,
        expected_prompt_tokens=spec.num_prompt_tokens,
        max_tokens=spec.max_tokens,
        t_sent=time.perf_counter() - t0,
    )
    body = msgspec.json.encode(request_body(spec, target.model, options))
    headers["content-type"] = "application/json"
    url = api_url(target.base_url, options.api)
    try:
        async with asyncio.timeout(options.timeout_s):
            try:
                await _exchange(client, url, body, headers, record, options, t0)
            except httpx.RemoteProtocolError:
                if record.status is not None:
                    raise
                # Closed before any answer: a kept-alive connection the server had just closed (llama.cpp's
                # server now and then, between one streamed answer and the next request). Nothing was
                # answered, so the request goes once more; the wait stays in its TTFT.
                record.num_retries += 1
                await _exchange(client, url, body, headers, record, options, t0)
    except TimeoutError:
        _fail(record, Outcome.TIMEOUT, f"no complete answer within {options.timeout_s:g} s", t0)
    except httpx.TimeoutException as exc:
        _fail(record, Outcome.TIMEOUT, f"{type(exc).__name__}", t0)
    except httpx.HTTPError as exc:
        _fail(record, Outcome.TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}", t0)
    return record


async def _exchange(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    record: RequestRecord,
    options: RequestOptions,
    t0: float,
) -> None:
    async with client.stream("POST", url, content=body, headers=headers) as response:
        record.status = response.status_code
        record.tier = response.headers.get("x-sla-tier", record.tier)
        if response.status_code != 200:
            text = (await response.aread())[:_ERROR_SNIPPET].decode("utf-8", errors="replace")
            _fail(record, _status_outcome(response.status_code), text, t0)
        elif options.stream:
            await _read_stream(response, record, options.api, t0)
        else:
            _read_whole(await response.aread(), record, options.api, t0)


def _status_outcome(status: int) -> Outcome:
    if status == 429:
        return Outcome.RATE_LIMITED
    return Outcome.HTTP_4XX if 400 <= status < 500 else Outcome.HTTP_5XX


def _fail(record: RequestRecord, outcome: Outcome, error: str, t0: float) -> None:
    record.outcome, record.error = outcome, error
    record.t_end = time.perf_counter() - t0


async def _read_stream(response: httpx.Response, record: RequestRecord, api: Api, t0: float) -> None:
    parser = SSEParser()
    finished = False
    async for chunk in response.aiter_bytes():  # decoded, should a server compress the stream
        now = time.perf_counter() - t0
        for data in parser.feed(chunk):
            if data == _DONE:
                break
            event = _decode(data)
            record.t_end = now
            if not isinstance(event, dict):
                continue
            if "error" in event or event.get("type") in ("error", "response.failed"):
                _fail(record, Outcome.STREAM_ERROR, str(event.get("error", event))[:_ERROR_SNIPPET], t0)
                return
            if api is Api.RESPONSES:
                finished = _read_response_event(event, record, now) or finished
                continue
            for choice in event.get("choices") or ():
                text = choice.get("delta", {}).get("content") if api is Api.CHAT else choice.get("text")
                if text:
                    record.chunk_times.append(now)
                finished = finished or choice.get("finish_reason") is not None
            _read_usage(event.get("usage"), record)
    if not finished:
        _fail(record, Outcome.STREAM_ERROR, "the stream ended without a finish_reason", t0)
    elif record.num_output_tokens is None:
        record.num_output_tokens = len(record.chunk_times)  # no usage: a text chunk per token


def _read_response_event(event: dict[str, object], record: RequestRecord, now: float) -> bool:
    """One Responses API event: text deltas timed; True for the last (its response has the usage)."""
    kind = event.get("type")
    if kind == "response.output_text.delta" and event.get("delta"):
        record.chunk_times.append(now)
    if kind not in ("response.completed", "response.incomplete"):
        return False
    response = event.get("response")
    _read_usage(response.get("usage") if isinstance(response, dict) else None, record)
    return True


def _read_whole(data: bytes, record: RequestRecord, api: Api, t0: float) -> None:
    """Not streamed: the whole text arrives at once, so TTFT is the E2E latency."""
    now = time.perf_counter() - t0
    record.t_end = now
    body = _decode(data)
    answer = body.get("output" if api is Api.RESPONSES else "choices") if isinstance(body, dict) else None
    if not answer:
        _fail(record, Outcome.STREAM_ERROR, "a 200 without an answer", t0)
        return
    record.chunk_times.append(now)
    _read_usage(body.get("usage"), record)
    if record.num_output_tokens is None:
        record.num_output_tokens = 1


def _read_usage(usage: object, record: RequestRecord) -> None:
    """OpenAI's usage, as the chat and completions APIs write it or as the Responses API does."""
    if not isinstance(usage, dict):
        return
    responses = "input_tokens" in usage
    record.num_prompt_tokens = usage.get("input_tokens" if responses else "prompt_tokens")
    record.num_output_tokens = usage.get("output_tokens" if responses else "completion_tokens")
    details = usage.get("input_tokens_details" if responses else "prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.num_cached_tokens = details["cached_tokens"]
