"""``tierserve serve`` with a pool whose path is a GGUF file (the embedded model's own Q4_1 file, its
blocks served natively), driven by the official openai client: the served text is the in-process
engine's on the same file, and concurrent streams each get what they get alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loadtest.launch import running_server
from wire.sampling import SamplingParams
from worker.models.store import cache_root, default_model_dir, is_pulled

GGUF = cache_root() / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # kept by `models pull`
POOL = "smollm2-q4_1"
MAX_TOKENS = 32
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sea salty?", "Hi!"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.isa,  # the quantized kernels follow the CPU probe: both paths
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not (is_pulled(default_model_dir()) and GGUF.is_file()), reason="run `tierserve models pull`"
    ),
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve-gguf")
    config = tmp / "tierserve.toml"
    config.write_text(f'[[models.pools]]\nname = "{POOL}"\npath = "{GGUF}"\nkv_cache_gb = 0.5\n')
    with running_server(["--config", str(config)], tmp / "serve.log", ready_timeout_s=300) as server:
        yield server.base_url


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def engine_texts(questions: list[str]) -> list[str]:
    """The in-process engine on the same file, one request at a time."""
    from gateway.tokenizer import HFPromptBuilder
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.models.store import resolve_model

    folder: Path = resolve_model(str(GGUF))
    engine = Engine.from_config(EngineConfig(model=str(GGUF)))
    builder = HFPromptBuilder(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [
        engine.generate([builder.chat_ids([{"role": "user", "content": q}])], params)[0].text
        for q in questions
    ]


def test_the_pool_serves_the_files_blocks_as_the_engine_does(base_url: str) -> None:
    with client(base_url) as c:
        assert [m.id for m in c.models.list()] == [POOL]
        texts = [
            c.chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .message.content
            for q in QUESTIONS[:2]
        ]
    assert all(texts), texts
    assert texts == engine_texts(QUESTIONS[:2])


def test_concurrent_streams_each_get_what_they_get_alone(base_url: str) -> None:
    with client(base_url) as c:
        alone = [
            c.chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .message.content
            for q in QUESTIONS
        ]

    async def stream(c: openai.AsyncOpenAI, question: str) -> str:
        response = await c.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True,
        )  # fmt: skip
        parts = [chunk.choices[0].delta.content or "" async for chunk in response if chunk.choices]
        return "".join(parts)

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300) as c:
            return list(await asyncio.gather(*(stream(c, q) for q in QUESTIONS)))

    assert asyncio.run(together()) == alone


def test_the_layer_errors_measured_at_load_are_exported(base_url: str) -> None:
    from loadtest.failover_bench import metric, scrape

    text = scrape(base_url)
    layers = {
        line.split('layer="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("tierserve_quant_layer_error{")
    }
    assert len(layers) == 30 * 4 + 1 and "lm_head" in layers  # SmolLM2: 30 layers' four linears, the logits
    error = metric(text, "tierserve_quant_layer_error", layer="layers.12.qkv_proj")
    assert 0 < error < 1e-3  # x in int16 blocks: the arithmetic is all that differs from the weights
