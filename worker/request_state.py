"""What the engine keeps for a live request beside the scheduler's ``Request``, and what a sampled
token does to it: appended, held to its grammar, detokenized, and whether it ends the request.

The engine's registry (``Engine._states``) holds one per live request; the stop rules live here, so
the loop reads as schedule → execute → sample → ``take`` each token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.detokenizer import IncrementalDetokenizer
from worker.request import FinishReason, Request
from worker.sampler import TokenLogprobs
from worker.structured import Matcher


@dataclass(slots=True, frozen=True)
class TokenEffect:
    """What one sampled token did: the text it shows, why it ended the request (None: it goes on), or
    an error (the request ends, the token unshown). ``stop_reason``: vLLM's, the stop string or stop
    token id that ended it (None for an EOS, a grammar's end, a length)."""

    text: str
    reason: FinishReason | None
    error: str | None = None
    stop_reason: str | int | None = None


def _ends_with(tokens: list[int], prefix: tuple[int, ...]) -> bool:
    return not prefix or (len(tokens) >= len(prefix) and tuple(tokens[-len(prefix) :]) == prefix)


@dataclass(slots=True)
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    owner: object = None  # the caller's, opaque here (the daemon: which gateway, which epoch)
    matcher: Matcher | None = None  # a structured output's place in its grammar
    num_prompt_scored: int = 0  # a scored prompt: the positions 1 .. this whose logprobs went out

    @classmethod
    def begin(
        cls,
        request: Request,
        tokenizer: Any,
        generator: torch.Generator | None,
        owner: object,
    ) -> RequestState:
        """The state of a new request. A resumed request's tokens from another worker
        (``Request.resumed_token_ids``, already streamed before a failover) are fed to the detokenizer
        token by token as the loop would have, so held-back partial characters and stop-string prefixes
        come out as the old worker would have sent them."""
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids[: request.outputs_from],
            stop=params.stop if params.min_tokens == 0 else (),
            skip_special_tokens=params.skip_special_tokens,
            include_stop=params.include_stop_str_in_output,
        )
        state = cls(request, detokenizer, generator, owner)
        for count, token_id in enumerate(request.resumed_token_ids, start=1):
            state._arm_stops(count)  # as ``take`` arms them: before the token's text
            detokenizer.update([token_id])
        return state

    @property
    def num_out(self) -> int:
        """Its output tokens as the client counts them: a failover's resumed tokens included."""
        return self.request.num_output_tokens + self.request.num_resumed

    @property
    def banned(self) -> tuple[int, ...]:
        """The tokens it may not sample next: EOS and its stop token ids while fewer than
        ``min_tokens`` are out; a bad word's last token where the output so far (a failover's resumed
        tokens included) ends with the rest of it, as vLLM reads its ``bad_words``."""
        request = self.request
        params = request.sampling_params
        if not params.bad_words and self.num_out >= params.min_tokens:
            return ()  # the common case, every row every step
        banned: set[int] = set()
        if self.num_out < params.min_tokens:
            banned |= request.eos_token_ids | set(params.stop_token_ids)
        if params.bad_words:
            longest = max(len(word) for word in params.bad_words) - 1
            tail = request.output_token_ids[-longest:] if longest else []
            if len(tail) < longest and request.num_resumed:
                tail = (request.resumed_token_ids + request.output_token_ids)[-longest:]
            banned.update(word[-1] for word in params.bad_words if _ends_with(tail, word[:-1]))
        return tuple(sorted(banned))

    def _arm_stops(self, num_out: int) -> None:
        """The stop strings are matched once ``min_tokens`` tokens are out (the last of them included)."""
        params = self.request.sampling_params
        if params.min_tokens and params.stop and num_out == params.min_tokens:
            self.detokenizer.arm(params.stop)

    def scored(self, first_position: int, entries: list[TokenLogprobs]) -> tuple[int, list[TokenLogprobs]]:
        """Of a scored prompt's logprobs from ``first_position`` on, those not sent yet (a prompt
        recomputed after a preemption is scored again), and the position of the first of them."""
        assert first_position <= self.num_prompt_scored + 1, "a scored prompt's chunks come in order"
        skip = self.num_prompt_scored + 1 - first_position
        fresh = entries[skip:]
        self.num_prompt_scored += len(fresh)
        return first_position + skip, fresh

    def take(self, token_id: int, max_model_len: int) -> TokenEffect:
        """Append a sampled token and apply the stop rules: an EOS or stop token (counted; its text shown
        only with ``include_stop_str_in_output``, as vLLM does), a stop string, a grammar that allows
        nothing more, ``max_tokens``, the context limit."""
        request = self.request
        params = request.sampling_params
        request.append_output_token(token_id)
        self._arm_stops(self.num_out)
        if self.matcher is not None and not self.matcher.accept(token_id):
            return TokenEffect("", FinishReason.ERROR, f"structured output: {self.matcher.error}")
        if token_id in request.eos_token_ids or token_id in params.stop_token_ids:
            shown = self.detokenizer.update([token_id]).text if params.include_stop_str_in_output else ""
            stop_id = None if token_id in request.eos_token_ids else token_id
            return TokenEffect(shown + self.detokenizer.flush(), FinishReason.STOP, stop_reason=stop_id)
        delta = self.detokenizer.update([token_id])
        if delta.stop_matched is not None:
            return TokenEffect(delta.text, FinishReason.STOP, stop_reason=delta.stop_matched)
        if self.matcher is not None and self.matcher.is_done:
            # the grammar allows nothing more: the answer is whole
            return TokenEffect(delta.text + self.detokenizer.flush(), FinishReason.STOP)
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
            return TokenEffect(delta.text + self.detokenizer.flush(), FinishReason.LENGTH)
        return TokenEffect(delta.text, None)
