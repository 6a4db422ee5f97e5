"""A scored prompt (``SamplingParams.prompt_logprobs``): which rows of a step predict its prompt tokens,
and their logprobs.

Row ``p`` of a request (the token at position ``p``) predicts the token at ``p + 1``: a prompt chunk of
positions ``[start, end)`` scores the prompt tokens ``start + 1 .. end`` that are the client's
(``Request.outputs_from``); the last prompt position's row predicts the first output token, which the
sampler picks. The runner returns those rows' logits after the sampled rows' (``score_spans`` gives
both the same rows), and the engine turns them into logprobs here, a few rows at a time:

    logits [rows, V] ─▶ log_softmax ─▶ the prompt token's logprob, and the ``k`` most likely

A span is scored the same way whatever else the step holds: a row's logits do not depend on its batch
(docs/kernels.md), so neither do its logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.request import Request
from worker.sampler import TokenLogprobs

SCORE_ROWS = 64  # rows a log_softmax at a time: [64, V] float32, 12 MB at a 49,152-token vocabulary


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


def score(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's target token's logprob and rank (1: the most likely) and the ``num_top`` most
    likely (token, logprob), best first; ``logits`` is ``[len(targets), V]``."""
    assert logits.shape[0] == len(targets), (tuple(logits.shape), len(targets))
    out: list[TokenLogprobs] = []
    for lo in range(0, len(targets), SCORE_ROWS):
        rows = logits[lo : lo + SCORE_ROWS].float().log_softmax(dim=-1)
        ids = torch.tensor(targets[lo : lo + SCORE_ROWS], dtype=torch.int64, device=rows.device)
        chosen_values = rows.gather(1, ids.unsqueeze(1))
        chosen: list[float] = chosen_values.squeeze(1).tolist()
        ranks: list[int] = ((rows > chosen_values).sum(dim=-1) + 1).tolist()
        top_values: list[list[float]] = [[] for _ in chosen]
        top_ids: list[list[int]] = [[] for _ in chosen]
        if num_top > 0:
            values, indices = rows.topk(min(num_top, rows.shape[1]), dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        rows_out = zip(ids.tolist(), chosen, top_ids, top_values, ranks, strict=True)
        out.extend(
            TokenLogprobs(token_id, logprob, list(zip(top, values, strict=True)), rank)
            for token_id, logprob, top, values, rank in rows_out
        )
    return out
