"""A GGUF file served from its own blocks: a tiny random Llama written by the gguf package's writer with
its linears in Q4_1 / Q4_0 / Q8_0 and its embedding in Q8_0, loaded through ``resolve_model`` as a pool
path would be, against the same file dequantized by ``models pull``'s converter (the float reference).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoTokenizer

from kernels.quant_format import UnsupportedQuantError
from tests.worker.test_gguf_convert import make_tiny_tokenizer, tiny_model, write_llama_gguf
from tests.worker.test_models_tiny import PagedSequences
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_isa import probe
from worker.engine import Engine
from worker.model_runner import ModelRunner
from worker.models.cpu_decode import CpuDecodeStep
from worker.models.gguf_convert import convert_gguf_to_hf
from worker.models.gguf_model import is_gguf_folder
from worker.models.loader import load_model
from worker.models.quant import (
    QUANTIZATION_KINDS,
    QuantEmbedding,
    QuantLinear,
    quant_isa,
    quantize_linears,
    use_quant_kernels,
)
from worker.models.store import resolve_model

pytestmark = pytest.mark.isa  # the kernel's build follows the CPU probe: run on both paths
Q = gguf.GGMLQuantizationType
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_quantized(path: Path, kind: str, *, is_tied: bool = True) -> Path:
    tokenizer = make_tiny_tokenizer()
    model = tiny_model(tokenizer.get_vocab_size(), is_tied=is_tied)
    types = {f"blk.{i}.{t}.weight": Q[kind.upper()] for i in range(2) for t in LINEARS}
    types["token_embd.weight"] = Q.Q8_0
    write_llama_gguf(path, model, tokenizer, quantize=types)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits_of(model: torch.nn.Module, tokens: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a prefill of A and B, then three decode steps of both): every new token's logits."""
    runner = PagedSequences(model, tokens)  # type: ignore[arg-type]
    prefill = runner.step([("A", 0, 9), ("B", 0, 7)], num_decodes=0)
    decodes = [runner.step([("A", 9 + i, 10 + i), ("B", 7 + i, 8 + i)], num_decodes=2) for i in range(3)]
    return prefill, torch.cat(decodes)


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_quantized_file_serves_its_blocks_and_tracks_the_float_reference(
    kind: str, tmp_path: Path, cache: Path
) -> None:
    path = write_quantized(tmp_path / f"tiny-{kind}.gguf", kind)
    folder = resolve_model(str(path))
    assert is_gguf_folder(folder) and folder.parent == cache / "gguf"
    model, config = load_model(folder, torch.float32)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 + 1 and {m.kind for m in linears[:-1]} == {kind}  # + the tied lm_head
    assert isinstance(model.embed_tokens, QuantEmbedding)

    convert_gguf_to_hf(path, tmp_path / "float", progress=lambda _: None)
    reference, _ = load_model(tmp_path / "float", torch.float32)
    gen = torch.Generator().manual_seed(3)
    tokens = {"A": torch.randint(0, config.vocab_size, (12,), generator=gen).tolist(),
              "B": torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()}  # fmt: skip
    want_prefill, want_decodes = logits_of(reference, tokens)
    spec_prefill, spec_decodes = logits_of(model, tokens)  # the torch spec of the kernel's arithmetic
    for got, want in ((spec_prefill, want_prefill), (spec_decodes, want_decodes)):
        error = float((got - want).norm() / want.norm())
        assert 0 < error < 0.05, error  # x's int8 rounding, as llama.cpp computes: small, not zero

    if use_quant_kernels(model, probe(), cache / ".kernels") == 0:
        pytest.skip("no C kernel here (no compiler or no AVX2): the torch spec was checked")
    assert all(m.weight_q is None for m in linears)  # the packed copy is the only one kept
    got_prefill, got_decodes = logits_of(model, tokens)
    torch.testing.assert_close(got_prefill, spec_prefill, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_decodes, spec_decodes, atol=1e-4, rtol=1e-4)


def test_folder_is_prepared_once_per_file_and_carries_the_tokenizer(tmp_path: Path, cache: Path) -> None:
    path = write_quantized(tmp_path / "tiny.gguf", "q4_1")
    folder = resolve_model(str(path))
    assert resolve_model(str(path)) == folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer.encode("The capital of Italy")) == "The capital of Italy"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>" in chat
    write_quantized(path, "q4_0")  # a new file at the same path: a new folder, not the stale one
    assert resolve_model(str(path)) != folder


def test_untied_output_is_loaded_as_its_own_linear(tmp_path: Path, cache: Path) -> None:
    tokenizer = make_tiny_tokenizer()
    types = {"output.weight": Q.Q4_1, "token_embd.weight": Q.Q8_0}
    write_llama_gguf(tmp_path / "u.gguf", tiny_model(tokenizer.get_vocab_size(), is_tied=False), tokenizer,
                     quantize=types)  # fmt: skip
    model, _ = load_model(resolve_model(str(tmp_path / "u.gguf")), torch.float32)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.kind == "q4_1"
    assert isinstance(model.layers[0].qkv_proj, torch.nn.Linear)  # float tensors stay float


def test_unsupported_type_is_refused_naming_tensor_and_type(tmp_path: Path, cache: Path) -> None:
    tokenizer = make_tiny_tokenizer()
    types = {"blk.1.ffn_up.weight": Q.Q5_0}
    write_llama_gguf(tmp_path / "q5.gguf", tiny_model(tokenizer.get_vocab_size(), is_tied=True), tokenizer,
                     quantize=types)  # fmt: skip
    with pytest.raises(UnsupportedQuantError, match=r"'blk\.1\.ffn_up\.weight' is Q5_0"):
        load_model(resolve_model(str(tmp_path / "q5.gguf")), torch.float32)


def test_a_moved_file_is_named(tmp_path: Path, cache: Path) -> None:
    path = write_quantized(tmp_path / "tiny.gguf", "q8_0")
    folder = resolve_model(str(path))
    path.rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(FileNotFoundError, match="gone or has changed"):
        load_model(folder, torch.float32)


def greedy(engine: Engine, prompts: list[list[int]], batched: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    if batched:
        return [c.token_ids for c in engine.generate(prompts, params)]
    return [engine.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("bits", ["int16", "int8"])
def test_engine_greedy_output_does_not_depend_on_batching_or_the_prefix_cache(
    bits: str, tmp_path: Path, cache: Path
) -> None:
    """A GGUF model through the real engine (fused decode layer where the CPU runs it): the same
    tokens one request at a time and batched, with the prefix cache warm or off."""
    path = write_quantized(tmp_path / "tiny.gguf", "q4_1")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 9, 1, 14)]
    engine = Engine.from_config(EngineConfig(model=str(path), quant_activations=bits, num_kv_blocks=64))
    assert engine.model_config.vocab_size > 300
    errors = engine.quant_layer_errors  # measured at load on the calibration text
    assert len(errors) == 2 * 4 + 1 and 0 < max(errors.values()) < (1e-3 if bits == "int16" else 0.05)
    runner = engine.runner
    if quant_isa(probe()) is not None:  # the decode steps run the fused quantized layer
        assert isinstance(runner, ModelRunner) and isinstance(runner.decode_step, CpuDecodeStep)
    alone = greedy(engine, prompts, batched=False)
    assert greedy(engine, prompts, batched=True) == alone  # batched, and the shared prefix cached now
    cold = Engine.from_config(
        EngineConfig(model=str(path), quant_activations=bits, num_kv_blocks=64, enable_prefix_caching=False)
    )
    assert greedy(cold, prompts, batched=True) == alone


@pytest.mark.parametrize(("quantization", "kind"), [("int8", "q8_0"), ("int4", "q4_1")])
def test_a_float_checkpoint_quantized_at_load_tracks_it(
    quantization: str, kind: str, tmp_path: Path, cache: Path
) -> None:
    tokenizer = make_tiny_tokenizer()
    write_llama_gguf(tmp_path / "f.gguf", tiny_model(tokenizer.get_vocab_size(), is_tied=True), tokenizer)
    convert_gguf_to_hf(tmp_path / "f.gguf", tmp_path / "float", progress=lambda _: None)
    reference, _ = load_model(tmp_path / "float", torch.float32)
    model, _ = load_model(tmp_path / "float", torch.float32)
    assert quantize_linears(model, QUANTIZATION_KINDS[quantization]) == 2 * 4 + 1  # + the tied logits
    assert {m.kind for m in model.modules() if isinstance(m, QuantLinear)} == {kind, "q8_0"}  # 8-bit logits
    use_quant_kernels(model, probe(), cache / ".kernels")
    tokens = {"A": list(range(5, 17)), "B": list(range(40, 50))}
    for got, want in zip(logits_of(model, tokens), logits_of(reference, tokens), strict=True):
        error = float((got - want).norm() / want.norm())
        assert 0 < error < (0.02 if quantization == "int8" else 0.2), error


def test_quantization_settings_are_checked(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ValueError, match="quantization: expected one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quant_activations: expected one of"):
        EngineConfig(quant_activations="int4")
    path = write_quantized(tmp_path / "tiny.gguf", "q8_0")
    with pytest.raises(ValueError, match="quantized already"):
        Engine.from_config(EngineConfig(model=str(path), quantization="int8", num_kv_blocks=16))
