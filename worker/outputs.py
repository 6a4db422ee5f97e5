"""What the engine emits per step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.request import FinishReason
from worker.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """The new part of one request's output after a step (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Usage as the client counts it: a request resumed after a failover (``Request.num_resumed``)
    # counts the tokens another worker generated as output, not prompt.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache
    error: str | None = None
    owner: object = None  # what the caller attached at add_request (the daemon: its gateway link)
    # A scored prompt's logprobs computed this step: those of its tokens from ``prompt_position`` on
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_position: int = 0
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Completion:
    """A whole finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1 on, when scored
