"""The sampler's two row operations: the torch references (the spec, and the path on GPU) and the
protocol a faster implementation meets (``kernels/cpu/sampling.py``: C on CPU).

- ``argmax(scores)``: each row's first maximal index, a NaN counting as maximal (the first NaN wins):
  torch's ``max(dim=-1).indices``.
- ``thresholds(logits, weights, top_k, top_p)``: each row's top-k / top-p cut as a logit, the row
  keeping the tokens whose logit is at least it (``truncate``: the weights below it set to 0, in
  place). ``weights`` are the row's tempered probabilities up to a constant factor,
  ``exp((logits - max) / temperature)``: monotone in the logit, the top token's 1, with a NaN in a row
  holding a NaN or +inf logit (such a row gets no cut). ``top_k`` 0 is none; ``top_p`` 1 is none.
  Top-k keeps the k largest logits and every tie with the k-th. Top-p, over what top-k kept, keeps a
  token when the mass of the tokens strictly above its logit is below ``top_p`` of the kept mass: the
  smallest set that reaches ``top_p``, with the ties of its last token, and always the most likely.
  Masses are summed in float64. A row without a cut gets its top-k's k-th logit, or -inf.
- ``race(weights, keys)``: each row's exponential race, ``argmax(weights / -log(u))``, token ``i``
  winning with probability ``weights[i] / sum(weights)``; ``u`` is ``race_uniforms``: a hash of the
  row's key (32 bits, drawn by the sampler each step) and the token's index, so the noise is a
  token's own, whatever the batch, and costs no generator state a token. A row with a NaN weight
  takes its first NaN.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SamplingOps(Protocol):
    def argmax(self, scores: torch.Tensor) -> torch.Tensor: ...

    def thresholds(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor: ...

    def truncate(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> None:
        """``weights`` (the caller's own) with every token below its row's threshold set to 0."""

    def race(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor: ...


_MASK32 = 0xFFFFFFFF


def race_uniforms(keys: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[n, num_tokens]`` float32 uniforms in (0, 1): for row key ``k`` and token ``i``, murmur3's
    32-bit finaliser of ``k ^ (i * 0x9E3779B9)``, its top 24 bits with the lowest set, times 2^-24 (an
    odd multiple of 2^-24, exact in float32, never 1) (``sampling.c``'s ``race_uniform``, in int64 ops
    masked to 32 bits)."""
    index = torch.arange(num_tokens, device=keys.device, dtype=torch.int64)
    x = (keys.to(torch.int64).unsqueeze(1) & _MASK32) ^ ((index * 0x9E3779B9) & _MASK32)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    x = x ^ (x >> 16)
    return ((x >> 8) | 1).to(torch.float32) * 2.0**-24


class TorchSamplingOps:
    """The references, on any device: one sort of every row for ``thresholds``."""

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.max(dim=-1).indices

    def thresholds(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor:
        """``logits`` and ``weights`` ``[n, V]``; ``top_k`` int64 ``[n]``; ``top_p`` ``[n]`` -> ``[n]``
        float32 (the module's docstring has the rule)."""
        vocab_size = logits.shape[1]
        values, order = logits.sort(dim=-1, descending=True)
        k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size).unsqueeze(1)
        kth = values.gather(1, k - 1)
        in_k = values >= kth
        mass = weights.gather(1, order).to(torch.float64) * in_k
        kept_mass = mass.sum(dim=-1, keepdim=True)
        # the mass before a token in the sorted row: strictly above it for the first of its ties, so
        # the smallest value kept is the rule's (the cut keeps every tie of a value it keeps)
        above = mass.cumsum(dim=-1) - mass
        keep = in_k & (above < top_p.to(torch.float64).unsqueeze(1) * kept_mass)
        cut = torch.where(keep, values, float("inf")).amin(dim=-1)
        cut = torch.where(top_p >= 1.0, kth.squeeze(1), cut)
        return torch.where((top_k > 0) & (top_k < vocab_size) | (top_p < 1.0), cut, float("-inf"))

    def truncate(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> None:
        cut = self.thresholds(logits, weights, top_k, top_p)
        weights.masked_fill_(logits < cut.unsqueeze(1), 0.0)

    def race(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``weights`` ``[n, V]`` (non-negative, unnormalised), ``keys`` int64 ``[n]`` -> ``[n]``."""
        noise = race_uniforms(keys, weights.shape[1]).log_().neg_()
        return self.argmax(weights / noise)


TORCH_SAMPLING = TorchSamplingOps()
