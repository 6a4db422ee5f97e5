"""Span and attribute names: the OpenTelemetry semantic conventions we follow, and ours.

GenAI: https://opentelemetry.io/docs/specs/semconv/gen-ai/ (``gen_ai.*``); HTTP server spans:
https://opentelemetry.io/docs/specs/semconv/http/http-spans/. Ours are ``tierserve.*``. Text (prompts,
completions) is never an attribute unless ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` is true.
"""

from __future__ import annotations

# ---- span names ------------------------------------------------------------------------------
CLASSIFY = "tierserve.classify"  # identity, tier, placement, tokenization, context class
ADMISSION = "tierserve.admission"  # the gateway's per-tier queue (429 when shed)
DISPATCH = "tierserve.dispatch"  # one choice's Submit: the worker's spans are its children
ROUTE = "tierserve.route"  # under dispatch: the routing policy's choice and the scores it weighed
WORKER_REQUEST = "tierserve.worker.request"  # one Submit on a worker, Submit → last token
WORKER_QUEUE = "tierserve.worker.queue"  # Submit → first scheduled (time in the worker's queue)
WORKER_PREFILL = "tierserve.worker.prefill"  # one prefill chunk (one step)
WORKER_DECODE = "tierserve.worker.decode"  # first token → finish; events, never a span per token
WORKER_FINISH = "tierserve.worker.finish"  # the finish: reason and counts

# ---- events on the decode span ---------------------------------------------------------------
EVENT_PREEMPTED = "tierserve.preempted"
EVENT_RESUMED = "tierserve.resumed"
EVENT_TOKENS = "tierserve.tokens"  # every TOKENS_EVENT_INTERVAL output tokens
TOKENS_EVENT_INTERVAL = 64

# ---- GenAI semantic conventions --------------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # opt-in only
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"  # opt-in only

# ---- ours ------------------------------------------------------------------------------------
TIER = "tierserve.tier"
CONTEXT_CLASS = "tierserve.context_class"
TENANT = "tierserve.tenant"
WORKER = "tierserve.worker"
QUANT_LAYER = "tierserve.quant.layer"  # on tierserve.quant.layer_error: the module, e.g. layers.3.qkv_proj
CACHED_TOKENS = "tierserve.cached_tokens"
DEGRADED = "tierserve.degraded"
MIGRATIONS = "tierserve.migrations"
# On the dispatch span: what routing weighed (candidates and scores are parallel arrays).
ROUTE_CANDIDATES = "tierserve.route.candidates"
ROUTE_SCORES = "tierserve.route.scores"
ROUTE_CACHED_TOKENS = "tierserve.route.expected_cached_tokens"  # prefix index hit on the chosen worker
TIME_TO_FIRST_TOKEN = "tierserve.time_to_first_token_s"
QUEUE_TIME = "tierserve.queue_time_s"
REQUEST_ID = "tierserve.request_id"
CHOICE_INDEX = "tierserve.choice_index"
SEATS = "tierserve.seats"
PROMPT_TOKENS = "tierserve.prompt_tokens"
CHUNK_TOKENS = "tierserve.chunk_tokens"  # tokens one prefill chunk computed
CHUNK_START = "tierserve.chunk_start"  # tokens already computed before the chunk
PREEMPTIONS = "tierserve.preemptions"
FINISH_REASON = "tierserve.finish_reason"
OUTPUT_TOKENS = "tierserve.output_tokens"
