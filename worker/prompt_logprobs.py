"""A scored prompt (``SamplingParams.prompt_logprobs``): which rows of a step predict its prompt tokens.

Row ``p`` of a request (the token at position ``p``) predicts the token at ``p + 1``: a prompt chunk of
positions ``[start, end)`` scores the prompt tokens ``start + 1 .. end`` that are the client's
(``Request.outputs_from``); the last prompt position's row predicts the first output token, which the
sampler picks. The scheduler names a step's scoring rows once (``SchedulerOutput.score_spans``, from
``score_spans``); the runner returns their logits after the sampled rows', and the engine turns them
into logprobs as the sampler does its tokens' (``worker.sampler.token_logprobs``, a few rows at a time):

    logits [rows, V] ─▶ log_softmax ─▶ the prompt token's logprob and rank, and the ``k`` most likely

A span is scored the same way whatever else the step holds: a row's logits do not depend on its batch
(docs/kernels.md), so neither do its logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.request import Request


@dataclass(slots=True, frozen=True)
class ScoreSpan:
    """The rows of a step that score ``request``'s prompt tokens from ``first_position`` on."""

    request: Request
    first_position: int  # the prompt position the first row predicts (>= 1)
    num_rows: int

    @property
    def targets(self) -> list[int]:
        """The prompt tokens its rows predict, in row order."""
        start = self.first_position
        return self.request.all_token_ids[start : start + self.num_rows]


def score_spans(scheduled: Sequence[Request], num_scheduled: dict[str, int]) -> list[ScoreSpan]:
    """The scoring rows of a step, in its row order (before the scheduler advances its requests): for
    each request that scores its prompt, the rows whose next token is still a prompt token."""
    spans = []
    for request in scheduled:
        if not request.scores_prompt:
            continue
        start = request.num_computed_tokens
        end = min(start + num_scheduled[request.request_id], request.outputs_from - 1)
        if end > start:
            spans.append(ScoreSpan(request, start + 1, end - start))
    return spans
