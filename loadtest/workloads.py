"""Seeded, reproducible workloads whose prompts have exact token counts for the target's tokenizer.

    chat           short prompts, varied outputs
    shared-prefix  a few long system prompts, each shared by many users (prefix caching and routing)
    long-context   long prompts, short answers
    mixed-tiers    interactive / standard / batch in a 5:3:2 mix, each with its own length profile;
                   the tier travels in the ``X-SLA-Tier`` header
    interactive-batch  30% interactive, 70% batch (the ``tiers`` benchmark's mix): chat-sized
                   interactive requests beside batch jobs with longer prompts
    dataset        your own JSONL (``--dataset``): {"messages": [...]} or {"prompt": "..."}, optionally
                   "max_tokens" and "tier"; requests cycle through the file in order

Request ``i`` depends only on (workload, seed, i, tokenizer): the same seed gives the same requests on
any run and against any server that uses the same tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from loadtest.prompt_text import PromptTokenizer, fit

Message = dict[str, str]


class Api(Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # OpenAI's Responses API: the chat messages as its input

    @property
    def takes_messages(self) -> bool:
        return self is not Api.COMPLETIONS

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS = {
    Api.CHAT: "/v1/chat/completions",
    Api.COMPLETIONS: "/v1/completions",
    Api.RESPONSES: "/v1/responses",
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    messages: list[Message] | None  # the chat API's body
    prompt: str | None  # the completions API's body
    num_prompt_tokens: int  # measured with the target's tokenizer, chat template included
    max_tokens: int
    tier: str | None  # sent as X-SLA-Tier when set


@dataclass(frozen=True, slots=True)
class Profile:
    """Inclusive token ranges a request's lengths are drawn from (uniformly)."""

    prompt: tuple[int, int]
    output: tuple[int, int]


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    prompt_len: tuple[int, int] | None = None  # overrides every profile's prompt range
    output_len: tuple[int, int] | None = None  # overrides every profile's output range
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 1024  # shared-prefix: tokens of each system prompt
    dataset: Path | None = None
    # Another text for the same lengths (a second run of one workload that must get no prefix hits
    # from the first); "" is the workload's own text.
    text_variant: str = ""


TIER_MIX: dict[str, tuple[float, Profile]] = {
    "interactive": (0.5, Profile((32, 256), (32, 128))),
    "standard": (0.3, Profile((256, 1024), (64, 256))),
    "batch": (0.2, Profile((1024, 2048), (128, 256))),
}
INTERACTIVE_BATCH_MIX: dict[str, tuple[float, Profile]] = {
    "interactive": (0.3, Profile((32, 256), (32, 128))),
    "batch": (0.7, Profile((256, 1024), (64, 256))),
}
MIXES = {"mixed-tiers": TIER_MIX, "interactive-batch": INTERACTIVE_BATCH_MIX}
PROFILES: dict[str, Profile] = {
    "chat": Profile((32, 256), (16, 256)),
    "shared-prefix": Profile((16, 64), (32, 128)),  # the user's part; the prefix comes on top
    "long-context": Profile((2048, 3584), (32, 128)),
}
WORKLOADS = ("chat", "shared-prefix", "long-context", "mixed-tiers", "interactive-batch", "dataset")
SYSTEM_HINT = "You are a helpful assistant."


class Workload:
    """``request(i)`` builds request ``i`` once and keeps it."""

    def __init__(
        self, name: str, tokenizer: PromptTokenizer, api: Api, seed: int, options: WorkloadOptions
    ) -> None:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
        if (name == "dataset") != (options.dataset is not None):
            raise ValueError("--dataset FILE goes with --workload dataset, and only with it")
        self.name, self.tokenizer, self.api, self.seed, self.options = name, tokenizer, api, seed, options
        self._built: dict[int, RequestSpec] = {}
        self._entries = _read_dataset(options.dataset) if options.dataset is not None else []
        self._prefixes: dict[int, str] = {}

    def request(self, index: int) -> RequestSpec:
        spec = self._built.get(index)
        if spec is None:
            spec = self._built[index] = self._build(index)
        return spec

    def _rng(self, index: int, purpose: str) -> random.Random:
        return random.Random(f"{self.name}/{self.seed}/{index}/{purpose}")

    def _build(self, index: int) -> RequestSpec:
        rng = self._rng(index, "lengths")
        if self.name == "dataset":
            return self._from_dataset(index, rng)
        tier: str | None = None
        mix = MIXES.get(self.name)
        if mix is not None:
            names = list(mix)
            tier = rng.choices(names, weights=[mix[n][0] for n in names])[0]
            profile = mix[tier][1]
        else:
            profile = PROFILES[self.name]
        prompt_range = self.options.prompt_len or profile.prompt
        num_out = rng.randint(*(self.options.output_len or profile.output))
        prefix = ""
        if self.name == "shared-prefix":
            prefix = self._prefix(rng.randrange(self.options.num_prefixes))
            target = self._measure(prefix, "") + rng.randint(*prompt_range)
        else:
            target = rng.randint(*prompt_range)
        text_rng_name = f"{self.name}/{self.seed}/{index}/text{self.options.text_variant}"
        free = fit(
            lambda text: self._measure(prefix, text),
            lambda n: self.tokenizer.pieces.text(random.Random(f"{text_rng_name}/{n}"), n),
            target,
            fixed=self._measure(prefix, ""),
        )
        return self._spec(index, prefix, free, num_out, tier)

    def _prefix(self, group: int) -> str:
        """Shared-prefix group ``group``'s system prompt, the same for every request of the group."""
        if group not in self._prefixes:
            rng = random.Random(f"{self.name}/{self.seed}/prefix/{group}")
            body = self.tokenizer.pieces.text(rng, self.options.prefix_len)
            self._prefixes[group] = f"{SYSTEM_HINT} Context {group}:{body}"
        return self._prefixes[group]

    def _messages(self, prefix: str, text: str) -> list[Message]:
        user = {"role": "user", "content": text}
        return [{"role": "system", "content": prefix}, user] if prefix else [user]

    def _measure(self, prefix: str, text: str) -> int:
        builder = self.tokenizer.builder
        if self.api.takes_messages:
            return len(builder.chat_ids(self._messages(prefix, text)))
        return len(builder.text_ids(prefix + text))

    def _spec(self, index: int, prefix: str, text: str, num_out: int, tier: str | None) -> RequestSpec:
        measured = self._measure(prefix, text)
        if self.api.takes_messages:
            return RequestSpec(index, self._messages(prefix, text), None, measured, num_out, tier)
        return RequestSpec(index, None, prefix + text, measured, num_out, tier)

    def _from_dataset(self, index: int, rng: random.Random) -> RequestSpec:
        entry = self._entries[index % len(self._entries)]
        output_range = self.options.output_len or (128, 128)
        given = entry.get("max_tokens")
        num_out = given if isinstance(given, int) and given > 0 else rng.randint(*output_range)
        tier = entry.get("tier")
        tier = tier if isinstance(tier, str) else None
        messages, prompt = _entry_body(entry, index)
        builder = self.tokenizer.builder
        if self.api.takes_messages:
            chat = messages or [{"role": "user", "content": prompt or ""}]
            return RequestSpec(index, chat, None, len(builder.chat_ids(chat)), num_out, tier)
        if prompt is None:
            line = index % len(self._entries) + 1
            raise ValueError(f"dataset entry {line}: the completions API needs 'prompt'")
        return RequestSpec(index, None, prompt, len(builder.text_ids(prompt)), num_out, tier)


def _entry_body(entry: Mapping[str, object], index: int) -> tuple[list[Message] | None, str | None]:
    messages, prompt = entry.get("messages"), entry.get("prompt")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages], None
    if isinstance(prompt, str) and prompt:
        return None, prompt
    raise ValueError(f"dataset entry {index}: needs 'messages' (a list) or 'prompt' (a string)")


def _read_dataset(path: Path) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no requests in the file")
    return entries


def parse_range(text: str) -> tuple[int, int]:
    """ "128" or "64:512" → an inclusive range of positive ints."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range must be 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


DESCRIPTIONS: Mapping[str, str] = {
    "chat": "short prompts, varied outputs",
    "shared-prefix": "a few long system prompts shared by many users",
    "long-context": "long prompts, short answers",
    "mixed-tiers": "interactive/standard/batch 5:3:2, each with its own lengths, X-SLA-Tier per request",
    "interactive-batch": "interactive/batch 3:7 (the tiers benchmark's mix), X-SLA-Tier per request",
    "dataset": "your JSONL file (--dataset)",
}
