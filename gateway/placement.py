"""Where one request runs, decided once, and its prompts as that model's token ids.

    Gateway.place (the degradation policy, asked once) ─▶ primary: tokenized for it
        ─▶ fallback: can it run the prompts as they are?  yes: the fallback   no: the primary

The policy is asked before anything is tokenized: which tokenizer runs depends on its answer.
"""

from __future__ import annotations

from gateway.endpoint import Prompts
from gateway.state import Gateway, Placement
from wire.tier import Tier


async def place_prompts(
    gateway: Gateway, model: str, tier: Tier, prompts: Prompts, *, seats: int
) -> tuple[Placement, list[list[int]]]:
    """The placement of a request for ``model`` and its prompts tokenized for the model it runs on.

    The policy's fallback is kept only if it can run the prompts as they are: token ids the client sent
    need the tokenizer that made them (the primary's), and the longest prompt needs a ready fallback
    worker with room for it (one gone since the policy looked fails the same check). Otherwise the
    request runs on its primary. Prompts are tokenized twice only for a refused fallback whose
    tokenizer is not the primary's: measuring them for it took its tokens.
    """
    proposed = gateway.place(model, tier, seats=seats)
    primary_builder = gateway.builder(model)
    if not proposed.is_degraded:
        return proposed, _kept(gateway, prompts, model, await prompts.tokenize(primary_builder))
    primary = Placement(model, model)
    builder = gateway.builder(proposed.model)
    is_same_tokenizer = builder is primary_builder
    if prompts.has_token_ids and not is_same_tokenizer:
        return primary, _kept(gateway, prompts, model, await prompts.tokenize(primary_builder))
    tokens = await prompts.tokenize(builder)
    prompt_ids = _kept(gateway, prompts, proposed.model, tokens)
    if gateway.fits(proposed.model, max(len(p) for p in prompt_ids)):
        return proposed, prompt_ids
    if not is_same_tokenizer:
        tokens = await prompts.tokenize(primary_builder)
    return primary, _kept(gateway, prompts, model, tokens)


def _kept(gateway: Gateway, prompts: Prompts, model: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The prompts as ``model`` runs them: truncated where the request asks (vLLM's
    ``truncate_prompt_tokens``; -1 against the longest context of the model's workers)."""
    if prompts.keep_last is None:
        return prompt_ids
    return prompts.truncated(prompt_ids, gateway.longest_context(model))
