"""The engine loop: one step = schedule → execute → sample → detokenize → emit.

The engine is the only owner of the loop and of per-request state; it is driven from the
outside (``step()``), by the worker daemon or by ``generate()`` in-process.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wire.errors import InvalidRequestError
from wire.prompt import check_prompt
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine_loader import load_model
from worker.kv_cache import KVCacheManager
from worker.model_runner import StepRunner
from worker.models.config import ModelConfig
from worker.outputs import Completion, RequestOutput
from worker.policy_set import WorkerPolicies
from worker.prompt_logprobs import ScoreSpan
from worker.request import FinishReason, Request, TierRef
from worker.request_state import RequestState
from worker.sampler import Sampler, SamplingRow, TokenLogprobs, make_generator, token_logprobs
from worker.scheduler import Scheduler, SchedulerConfig
from worker.structured import GrammarError, GrammarQueue
from worker.tracing import NULL_OBSERVER, NullObserver

log = logging.getLogger(__name__)

Scored = tuple[int, list[TokenLogprobs]]  # a scored prompt's logprobs of one step: the first's position, them


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_evictions: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int


class Engine:
    """Owns the loop and per-request state; the runner it drives may be real or simulated."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        runner: StepRunner,
        model_config: ModelConfig,
        num_kv_blocks: int,
        policies: WorkerPolicies | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.model_config = model_config
        self.max_model_len = config.context_limit(model_config.max_position_embeddings)
        self.policies = policies or WorkerPolicies.baseline()
        self.kv_cache = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, self.policies.eviction
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.kv_cache, self.policies
        )
        self.sampler = Sampler(runner.sampling)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | _tokenizer_eos(tokenizer)
        self._states: dict[str, RequestState] = {}
        # Structured outputs: grammars compile on their own thread; a request enters the scheduler
        # once its grammar is ready (worker/structured.py).
        self.grammars = GrammarQueue(tokenizer, model_config.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        # Each quantized linear's output error against its exact weight, measured at load (quant_check)
        self.quant_layer_errors: dict[str, float] = {}
        # Told what each step did, for traces (worker/tracing.py); the null one does nothing at all.
        self.observer: NullObserver = NULL_OBSERVER

    @classmethod
    def from_config(cls, config: EngineConfig, policies: WorkerPolicies | None = None) -> Engine:
        """Load the model named by ``config.model`` (a folder, or the embedded default) and its
        tokenizer (worker/engine_loader.py)."""
        loaded = load_model(config)
        tokenizer, runner = loaded.tokenizer, loaded.runner
        engine = cls(loaded.config, tokenizer, runner, loaded.model_config, loaded.num_kv_blocks, policies)
        engine.quant_layer_errors = loaded.quant_layer_errors
        return engine

    # ---- requests in -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tier: TierRef | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
        seen_token_ids: Sequence[int] = (),
        owner: object = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises :class:`InvalidRequestError` naming the bad field.

        ``seen_token_ids``: the last tokens of ``prompt`` that the client has already received as output
        (a request resumed after a failover; ``RequestState.begin`` brings the detokenizer to where it
        stood after them).

        ``arrival_time``: when the client's request arrived, on ``time.monotonic``'s clock (None:
        now); the request's TTFT deadline counts from it.
        """
        prompt_ids = (
            self.tokenizer.encode(prompt, add_special_tokens=False)
            if isinstance(prompt, str)
            else list(prompt)
        )
        vocab = self.model_config.vocab_size
        check_prompt(prompt_ids, vocab_size=vocab, max_model_len=self.max_model_len)
        params.validate(vocab_size=vocab, max_model_len=self.max_model_len, num_prompt_tokens=len(prompt_ids))
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        request = Request(
            request_id,
            prompt_ids,
            params,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            tier=tier or TierRef(),
            cache_salt=cache_salt,
            tenant=tenant,
            priority=priority,
            num_resumed=len(seen_token_ids),
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        try:
            self.scheduler.check(request)
        except ValueError as exc:
            raise InvalidRequestError("max_tokens", str(exc)) from None
        if request.num_resumed and (
            request.outputs_from < 1 or request.resumed_token_ids != list(seen_token_ids)
        ):
            raise InvalidRequestError(
                "resumed_token_ids", "must be the tail of the prompt, after at least one token"
            )
        generator = make_generator(params.seed, self.runner.device)
        self._states[request_id] = RequestState.begin(request, self.tokenizer, generator, owner)
        if params.structured is None:
            self.scheduler.add(request)
        else:
            self.grammars.submit(request_id, params.structured)
        return request_id

    def _take_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready enter the scheduler (having consumed the output a resumed
        request already has); those whose grammar failed end with the error."""
        failed = []
        for request_id, matcher in self.grammars.take_ready():
            state = self._states[request_id]
            request = state.request
            if isinstance(matcher, GrammarError):
                failed.append(self._finish(request, FinishReason.ERROR, error=str(matcher)))
                continue
            if not all(matcher.accept(t) for t in request.resumed_token_ids):
                failed.append(self._finish(request, FinishReason.ERROR, error="structured output: the "
                                           "resumed tokens do not match the grammar"))  # fmt: skip
                continue
            state.matcher = matcher
            self.scheduler.add(request)
        return failed

    # ---- the live requests (one registry: the engine's) ----------------------------------------

    def owner(self, request_id: str) -> object:
        """What was attached to a live request at ``add_request`` (None: not live, or nothing)."""
        state = self._states.get(request_id)
        return None if state is None else state.owner

    def owners(self) -> list[tuple[str, object]]:
        """Every live request and its owner, in arrival order."""
        return [(request_id, state.owner) for request_id, state in self._states.items()]

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (its grammar still compiling included: the observer hears of
        it either way); its blocks go back to the pool. False if unknown."""
        self.observer.on_abort(request_id)
        if self.grammars.cancel(request_id):
            return self._states.pop(request_id, None) is not None
        self._states.pop(request_id, None)
        return self.scheduler.finish(request_id, FinishReason.ABORT) is not None

    def end(self, request_id: str, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Take a request out wherever it is (its blocks freed) and return its final output: no new
        tokens, ``reason``, the usage it had (zeros for an id the engine does not know)."""
        request = self.scheduler.requests.get(request_id)
        self.observer.on_abort(request_id)
        self.grammars.cancel(request_id)
        if request is not None:
            return self._finish(request, reason, error)
        state = self._states.pop(request_id, None)  # its grammar still compiling, or unknown
        if state is None:
            return RequestOutput(request_id, [], "", reason, error=error)
        return _output(state.request, state.owner, reason=reason, error=error)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.grammars)

    def stats(self) -> EngineStats:
        """The counters a worker reports in its heartbeats."""
        kv, scheduler = self.kv_cache, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.pool.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_evictions=kv.pool.num_evictions,
            num_prefix_query_tokens=kv.num_prefix_queries,
            num_prefix_hit_tokens=kv.num_prefix_hits,
        )

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduled step: the runner computes it, the scheduler advances, the sampled tokens are
        processed; what each request got (finished ones included)."""
        start = time.perf_counter()
        failed = self._take_compiled() if self.grammars else []
        out = self.scheduler.schedule()
        if out.is_empty:
            if failed or not self.grammars:
                return failed
            time.sleep(0.001)  # only grammars compiling: wait for them without spinning a core
            return []
        self.observer.on_schedule(out)
        try:
            requests, logits = self.runner.execute(out)
        except Exception:
            # Our mistake: fail this step's requests, keep the engine alive for everyone else.
            log.exception("model step failed for %s", list(out.num_scheduled_tokens))
            failed = [self._finish(r, FinishReason.ERROR, error="internal error") for r in out.scheduled]
            self.observer.on_step_done(out, failed)
            return failed
        self.scheduler.postprocess(out)  # the runner's requests are those it returns, in its order
        scores = self._score(out.score_spans, logits[len(requests) :]) if out.score_spans else {}
        outputs = self._sample(requests, logits[: len(requests)], scores) if requests else []
        for request_id, scored in scores.items():  # scored prompts not yet sampling: their logprobs alone
            state = self._states[request_id]
            outputs.append(_output(state.request, state.owner, scored=scored))
        # The whole step, as a stream sees it between two tokens: what the budget policy learns from.
        self.scheduler.report_step(out, (time.perf_counter() - start) * 1e3)
        self.observer.on_step_done(out, outputs)
        return failed + outputs

    def _score(self, spans: list[ScoreSpan], logits: torch.Tensor) -> dict[str, Scored]:
        """The scored prompts' logprobs of this step (rows in ``spans`` order), less those already sent."""
        scores: dict[str, Scored] = {}
        row = 0
        for span in spans:
            request = span.request
            num_top = request.sampling_params.prompt_logprobs or 0
            entries = token_logprobs(logits[row : row + span.num_rows], span.targets, num_top)
            row += span.num_rows
            position, fresh = self._states[request.request_id].scored(span.first_position, entries)
            if fresh:
                scores[request.request_id] = (position, fresh)
        return scores

    def _sample(
        self, requests: list[Request], logits: torch.Tensor, scores: dict[str, Scored]
    ) -> list[RequestOutput]:
        """Each request's next token, with its prompt's logprobs of this step where it was scored
        (taken out of ``scores``); a request that may generate nothing (``max_tokens`` 0: its prompt
        scored) ends instead."""
        ended = [
            self._finish(r, FinishReason.LENGTH, scored=scores.pop(r.request_id, None))
            for r in requests
            if r.sampling_params.max_tokens == 0
        ]
        if ended:
            keep = [i for i, r in enumerate(requests) if r.sampling_params.max_tokens > 0]
            requests, logits = [requests[i] for i in keep], logits[keep]
            if not requests:
                return ended
        states = [self._states[r.request_id] for r in requests]
        rows = [
            SamplingRow(r.sampling_params, *_penalty_tokens(r), s.generator, banned=s.banned)
            for r, s in zip(requests, states, strict=True)
        ]
        constrained = [(row, s.matcher) for row, s in zip(rows, states, strict=True) if s.matcher is not None]
        if constrained:
            masks = torch.empty(len(constrained), self.grammars.num_words, dtype=torch.int32)
            for (row, matcher), words in zip(constrained, masks, strict=True):
                matcher.fill(words)
                row.allowed = words
        sampled = self.sampler(logits, rows)
        picks = zip(states, sampled.token_ids, sampled.logprobs, strict=True)
        return ended + [
            self._process_token(state, token_id, token_logprobs, scores.pop(state.request.request_id, None))
            for state, token_id, token_logprobs in picks
        ]

    def _process_token(
        self, state: RequestState, token_id: int, logprobs: TokenLogprobs | None, scored: Scored | None = None
    ) -> RequestOutput:
        request = state.request
        effect = state.take(token_id, self.max_model_len)
        if effect.error is not None:
            return self._finish(request, FinishReason.ERROR, error=effect.error)
        output = _output(
            request,
            state.owner,
            [token_id],
            effect.text,
            effect.reason,
            [logprobs] if logprobs is not None else [],
            scored=scored,
            stop_reason=effect.stop_reason,
        )
        if effect.reason is not None:
            self.scheduler.finish(request.request_id, effect.reason)
            self._states.pop(request.request_id, None)
        return output

    def _finish(
        self, request: Request, reason: FinishReason, error: str | None = None, scored: Scored | None = None
    ) -> RequestOutput:
        self.scheduler.finish(request.request_id, reason)
        state = self._states.pop(request.request_id, None)
        owner = None if state is None else state.owner
        return _output(request, owner, reason=reason, error=error, scored=scored)

    # ---- in-process convenience --------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Run prompts to completion together (continuous batching) and return them in order.

        Requests added earlier through ``add_request`` keep running in the same batches, but their
        outputs during this call are not collected here.
        """
        ids = [self.add_request(p, params) for p in prompts]
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
        done: dict[str, RequestOutput] = {}
        prompt_ids = {i: list(self._states[i].request.prompt_token_ids) for i in ids}
        while len(done) < len(ids):
            for output in self.step():
                if output.request_id not in texts:
                    continue  # someone else's request sharing the batch: theirs to collect via step()
                texts[output.request_id].append(output.text_delta)
                tokens[output.request_id].extend(output.new_token_ids)
                logprobs[output.request_id].extend(output.logprobs)
                prompt_logprobs[output.request_id].extend(output.prompt_logprobs)
                if output.is_finished:
                    done[output.request_id] = output
        return [
            Completion(
                i,
                prompt_ids[i],
                tokens[i],
                "".join(texts[i]),
                _reason(done[i]),
                logprobs[i],
                done[i].num_cached_tokens,
                prompt_logprobs[i],
            )
            for i in ids
        ]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def _reason(output: RequestOutput) -> FinishReason:
    assert output.finish_reason is not None
    return output.finish_reason


def _tokenizer_eos(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([eos])


def _output(
    request: Request,
    owner: object,
    new_token_ids: list[int] | None = None,
    text: str = "",
    reason: FinishReason | None = None,
    logprobs: list[TokenLogprobs] | None = None,
    error: str | None = None,
    scored: Scored | None = None,
    stop_reason: str | int | None = None,
) -> RequestOutput:
    """One step's output for ``request``, its usage as the client counts it: a failover's resumed
    tokens are output the client already had, not prompt. ``scored``: its prompt's logprobs of this
    step (the position of the first, and them)."""
    num_prompt = request.outputs_from
    position, prompt_logprobs = scored if scored is not None else (0, [])
    return RequestOutput(
        request.request_id,
        new_token_ids if new_token_ids is not None else [],
        text,
        reason,
        logprobs if logprobs is not None else [],
        num_prompt,
        request.num_output_tokens + request.num_resumed,
        min(request.num_cached_tokens, num_prompt),
        error,
        owner,
        prompt_logprobs,
        position,
        stop_reason,
    )


def _penalty_tokens(request: Request) -> tuple[Sequence[int], Sequence[int]]:
    """The prompt and the output a request's penalties see: a failover's resumed tokens are output."""
    if not request.num_resumed:
        return request.prompt_token_ids, request.output_token_ids
    tokens, cut = request.all_token_ids, request.outputs_from
    return tokens[:cut], tokens[cut:]


__all__ = ["Engine", "EngineConfig", "ModelConfig"]
