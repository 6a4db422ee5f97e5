"""Batched next-token sampling: penalties, temperature, top-k/top-p/min-p, seeded noise, logprobs.

One call takes the step's logits ``[N, V]`` (float32) and one :class:`SamplingRow` per row. The order is

    logits ─▶ logit_bias ─▶ allowed_token_ids ─▶ banned ─▶ grammar mask ─▶ penalties ─┐
      ┌──────────────────────────────────────────────────────────────────────────────┘
      ├─▶ log_softmax ─▶ logprobs (all included)
      ├─▶ argmax ─▶ greedy rows
      └─▶ / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ exponential race ─▶ sampled rows

Sampling uses the exponential race: ``argmax(probs / e)`` with ``e ~ Exp(1)`` i.i.d. picks token ``i``
with probability ``probs[i]``. A row's noise is a hash of a key it draws each step (from its own
generator when seeded) and the token's index, so a seeded row gets the same token from the same logits
whatever else is in the batch (and, the noise being a token's own, a small change of rounding elsewhere
in its logits seldom moves it). The argmax and the top-k / top-p cut are row operations the runner
gives (``kernels/sampling.py``: the rules and the torch references; C on CPU,
``kernels/cpu/sampling.c``): the cut is a logit found by selection, not a sort of the vocabulary. 32
rows of 49152 at temperature 0.7 and top-p 0.9 took 89 ms with the sort and torch's ``exponential_``,
longer than the decode step that made them (2-core Intel Xeon, AVX2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.sampling import TORCH_SAMPLING, SamplingOps
from wire.sampling import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # from make_generator(params.seed); None: the global RNG
    # A structured output's next-token mask (worker/structured.py): int32 words, bit ``t % 32`` of
    # word ``t // 32`` set when token ``t`` is allowed; None: every token is.
    allowed: torch.Tensor | None = None
    # Tokens it may not pick this step (EOS and the stop token ids before ``min_tokens``; a bad word's
    # last token where the output ends with the rest of it: RequestState.banned)
    banned: Sequence[int] = ()


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), best first
    rank: int | None = None  # a scored prompt token's: 1 + the tokens more likely than it


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's own RNG, created once at admission and kept for its whole life."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _has_bias(params: SamplingParams) -> bool:
    """Logits changed before the choice: ``logit_bias`` added, or all but ``allowed_token_ids`` out."""
    return bool(params.logit_bias) or params.allowed_token_ids is not None


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


class Sampler:
    """Stateless: every per-request input (history, generator) comes in with the rows. ``ops``: the
    row operations (the runner's: C on CPU, else the torch references; the same tokens either way)."""

    def __init__(self, ops: SamplingOps = TORCH_SAMPLING) -> None:
        self.ops = ops

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        params = [row.params for row in rows]
        if all(
            _is_greedy(p) and not _has_penalties(p) and not _has_bias(p) and p.logprobs is None
            for p in params
        ) and all(row.allowed is None and not row.banned for row in rows):
            # The hot path: one kernel, and bit-identical to HF's greedy decoding.
            return SamplerOutput(self.ops.argmax(logits).tolist(), [None] * len(rows))

        for apply in (apply_logit_bias, apply_allowed_ids, apply_banned, apply_allowed, apply_penalties):
            logits = apply(logits, rows)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
        sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if len(greedy) == len(rows):
            token_ids = self.ops.argmax(logits)  # no row copy when every row is greedy
        elif greedy:
            token_ids[greedy] = self.ops.argmax(logits[greedy])
        if sampled:
            token_ids[sampled] = _sample(_rows(logits, sampled), [rows[i] for i in sampled], self.ops)
        token_id_list: list[int] = token_ids.tolist()
        return SamplerOutput(token_id_list, _logprobs(logits, params, token_id_list))


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` with each row's ``logit_bias`` added (one scatter); the input is left untouched."""
    biased = [(i, token_id, value) for i, row in enumerate(rows) for token_id, value in row.params.logit_bias]
    return _scatter(logits, biased, accumulate=True)


def apply_allowed_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` with every token outside a row's ``allowed_token_ids`` at -inf (vLLM's); the
    input is left untouched."""
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return logits
    out = logits.clone()
    for i in limited:
        ids = torch.tensor(rows[i].params.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = out[i].index_select(0, ids)
        out[i].fill_(float("-inf")).index_copy_(0, ids, kept)
    return out


def apply_banned(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` with each row's banned tokens at -inf (one scatter); the input is left untouched."""
    minus_inf = float("-inf")
    return _scatter(
        logits, [(i, token_id, minus_inf) for i, row in enumerate(rows) for token_id in row.banned]
    )


def _scatter(
    logits: torch.Tensor, cells: list[tuple[int, int, float]], accumulate: bool = False
) -> torch.Tensor:
    """``logits`` with each (row, token, value) cell set, or added to where ``accumulate``, in one
    ``index_put`` (a new tensor; ``logits`` itself when there are none)."""
    if not cells:
        return logits
    device = logits.device
    row_index = torch.tensor([i for i, _, _ in cells], dtype=torch.long, device=device)
    col_index = torch.tensor([t for _, t, _ in cells], dtype=torch.long, device=device)
    values = torch.tensor([v for _, _, v in cells], dtype=logits.dtype, device=device)
    return logits.index_put((row_index, col_index), values, accumulate=accumulate)


def apply_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` with every token a row's grammar mask forbids at -inf (the input untouched)."""
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    if not masked:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    words = torch.stack([rows[i].allowed for i in masked])  # type: ignore[misc]
    # Little-endian int32 words as bytes: bit t % 8 of byte t // 8 is token t. One lookup per byte
    # gives its eight tokens' penalties (0 or -inf), added to the masked rows in one call: ~0.1 ms
    # for 8 rows of 49k tokens, where shifting every word 32 ways and masked_fill took ~1.4 ms.
    table = _PENALTIES.get((device, logits.dtype))
    if table is None:
        table = _PENALTIES[(device, logits.dtype)] = _penalty_table(device, logits.dtype)
    index = words.view(torch.uint8).flatten().to(device=device, dtype=torch.long)
    penalty = table.index_select(0, index).view(len(masked), -1)[:, :vocab_size]
    out = logits.clone()
    out.index_add_(0, torch.tensor(masked, device=device), penalty)
    return out


def _penalty_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: row ``b`` holds 0 for each set bit of byte ``b`` (lowest first), -inf for the rest."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)


_PENALTIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` with each row's penalties applied; the input is left untouched.

    Repetition (HF/CTRL): over prompt and output tokens, positive logits are divided by the penalty
    and negative ones multiplied. Presence and frequency (OpenAI): over output tokens only,
    ``logit -= presence * (count > 0) + frequency * count``. Only the logits of tokens a row has seen
    change, so only those are read and written (gathered by flat index, ``row * V + token``): building
    ``[rows, V]`` count tensors took ~19 ms for 32 rows of 49152 with 700 tokens seen each.
    """
    penalized = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not penalized:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    out = logits.clone()
    flat = out.view(-1)

    seen, seen_rows, _ = _seen(
        [(i, [*rows[i].prompt_token_ids, *rows[i].output_token_ids]) for i in penalized], vocab_size, device
    )
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[seen_rows]
    values = flat[seen]
    flat[seen] = torch.where(values < 0, values * repetition, values / repetition)

    output, output_rows, counts = _seen(
        [(i, rows[i].output_token_ids) for i in penalized], vocab_size, device
    )
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[output_rows]
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[output_rows]
    flat[output] = flat[output] - presence - frequency * counts
    return out


def _seen(
    token_ids: Sequence[tuple[int, Sequence[int]]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct flat indices ``row * vocab_size + token`` of ``(row, tokens)`` pairs, each one's row
    and its number of occurrences (float32)."""
    parts = [torch.tensor(ids, dtype=torch.long) + row * vocab_size for row, ids in token_ids]
    flat = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long, device=device)
    distinct, counts = torch.unique(flat, return_counts=True)
    return distinct, distinct // vocab_size, counts.to(torch.float32)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow], ops: SamplingOps) -> torch.Tensor:
    """One token per row from the tempered, truncated distribution; ``logits`` is ``[n, V]``.

    A row's weights are its tempered probabilities up to a constant, ``exp((logits - max) / T)`` (the
    top token's 1); its top-k / top-p cut (``ops.truncate``: C on CPU, a sort elsewhere) zeroes those
    of the logits below it, min-p those below ``min_p`` (relative to the top token, so it does not
    matter that the cut ran first); the draw is the exponential race over what is left (``_race``).
    Worked in place: each new ``[n, V]`` tensor of 6 MB cost ~1 ms of page faults at 32 rows.
    """
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature).exp_()
    top_k = [r.params.top_k or 0 for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        ops.truncate(logits, weights, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    min_p = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in min_p):
        weights.masked_fill_(weights < torch.tensor(min_p, device=device).unsqueeze(1), 0.0)
    return _race(weights, rows, ops)


def _rows(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``x[index]``, without the copy when ``index`` is every row in order."""
    return x if index == list(range(x.shape[0])) else x[index]


def _race(weights: torch.Tensor, rows: Sequence[SamplingRow], ops: SamplingOps) -> torch.Tensor:
    """Each row's token by the exponential race (``ops.race``: token ``i`` wins with probability
    ``weights[i] / total``), its noise a hash of a key the row draws each step (from its generator
    where seeded) and the token's index: a token's own, so a small change in some logits (another
    batch's rounding) moves the winner only where it was nearly tied. An inverse CDF, one uniform a
    row over the cumulative sum, moved with any change before the token it picked, and a seeded answer
    served beside other requests parted from the same answer alone within 15 tokens. torch's
    ``uniform_`` a token took ~4.7 ms for 32 rows of 49152 (``exponential_`` ~26)."""
    keys = torch.randint(0, 2**32, (len(rows),), dtype=torch.int64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            keys[i] = int(torch.randint(0, 2**32, (1,), generator=row.generator, device=row.generator.device))
    return ops.race(weights, keys.to(weights.device))


def _logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Log-softmax of the penalized logits, before temperature and truncation."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return out
    num_top = max(params[i].logprobs or 0 for i in wanted)
    scored = token_logprobs(logits[wanted], [token_ids[i] for i in wanted], num_top, ranks=False)
    for i, entry in zip(wanted, scored, strict=True):
        entry.top = entry.top[: params[i].logprobs or 0]
        out[i] = entry
    return out


LOGPROB_ROWS = 64  # rows a log_softmax at a time: [64, V] float32, 12 MB at a 49,152-token vocabulary


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int, ranks: bool = True
) -> list[TokenLogprobs]:
    """Each row's logprob of its token in ``token_ids``, its rank (1: the most likely; where ``ranks``)
    and the ``num_top`` most likely (token, logprob), best first; ``logits`` is ``[len(token_ids), V]``,
    taken ``LOGPROB_ROWS`` rows at a time. The sampler's chosen tokens, and a scored prompt's."""
    assert logits.shape[0] == len(token_ids), (tuple(logits.shape), len(token_ids))
    out: list[TokenLogprobs] = []
    for lo in range(0, len(token_ids), LOGPROB_ROWS):
        rows = logits[lo : lo + LOGPROB_ROWS].float().log_softmax(dim=-1)
        ids = torch.tensor(token_ids[lo : lo + LOGPROB_ROWS], dtype=torch.int64, device=rows.device)
        chosen = rows.gather(1, ids.unsqueeze(1))
        values: list[float] = chosen.squeeze(1).tolist()
        rank: list[int | None] = ((rows > chosen).sum(dim=-1) + 1).tolist() if ranks else [None] * len(values)
        top_values: list[list[float]] = [[] for _ in values]
        top_ids: list[list[int]] = [[] for _ in values]
        if num_top > 0:
            best, indices = rows.topk(min(num_top, rows.shape[1]), dim=-1)
            top_values, top_ids = best.tolist(), indices.tolist()
        entries = zip(ids.tolist(), values, top_ids, top_values, rank, strict=True)
        out.extend(TokenLogprobs(t, v, list(zip(tt, tv, strict=True)), r) for t, v, tt, tv, r in entries)
    return out
