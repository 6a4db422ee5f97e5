"""RequestState.take: each stop rule ends a request with its reason and the text it owes; a resumed
request's detokenizer starts where the old worker's stood (``begin``)."""

from __future__ import annotations

from tests.worker.test_detokenizer import byte_level_tokenizer
from wire.sampling import SamplingParams
from worker.request import FinishReason, Request
from worker.request_state import RequestState
from worker.sampler import TokenLogprobs

EOS = 2


def state(params: SamplingParams, prompt: str = "Hello", seen: str = "") -> RequestState:
    tokenizer = byte_level_tokenizer()
    seen_ids = tokenizer.encode(seen, add_special_tokens=False)  # the prompt's tail, already streamed
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) + seen_ids
    eos = frozenset() if params.ignore_eos else frozenset([EOS])
    request = Request("r", prompt_ids, params, eos_token_ids=eos, num_resumed=len(seen_ids))
    return RequestState.begin(request, tokenizer, None, owner="gateway-a")


def feed(s: RequestState, text: str, max_model_len: int = 1000) -> list[tuple[str, FinishReason | None]]:
    tokenizer = byte_level_tokenizer()
    effects = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        effect = s.take(token_id, max_model_len)
        effects.append((effect.text, effect.reason))
        if effect.reason is not None:
            break
    return effects


def test_tokens_go_on_until_max_tokens_then_length_with_the_held_text() -> None:
    s = state(SamplingParams(max_tokens=3, temperature=0.0))
    effects = feed(s, " the quick brown fox")
    assert [reason for _, reason in effects] == [None, None, FinishReason.LENGTH]
    shown = "".join(text for text, _ in effects)
    decoded = byte_level_tokenizer().decode(s.request.output_token_ids)
    assert shown == decoded and s.request.num_output_tokens == 3


def test_the_context_limit_ends_a_request_as_length() -> None:
    s = state(SamplingParams(max_tokens=100, temperature=0.0))
    limit = s.request.num_prompt_tokens + 2
    effects = feed(s, " the quick brown fox", max_model_len=limit)
    assert len(effects) == 2 and effects[-1][1] is FinishReason.LENGTH


def test_eos_stops_counted_but_never_shown_unless_ignored() -> None:
    s = state(SamplingParams(max_tokens=10, temperature=0.0))
    effect = s.take(EOS, 1000)
    assert effect.reason is FinishReason.STOP and effect.error is None
    assert s.request.output_token_ids == [EOS]
    ignoring = state(SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert ignoring.take(EOS, 1000).reason is None


def test_a_stop_string_ends_the_request_and_is_not_shown() -> None:
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["brown"]))
    effects = feed(s, " the quick brown fox")
    assert effects[-1][1] is FinishReason.STOP
    assert "".join(text for text, _ in effects) == " the quick "


def test_include_stop_str_in_output_shows_the_stop_string_and_a_stop_tokens_text() -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends after the stop string that ended it, and a
    stop token's text is shown (a special EOS's is nothing while special tokens are skipped)."""
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["brown"], include_stop_str_in_output=True))
    effects = feed(s, " the quick brown fox")
    assert effects[-1][1] is FinishReason.STOP
    assert "".join(text for text, _ in effects) == " the quick brown"
    comma = byte_level_tokenizer().encode(",", add_special_tokens=False)[0]
    for include, shown in ((True, "hi,"), (False, "hi")):
        params = SamplingParams(
            max_tokens=50, temperature=0.0, stop_token_ids=(comma,), include_stop_str_in_output=include
        )
        s = state(params)
        effects = feed(s, "hi, there")
        assert effects[-1][1] is FinishReason.STOP and "".join(text for text, _ in effects) == shown
    s = state(SamplingParams(max_tokens=50, temperature=0.0, include_stop_str_in_output=True))
    assert feed(s, "ok")[-1][1] is None  # this tokenizer's EOS stand-in is a plain token: its text shows
    assert s.take(EOS, 1000).text == byte_level_tokenizer().decode([EOS]) != ""


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest() -> None:
    """vLLM's ``bad_words``, as token sequences: a one-token word never, a longer one's last token
    only after its other tokens, counted over the output (a failover's resumed tokens included), not
    the prompt."""
    tokenizer = byte_level_tokenizer()
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    params = SamplingParams(max_tokens=50, temperature=0.0, bad_words=((c,), (a, b, a)))
    s = state(params, prompt="ab")  # the prompt ends with "ab": not the output
    assert s.banned == (c,)
    s.take(a, 1000)
    s.take(b, 1000)
    assert s.banned == tuple(sorted((a, c)))
    s.take(c, 1000)
    assert s.banned == (c,)
    resumed = state(params, seen="ab")  # another worker generated "ab"
    assert resumed.banned == tuple(sorted((a, c)))


def test_stop_reason_names_the_stop_string_or_stop_token_not_an_eos() -> None:
    """vLLM's ``stop_reason``: the stop string matched, the stop token id sampled; None for an EOS or a
    length."""
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["brown", "fox"]))
    assert [s.take(t, 1000).stop_reason for t in byte_level_tokenizer().encode(" the brown")][-1] == "brown"
    comma = byte_level_tokenizer().encode(",", add_special_tokens=False)[0]
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(comma, EOS)))
    assert s.take(comma, 1000).stop_reason == comma
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(EOS,)))
    effect = s.take(EOS, 1000)  # an EOS, even one listed as a stop token id
    assert effect.reason is FinishReason.STOP and effect.stop_reason is None
    s = state(SamplingParams(max_tokens=1, temperature=0.0))
    assert s.take(comma, 1000).stop_reason is None


def test_a_resumed_request_shows_only_what_the_client_has_not_seen() -> None:
    """The prompt's tail " the" was already streamed: the next tokens' text follows it, as the old
    worker's would have."""
    fresh = state(SamplingParams(max_tokens=50, temperature=0.0))
    whole = "".join(text for text, _ in feed(fresh, " the quick brown"))
    resumed = state(SamplingParams(max_tokens=50, temperature=0.0), seen=" the")
    rest = "".join(text for text, _ in feed(resumed, " quick brown"))
    assert whole == " the" + rest
    assert resumed.request.resumed_token_ids and resumed.owner == "gateway-a"


def test_a_scored_prompt_recomputed_after_a_preemption_sends_each_position_once() -> None:
    s = state(SamplingParams(max_tokens=0, prompt_logprobs=0), prompt="Hello, world")
    assert s.request.scores_prompt
    entries = [TokenLogprobs(token_id, -1.0, []) for token_id in s.request.prompt_token_ids[1:]]
    assert s.scored(1, entries[:4]) == (1, entries[:4])
    # preempted: the prompt is computed again from its start, its first rows already sent
    assert s.scored(1, entries[:6]) == (5, entries[4:6])
    assert s.scored(7, entries[6:]) == (7, entries[6:])
    assert s.scored(1, entries) == (len(entries) + 1, [])
    s.request.append_output_token(7)
    assert not s.request.scores_prompt  # once it generates, its prompt was scored


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings_until_they_are_out() -> None:
    # stop strings: "the" appears in the 1st to 3rd tokens (not matched), then again after min_tokens
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["the"], min_tokens=5, stop_token_ids=(9,)))
    assert s.banned == (EOS, 9)
    effects = feed(s, "the cat the end")
    assert effects[-1][1] is FinishReason.STOP
    assert "".join(text for text, _ in effects) == "the cat "
    assert s.banned == ()  # five out: EOS and the stop ids may come
    # matched from the min_tokens-th token's text on: "y" + "z" at the 2nd and 3rd is not a match, the
    # 4th and 5th are
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["yz"], min_tokens=3))
    effects = feed(s, "xyzyz")
    assert [reason for _, reason in effects] == [None, None, None, None, FinishReason.STOP]
    assert "".join(text for text, _ in effects) == "xyz"
    # a failover's resumed tokens count as output: two of three out already, stops armed at the third
    s = state(SamplingParams(max_tokens=50, temperature=0.0, stop=["q"], min_tokens=3), seen="ab")
    assert s.num_out == 2 and s.banned == (EOS,)
    assert feed(s, "cq") == [("c", None), ("", FinishReason.STOP)]
