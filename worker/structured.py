"""Structured outputs in the worker: grammars compiled off the engine loop, one matcher per request.

    add_request ─▶ GrammarCompiler.submit (its own thread; a cache keyed by the grammar) ─▶ Future
    engine step ─▶ ready requests enter the scheduler, each with its own Matcher
    each sample ─▶ Matcher.fill (the next-token mask, into the sampler's row) ─▶ Matcher.accept

The grammar engine is llguidance (wire/grammar.py says why): its tokenizer is built once per engine
from the Hugging Face fast tokenizer, in the compile thread (about a second), and each compiled
grammar is kept (up to ``MAX_CACHED``) as a fresh matcher that every request copies, so an agent's
schema is compiled once. A grammar that fails here (the gateway checked it, so rarely) ends its
request with an error naming the field; it never stalls the loop or other requests.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import torch

from wire.byte_tokenizer import ByteTokenizer, hf_tokenizer_json
from wire.grammar import LIMITS, check
from wire.structured import StructuredOutput

log = logging.getLogger(__name__)

MAX_CACHED = 256


class GrammarError(Exception):
    """A structured output the grammar engine refused for this model (``field``: the request's)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Matcher:
    """One request's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into ``words`` (int32, contiguous, on the CPU)."""
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar did not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """The grammar is complete and allows nothing more (the answer ends here)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class GrammarCompiler:
    """Compiles structured outputs for one engine's tokenizer on one background thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str | None], llguidance.LLMatcher] = OrderedDict()

    @property
    def num_words(self) -> int:
        """int32 words in one row of the mask."""
        return (self.vocab_size + 31) // 32

    def submit(self, structured: StructuredOutput) -> Future[Matcher]:
        return self._pool.submit(self._matcher, structured)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _matcher(self, structured: StructuredOutput) -> Matcher:
        key = structured.grammar_key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._compile(structured)
            with self._lock:
                self._cache[key] = template
                if len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
        return Matcher(template.deep_copy())

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = check(structured)
        except Exception as exc:  # InvalidRequestError: the gateway would have refused it
            raise GrammarError(structured.field, str(exc)) from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(structured.field, matcher.get_error())
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            eos = self._eos or None
            try:
                if isinstance(self._hf_tokenizer, ByteTokenizer):  # the mock model's
                    self._tokenizer = llguidance.LLTokenizer(
                        hf_tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos
                    )
                else:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                    )
            except ValueError as exc:
                raise GrammarError("structured_outputs", f"not available for this model: {exc}") from None
            log.info("structured outputs: grammar tokenizer ready (%d tokens)", self.vocab_size)
        return self._tokenizer


class GrammarQueue:
    """One engine's structured-output requests whose grammar is compiling (``submit``), handed back
    done in submission order (``take_ready``). The compiler starts on the first grammar: llguidance's
    tokenizer takes about a second to build, and most engines never need it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._pending: dict[str, Future[Matcher]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        return self._compiler

    @property
    def num_words(self) -> int:
        """int32 words in one row of the mask."""
        return self.compiler.num_words

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, structured: StructuredOutput) -> None:
        self._pending[request_id] = self.compiler.submit(structured)

    def cancel(self, request_id: str) -> bool:
        """Forget a request still compiling; False when it is not."""
        future = self._pending.pop(request_id, None)
        if future is None:
            return False
        future.cancel()
        return True

    def take_ready(self) -> list[tuple[str, Matcher | GrammarError]]:
        """The requests whose grammar is done, in submission order: its matcher, or why it failed."""
        done: list[tuple[str, Matcher | GrammarError]] = []
        for request_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                done.append((request_id, future.result()))
            except GrammarError as exc:
                done.append((request_id, exc))
        return done

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
