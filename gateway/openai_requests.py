"""The OpenAI request bodies this gateway takes, as msgspec Structs (the responses: openai_types.py,
rendered by openai_api.py).

Requests decode straight from the body bytes (``decode_chat`` / ``decode_completion``, through
gateway/body_decoding.py); a wrong type becomes :class:`~wire.errors.InvalidRequestError` naming the
field, as the client wrote it. A
top-level field the server does not know is a 400 naming it, as OpenAI's own API answers
("Unrecognized request argument"): nothing a client asks for is dropped without a word. Known
fields accepted with no effect on the answer: ``user``, ``metadata``, ``store: false``, the chat
endpoint's ``prompt_cache_key``, ``safety_identifier`` and ``modalities: ["text"]``, and the legacy
``echo: false``, ``suffix`` empty, ``best_of`` equal to ``n``; any other value of them, and the
deprecated ``functions`` and ``function_call``, is refused by name; so is an unknown key of
``structured_outputs`` or ``response_format``. Inside the messages, tools and ``stream_options``,
keys the server does not read are let through (clients replay OpenAI's own response messages, with
``refusal``, ``annotations`` and ``audio`` in them). Messages: gateway/chat_messages.py; tools:
gateway/tools.py. Ranges (temperature, top_p, penalties, ...) are checked once, by
``SamplingParams.validate``, on both sides of the wire.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway import tools
from gateway.body_decoding import decode_body
from gateway.chat_messages import ChatMessage, check_messages
from gateway.tokenizer import RESERVED_TEMPLATE_VARIABLES, ChatOptions
from gateway.tools import NamedToolChoice, ToolDef, ToolSpec
from wire.errors import InvalidRequestError
from wire.messages import MAX_PRIORITY
from wire.sampling import SamplingParams
from wire.structured import ANY_JSON_OBJECT, MAX_SPEC_BYTES, StructuredKind, StructuredOutput

# Known OpenAI fields not served: refused by name rather than dropped (a client that sends them relies
# on them: an agent parsing calls must not get free text with a 200). ``tools`` replaces both.
UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` body field: exactly one of its kinds."""

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = None  # refused: not served

    def to_structured(self) -> StructuredOutput:
        if self.structural_tag is not None:
            raise InvalidRequestError("structured_outputs.structural_tag", "is not supported by this server")
        given = [
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs",
                f"needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}",
            )
        (kind,) = given
        field = f"structured_outputs.{kind}"
        if kind == "json_object":
            return _structured("json", ANY_JSON_OBJECT, field, self.whitespace_pattern)
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else _json_text(self.json, field)
            return _structured("json", spec, field, self.whitespace_pattern)
        if kind == "choice":
            return _structured("choice", _json_text(self.choice, field), field)
        text = self.regex if kind == "regex" else self.grammar
        assert text is not None
        return _structured("regex" if kind == "regex" else "grammar", text, field)


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the answer always matches the schema here, strict or not
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: text, any JSON object, or JSON matching a schema."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None

    def to_structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return _structured("json", ANY_JSON_OBJECT, "response_format")
        if self.type == "json_schema":
            field = "response_format.json_schema.schema"
            if self.json_schema is None or self.json_schema.schema is None:
                raise InvalidRequestError(field, "type json_schema needs json_schema.schema")
            return _structured("json", _json_text(self.json_schema.schema, field), field)
        raise InvalidRequestError(
            "response_format.type", f"must be text, json_object or json_schema, got {self.type!r}"
        )


def _json_text(value: object, field: str) -> str:
    text = msgspec.json.encode(value).decode()
    if len(text) > MAX_SPEC_BYTES:
        raise InvalidRequestError(field, f"at most {MAX_SPEC_BYTES} bytes as JSON, got {len(text)}")
    return text


def _structured(
    kind: StructuredKind, spec: str, field: str, whitespace: str | None = None
) -> StructuredOutput:
    if len(spec) > MAX_SPEC_BYTES:
        raise InvalidRequestError(field, f"at most {MAX_SPEC_BYTES} bytes, got {len(spec)}")
    return StructuredOutput(kind=kind, spec=spec, field=field, whitespace_pattern=whitespace)


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    user: str | None = None  # OpenAI's end-user id: accepted, no effect (tenants come from API keys)
    metadata: dict[str, str] | None = None  # OpenAI's tags for stored completions: accepted, no effect
    store: bool | None = None  # OpenAI's stored completions: only false (none are stored here)
    # vLLM's extensions to the OpenAI body, which benchmark tools and clients of vLLM send; accepted
    # under the same names and meanings (top_k 0 or -1: off, as in vLLM).
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # tokenized for the placed model: ``bad_word_ids``
    # vLLM's scheduling priority: within the request's SLA tier, lower runs first (default 0). The
    # tier (X-SLA-Tier, the tenant's default) always comes first; docs/api.md says how they combine.
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY)] = 0
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: JSON schema, regex, choice, grammar
    # vLLM's: each prompt token's logprob, rank and this many alternatives (the prompt scored); not streamed
    prompt_logprobs: int | None = None
    # vLLM's: only the prompt's last this many tokens (-1: as many as the model's context takes)
    truncate_prompt_tokens: int | None = None
    # vLLM's: the answer's id after its prefix (the X-Request-Id header wins): gateway/app.py
    request_id: str | None = None
    # vLLM's: only requests with the same salt (of the same tenant) share prefix-cache blocks
    cache_salt: str | None = None
    # vLLM's: the prompt's and the answer's token ids in the answer (what RL trainers read back)
    return_token_ids: bool = False
    # vLLM's: logprobs name each token "token_id:<id>" instead of its text
    return_tokens_as_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far (with include_usage,
        as vLLM has it)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def check_n(self, max_n: int) -> None:
        if not 1 <= self.n <= max_n:
            raise InvalidRequestError("n", f"must be between 1 and {max_n}, got {self.n}")

    def truncation(self) -> int | None:
        """How many of a prompt's last tokens to keep (None: all; -1: as many as the context takes)."""
        keep = self.truncate_prompt_tokens
        if keep is not None and keep != -1 and keep < 1:
            raise InvalidRequestError("truncate_prompt_tokens", f"must be -1 or at least 1, got {keep}")
        return keep

    def check_no_op_fields(self) -> None:
        """The OpenAI fields accepted only where they change nothing (``store``; the legacy ones are
        the completion endpoint's)."""
        if self.store:
            raise InvalidRequestError("store", "stored completions are not served: send false or omit it")

    def sampling(self, *, max_tokens: int | None, logprobs: int | None, room: int) -> SamplingParams:
        """``room``: context left after the prompt, the default when the client sets no limit."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs", "is not available with stream: true (as in vLLM)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(room, 1),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            stop=stop,
            top_k=self.top_k if self.top_k is not None and self.top_k > 0 else None,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            logit_bias=self._logit_bias(),
            structured=self.structured_output(),
        )

    def structured_output(self) -> StructuredOutput | None:
        """What the answer must match (the chat endpoint adds ``response_format``)."""
        return None if self.structured_outputs is None else self.structured_outputs.to_structured()

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's map of token ids (JSON object keys, so strings) to biases; ids and ranges are
        checked by ``SamplingParams.validate`` against the model's vocabulary."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}") from None
            pairs.append((token_id, float(value)))
        return tuple(pairs)


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # refused: the deprecated form of tools
    function_call: Any = None
    # OpenAI's processing tier (auto, default, flex, priority): a tier here (ServerConfig.service_tiers),
    # resolved by gateway.identity.with_service_tier; the response names the tier it ran at.
    service_tier: str | None = None
    # OpenAI's successors of ``user``: accepted, no effect. Routing finds a prompt's cached prefix by its
    # blocks' hashes (policies/prefix_routing.py), which a key could only approximate; no abuse signal
    # leaves this server.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None  # the output kinds: only text is served
    # vLLM's (and transformers') ways of shaping the prompt from the messages: gateway/tokenizer.py
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the answer begins with the last message it continues (``echoed``)

    def check_supported(self) -> None:
        """Roles known, tools consistent; fields this server does not serve refused by name."""
        check_messages(self.messages)
        self.chat_options()
        self.truncation()
        for name in UNSUPPORTED_CHAT_FIELDS:
            if getattr(self, name) is not None:
                raise InvalidRequestError(name, "is deprecated and not served: send tools and tool_choice")
        self.check_no_op_fields()
        if self.modalities is not None and self.modalities != ["text"]:
            sent = msgspec.json.encode(self.modalities).decode()
            raise InvalidRequestError("modalities", f'only ["text"] is served, got {sent}')
        self.structured_output()  # a forced call conflicts with another structured output

    def tool_spec(self) -> ToolSpec | None:
        return tools.tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)

    def echoed(self) -> str:
        """vLLM's chat ``echo``: the text the answer repeats before its own, the last message's where
        the answer continues it (its role is the answer's: ``assistant``, or any role when no new
        turn is opened); else nothing."""
        last = self.messages[-1]
        if not self.echo or (self.chat_options().add_generation_prompt and last.role != "assistant"):
            return ""
        return last.text()

    def chat_options(self) -> ChatOptions:
        return chat_options(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=self.add_special_tokens,
            template_kwargs=self.chat_template_kwargs,
        )

    def structured_output(self) -> StructuredOutput | None:
        from_format = None if self.response_format is None else self.response_format.to_structured()
        from_vllm = super().structured_output()
        if from_format is not None and from_vllm is not None:
            raise InvalidRequestError(
                "structured_outputs", "cannot be given with a response_format other than text"
            )
        spec = self.tool_spec()
        from_tools = None if spec is None else tools.grammar(spec)
        if from_tools is not None and (from_format or from_vllm) is not None:
            raise InvalidRequestError(
                "tool_choice", "a required or named tool call cannot be given with a structured output"
            )
        return from_tools or from_format or from_vllm

    def to_sampling(self, room: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs = true")
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(max_tokens=limit, logprobs=num_logprobs, room=room)


def chat_options(
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
    template_kwargs: dict[str, Any] | None,
) -> ChatOptions:
    """How the messages become the prompt (the chat endpoint's and ``/tokenize``'s fields).
    ``continue_final_message`` leaves the last message open for the model to go on with (a prefilled
    answer): not with ``add_generation_prompt``, which opens a new turn (a 400, as in vLLM), and only
    after some text to continue. ``chat_template_kwargs`` may set those two, as vLLM lets them (agent
    frameworks send ``{"add_generation_prompt": true, "enable_thinking": false}``), not the messages
    or tools."""
    kwargs = dict(template_kwargs or {})
    flags = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    for name in sorted(flags.keys() & kwargs.keys()):
        value = kwargs.pop(name)
        if not isinstance(value, bool):
            raise InvalidRequestError(f"chat_template_kwargs.{name}", f"must be a boolean, got {value!r}")
        flags[name] = value
    for name in sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys()):
        raise InvalidRequestError(
            f"chat_template_kwargs.{name}", "is set by the server: send it as the request's own field"
        )
    if flags["continue_final_message"] and flags["add_generation_prompt"]:
        raise InvalidRequestError(
            "continue_final_message",
            "cannot be true with add_generation_prompt (true by default): send add_generation_prompt: false",
        )
    if flags["continue_final_message"] and not messages[-1].text().strip():
        raise InvalidRequestError(
            f"messages[{len(messages) - 1}].content", "continue_final_message needs text to continue"
        )
    return ChatOptions(
        add_generation_prompt=flags["add_generation_prompt"],
        continue_final_message=flags["continue_final_message"],
        add_special_tokens=add_special_tokens,
        template_kwargs=kwargs,
    )


class CompletionRequest(_Sampling, kw_only=True):
    # One prompt (text or token ids) or a batch of them; msgspec allows one array type per union, so a
    # batch decodes loosely here and ``prompts()`` checks that it is all of one kind.
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None  # the legacy API: a count of top alternatives
    # The legacy API's other fields, accepted where they change nothing (check_supported).
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) before a text prompt; default: as the tokenizer
    # encodes text by default (Hugging Face's: its post-processor's; SmolLM2's adds none)
    add_special_tokens: bool | None = None

    def check_supported(self) -> None:
        """The legacy fields this server does not serve refused by name where they would change the
        answer; ``store`` likewise."""
        if self.suffix:
            raise InvalidRequestError("suffix", "insertion after a suffix is not served: omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                "best_of", f"only best_of equal to n ({self.n}) is served, got {self.best_of}"
            )
        self.check_no_op_fields()
        self.truncation()

    def prompts(self, max_prompts: int) -> list[str | list[int]]:
        """The prompts to complete: text or token ids each, at least one, at most ``max_prompts``."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if all(isinstance(item, int) for item in prompt):
            return [[item for item in prompt if isinstance(item, int)]]
        if all(isinstance(item, str) for item in prompt):
            prompts: list[str | list[int]] = [item for item in prompt if isinstance(item, str)]
        elif all(isinstance(item, list) for item in prompt):
            prompts = [item for item in prompt if isinstance(item, list)]
        else:
            raise InvalidRequestError(
                "prompt", "a list must be all strings, all token ids, or all lists of token ids"
            )
        if len(prompts) > max_prompts:
            raise InvalidRequestError(
                "prompt", f"at most {max_prompts} prompts per request, got {len(prompts)}"
            )
        return prompts

    def to_sampling(self, room: int) -> SamplingParams:
        """With ``echo``, the answer repeats the prompt: with ``logprobs``, its tokens' too (the prompt
        scored on the worker); ``max_tokens`` 0 then asks for the prompt alone."""
        limit = 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
        if limit == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "must be at least 1 (0 only with echo: the prompt alone)")
        sampling = self.sampling(max_tokens=limit, logprobs=self.logprobs, room=room)
        if not self.echo:
            return sampling
        # the prompt scored for the echo's logprobs (and for max_tokens 0: the prompt is all there is)
        wanted = [
            n for n in (self.logprobs, self.prompt_logprobs, 0 if limit == 0 else None) if n is not None
        ]
        return msgspec.structs.replace(sampling, prompt_logprobs=max(wanted, default=None))


def decode_chat(body: bytes) -> ChatCompletionRequest:
    request = decode_body(body, ChatCompletionRequest)
    if not request.messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    request.check_supported()
    return request


def decode_completion(body: bytes) -> CompletionRequest:
    request = decode_body(body, CompletionRequest)
    request.check_supported()
    return request
