"""A hand-made ``SeqView`` and Hypothesis strategies for the policy tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from policies.base import SeqView


@dataclass(frozen=True)
class View:
    """A request as a worker policy sees it (satisfies ``SeqView``)."""

    request_id: str
    tier_rank: int = 1
    tier_name: str = "standard"
    tpot_ms: float | None = None
    ttft_deadline: float | None = None
    first_token_time: float | None = None
    tenant: str | None = None
    priority: int = 0
    arrival_time: float = 0.0
    num_prompt_tokens: int = 16
    num_output_tokens: int = 0
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def ids(requests: Sequence[SeqView]) -> list[str]:
    return [r.request_id for r in requests]


@st.composite
def views(draw: st.DrawFn, *, max_size: int = 30) -> list[View]:
    """Requests with unique ids and arbitrary tiers, deadlines (some None), arrivals and progress."""
    n = draw(st.integers(0, max_size))
    times = st.floats(0, 1000, allow_nan=False)
    out = []
    for i in range(n):
        prompt = draw(st.integers(1, 4096))
        output = draw(st.integers(0, 512))
        out.append(
            View(
                request_id=f"r{i}",
                tier_rank=draw(st.integers(0, 3)),
                tpot_ms=draw(st.none() | st.floats(1, 1000)),
                ttft_deadline=draw(st.none() | times),
                first_token_time=draw(st.none() | times) if output else None,
                tenant=draw(st.none() | st.sampled_from(["a", "b", "c"])),
                arrival_time=draw(times),
                num_prompt_tokens=prompt,
                num_output_tokens=output,
                num_computed_tokens=draw(st.integers(0, prompt + output)),
            )
        )
    return out
