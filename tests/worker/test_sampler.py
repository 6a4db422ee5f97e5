"""Sampler: greedy parity, seeded reproducibility, truncation, penalties, logprobs, distribution."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu.build import KernelBuildError
from kernels.cpu.sampling import load_sampling_kernels
from kernels.sampling import TORCH_SAMPLING, SamplingOps
from wire.sampling import SamplingParams
from worker.sampler import (
    Sampler,
    SamplingRow,
    TokenLogprobs,
    apply_allowed,
    apply_penalties,
    make_generator,
)

VOCAB = 64


@pytest.fixture(scope="module", autouse=True, params=["torch", "c"])
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SamplingOps]:
    """Every ``Sampler()`` of this module runs over each implementation of the row operations: the torch
    references and the C kernels (the runner's on CPU)."""
    if request.param == "torch":
        chosen: SamplingOps = TORCH_SAMPLING
    else:
        try:
            chosen = load_sampling_kernels(tmp_path_factory.mktemp("kernels"))
        except KernelBuildError as exc:
            pytest.skip(f"no C kernels: {exc}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Sampler.__init__, "__defaults__", (chosen,))
        yield chosen


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params, prompt, output, make_generator(params.seed))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equals_argmax() -> None:
    logits = random_logits(8)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.logprobs == [None] * 8


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(2, 300), st.integers(0, 2**31 - 1))
def test_our_argmax_is_torch_s_on_ties_nan_and_inf(num_rows: int, vocab: int, seed: int) -> None:
    # A handful of values, so that rows tie often; some NaN and infinities.
    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")])
    weights = torch.tensor([8.0, 8.0, 4.0, 1.0, 1.0, 0.5])
    index = torch.multinomial(weights, num_rows * vocab, replacement=True, generator=generator)
    scores = values[index].view(num_rows, vocab)
    assert TORCH_SAMPLING.argmax(scores).tolist() == torch.argmax(scores, dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_equal_argmax() -> None:
    logits = random_logits(6, seed=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    params[4] = SamplingParams(temperature=0.0, logprobs=2)
    out = Sampler()(logits, [row(p) for p in params])
    expected = torch.argmax(logits, dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = random_logits(2)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1, repetition_penalty=1.5)
    Sampler()(logits, [row(params, prompt=[1, 2, 3], output=[4]), row(params)])
    assert torch.equal(logits, before)


def sample_steps(logits: torch.Tensor, rows: list[SamplingRow], index: int, num_steps: int) -> list[int]:
    sampler = Sampler()
    return [sampler(logits, rows).token_ids[index] for _ in range(num_steps)]


def test_seeded_sampling_is_reproducible() -> None:
    logits = random_logits(1, seed=2)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_steps(logits, [row(params)], 0, 20)
    second = sample_steps(logits, [row(params)], 0, 20)
    assert first == second
    assert len(set(first)) > 1  # it really samples, the test would pass trivially otherwise
    other = sample_steps(logits, [row(SamplingParams(temperature=1.0, seed=4321))], 0, 20)
    assert other != first


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.01, seed=7, presence_penalty=0.5),
    ],
)
def test_seeded_row_is_independent_of_batch_composition(params: SamplingParams) -> None:
    logits = random_logits(5, seed=3)
    alone = sample_steps(logits[2:3], [row(params, output=[1, 2])], 0, 20)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, seed=99, top_p=0.3),
        SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=3),
    ]
    rows = [row(p, prompt=[5, 6], output=[7]) for p in neighbours]
    rows.insert(2, row(params, output=[1, 2]))
    in_batch = sample_steps(logits, rows, 2, 20)
    assert in_batch == alone


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(16, seed=4)
    rows = [row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = random_logits(16, seed=5)
    rows = [row(SamplingParams(temperature=1.0, top_p=1e-6)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    torch.manual_seed(0)
    logits = random_logits(1, seed=6).expand(500, VOCAB).contiguous()
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = set(Sampler()(logits, [row(SamplingParams(temperature=5.0, top_k=3))] * 500).token_ids)
    assert drawn == top3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4).contiguous()
    # 0.5 + 0.3 = 0.8 reaches 0.75; 0.5 alone does not.
    drawn = Sampler()(logits, [row(SamplingParams(top_p=0.75))] * 2000).token_ids
    assert set(drawn) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(2000, 4).contiguous()
    # The cut is 0.6 * 0.4 = 0.24: tokens 0 and 1 survive.
    drawn = Sampler()(logits, [row(SamplingParams(min_p=0.6))] * 2000).token_ids
    assert set(drawn) == {0, 1}


def test_repetition_penalty_matches_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0)
    # Token 0 is in the prompt, 1 and 3 in the output; 2 and 4 were never seen.
    out = apply_penalties(logits, [row(params, prompt=[0, 0], output=[1, 3])])
    assert out.tolist() == [[1.0, -2.0, 0.5, 0.0, 3.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [row(params, prompt=[0, 4, 4], output=[1, 1, 1, 2])])
    # Token 1: -1 - 0.5 - 3 * 0.25; token 2: 0.5 - 0.5 - 0.25; prompt-only tokens 0 and 4 untouched.
    assert out.tolist() == [[2.0, -2.25, -0.25, 0.0, 3.0]]


def test_all_penalties_combined_and_only_on_their_rows() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [2.0, -1.0, 0.5, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    rows = [row(params, prompt=[0], output=[2, 2]), row(SamplingParams(), prompt=[0], output=[2, 2])]
    out = apply_penalties(logits, rows)
    # Repetition first (0: 2 -> 1, 2: 0.5 -> 0.25), then 2: 0.25 - 1 - 2 * 0.5.
    assert out.tolist() == [[1.0, -1.0, -1.75, 0.0], [2.0, -1.0, 0.5, 0.0]]


def test_penalties_equal_the_dense_computation_over_random_histories() -> None:
    """The sparse update (only the logits of seen tokens) against the whole-row formula, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, VOCAB, generator=gen) * 4
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: untouched
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=1.5),
    ]
    histories = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (30, 5, 80, 0, 12, 50, 7, 20)]
    rows = [row(p, prompt=histories[2 * i], output=histories[2 * i + 1]) for i, p in enumerate(params)]
    expected = logits.clone()
    for i, p in enumerate(params):
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[histories[2 * i] + histories[2 * i + 1]] = True
        x = logits[i]
        x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
        counts = torch.zeros(VOCAB).index_add_(0, torch.tensor(histories[2 * i + 1], dtype=torch.long),
                                               torch.ones(len(histories[2 * i + 1])))  # fmt: skip
        expected[i] = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    assert torch.equal(apply_penalties(logits, rows), expected)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler()(logits, [row(params, output=[0])]).token_ids == [1]
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0), output=[0])]).token_ids == [0]


def test_logprobs_are_log_softmax_of_penalized_logits() -> None:
    logits = random_logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.3, top_k=2, logprobs=0, seed=1),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=3),
    ]
    rows = [row(params[0]), row(params[1]), row(params[2], output=[0, 0, 5])]
    out = Sampler()(logits, rows)
    expected = apply_penalties(logits, rows).log_softmax(dim=-1)
    for i, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert isinstance(logprob, TokenLogprobs)
        assert logprob.token_id == token_id
        assert logprob.logprob == pytest.approx(expected[i, token_id].item(), abs=1e-6)
        n = params[i].logprobs or 0
        values, ids = expected[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in logprob.top] == ids.tolist()
        assert [v for _, v in logprob.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[1] is not None and out.logprobs[1].top == []
    # Temperature does not leak into logprobs: row 1's chosen logprob is the untempered one.
    assert out.logprobs[1].logprob == pytest.approx(
        logits[1].log_softmax(-1)[out.token_ids[1]].item(), abs=1e-6
    )


def test_rows_without_logprobs_get_none() -> None:
    logits = random_logits(2)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=1)), row(SamplingParams())])
    assert out.logprobs[0] is not None and out.logprobs[1] is None


def empirical(counts: list[int], num_outcomes: int) -> list[float]:
    return [counts.count(i) / len(counts) for i in range(num_outcomes)]


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_empirical_frequencies_match_the_distribution(temperature: float) -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tempered = probs ** (1 / temperature)
    tempered = tempered / tempered.sum()
    num_draws = 40_000
    logits = probs.log().expand(num_draws, 4).contiguous()
    drawn = Sampler()(logits, [row(SamplingParams(temperature=temperature))] * num_draws).token_ids
    for freq, p in zip(empirical(drawn, 4), tempered.tolist(), strict=True):
        # Five standard errors: a sampler that is off by a few percent fails, chance does not.
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / num_draws)


def test_seeded_draws_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor(probs).log().unsqueeze(0)
    sampler = Sampler()
    seeded = row(SamplingParams(seed=2024))
    num_draws = 4000
    drawn = [sampler(logits, [seeded]).token_ids[0] for _ in range(num_draws)]
    for freq, p in zip(empirical(drawn, 4), probs, strict=True):
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / num_draws)


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_logit_bias_bans_and_forces_tokens_in_its_own_row_only() -> None:
    logits = random_logits(3)
    best = logits.argmax(dim=-1).tolist()
    forced = (best[1] + 7) % VOCAB
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias=((best[0], -100.0),))),  # the best one banned
        row(SamplingParams(temperature=0.0, logit_bias=((forced, 100.0),))),
        row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1])  # the runner-up
    assert out.token_ids[1] == forced
    assert out.token_ids[2] == best[2]  # a row without a bias is untouched by its neighbours'
    # sampled rows see the bias too: a banned token is never drawn, a forced one always is
    banned = SamplingParams(temperature=1.0, seed=3, logit_bias=tuple((t, -100.0) for t in range(VOCAB - 1)))
    assert {Sampler()(logits[:1], [row(banned)]).token_ids[0] for _ in range(5)} == {VOCAB - 1}


def test_logit_bias_shows_in_the_logprobs() -> None:
    logits = torch.zeros(1, VOCAB)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=1, logit_bias=((3, 5.0),)))])
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 3
    assert lp.logprob == pytest.approx(5.0 - math.log(math.exp(5.0) + VOCAB - 1), abs=1e-5)


def test_a_grammar_mask_forbids_exactly_its_clear_bits_and_only_on_its_rows() -> None:
    """``allowed``: bit ``t % 32`` of int32 word ``t // 32`` for token ``t`` (llguidance's layout);
    checked against a plain per-token unpacking, with a vocabulary that is not a multiple of 32."""
    vocab = 1000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    words = torch.randint(
        -(2**31), 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=generator
    )
    params = SamplingParams(max_tokens=4, temperature=0.0)
    rows = [SamplingRow(params, [1], [], None, words[0]), SamplingRow(params, [1], [], None),
            SamplingRow(params, [1], [], None, words[1])]  # fmt: skip
    out = apply_allowed(logits, rows)
    for row, mask in ((0, words[0]), (2, words[1])):
        allowed = torch.tensor([(int(mask[t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)])
        assert torch.equal(torch.isinf(out[row]), ~allowed)
        assert torch.equal(out[row][allowed], logits[row][allowed])
    assert torch.equal(out[1], logits[1]) and not torch.isinf(logits).any()  # the input untouched
    picked = Sampler()(logits, rows).token_ids
    for row, mask in ((0, words[0]), (2, words[1])):
        assert (int(mask[picked[row] // 32]) >> (picked[row] % 32)) & 1


def test_banned_tokens_are_never_picked_greedy_or_sampled_and_count_in_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0, logprobs=0)
    rows = [
        SamplingRow(greedy, [], [], None, banned=(best[0],)),
        SamplingRow(SamplingParams(temperature=1.0, top_k=1), [], [], None, banned=(best[1], 7)),
        SamplingRow(greedy, [], [], None),  # no ban: its best
    ]
    out = Sampler()(logits, rows)
    second = logits[0].clone()
    second[best[0]] = float("-inf")
    assert out.token_ids[0] == int(second.argmax()) and out.token_ids[1] not in (best[1], 7)
    assert out.token_ids[2] == best[2]
    first = out.logprobs[0]
    assert first is not None and first.logprob == pytest.approx(
        float(second.log_softmax(-1)[out.token_ids[0]])
    )


def test_allowed_token_ids_limit_every_row_that_names_them() -> None:
    """vLLM's ``allowed_token_ids``: greedy picks the best allowed token, a sampled row draws only
    allowed ones, logprobs are over the allowed tokens; a row without the field is untouched."""
    logits = random_logits(3, seed=4)
    best = logits.argmax(dim=-1).tolist()
    allowed = tuple(t for t in (3, 11, 29, 40) if t != best[0])
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=allowed)),
        row(SamplingParams(temperature=1.0, seed=1, allowed_token_ids=allowed)),
        row(SamplingParams(temperature=0.0)),
    ]
    draws = [Sampler()(logits, rows) for _ in range(20)]
    within = logits[0, list(allowed)]
    assert draws[0].token_ids[0] == allowed[int(within.argmax())]
    assert all(d.token_ids[1] in allowed for d in draws) and draws[0].token_ids[2] == best[2]
    first = draws[0].logprobs[0]
    assert first is not None and first.logprob == pytest.approx(float(within.log_softmax(-1).max()))
    assert {t for t, _ in first.top} <= set(allowed)
