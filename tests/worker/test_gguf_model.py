"""A GGUF file served from its own blocks: a tiny random Llama written by the gguf package's writer with
its linears in Q4_1 / Q4_0 / Q8_0 and its embedding in Q8_0, loaded through ``resolve_model`` as a pool
path would be, against the same file dequantized by ``models pull``'s converter (the float reference).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from kernels.quant_format import UnsupportedQuantError
from tests.kernels.test_gguf_types import random_blocks
from tests.worker.test_gguf_convert import make_tiny_tokenizer, tiny_model, write_llama_gguf
from tests.worker.test_models_tiny import PagedSequences
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_isa import probe
from worker.engine import Engine
from worker.model_runner import ModelRunner, apply_quantization
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
    types = {"blk.1.ffn_up.weight": Q.MXFP4}
    write_llama_gguf(tmp_path / "fp4.gguf", tiny_model(tokenizer.get_vocab_size(), is_tied=True), tokenizer,
                     quantize=types)  # fmt: skip
    with pytest.raises(UnsupportedQuantError, match=r"'blk\.1\.ffn_up\.weight' is MXFP4: served are Q8_0"):
        load_model(resolve_model(str(tmp_path / "fp4.gguf")), torch.float32)


# A Q4_K_M file's mix, as llama.cpp's quantizer makes it: Q4_K, with Q6_K for v, ffn_down and the
# embedding (half of the layers' v / down: here layer 1), and the odd Q5_0 / Q5_K / Q5_1 tensor.
K_MIX = {
    "attn_q": ("Q4_K", "Q4_K"), "attn_k": ("Q4_K", "Q5_0"), "attn_v": ("Q4_K", "Q6_K"),
    "attn_output": ("Q4_K", "Q5_K"), "ffn_gate": ("Q4_K", "Q4_K"), "ffn_up": ("Q4_K", "Q5_1"),
    "ffn_down": ("Q4_K", "Q6_K"),
}  # fmt: skip


def test_a_k_quant_mix_is_served_from_its_blocks(tmp_path: Path, cache: Path) -> None:
    """Q4_K / Q5_K / Q5_0 / Q5_1 exactly, Q6_K requantized, mixed types in one fused projection:
    the logits track the file dequantized by the gguf package (``models pull``)."""
    tokenizer = make_tiny_tokenizer()
    model = tiny_model(tokenizer.get_vocab_size(), is_tied=True, hidden_size=256, intermediate_size=512)
    raw: dict[str, tuple[np.ndarray, Q]] = {}
    for i in range(2):
        for name, types in K_MIX.items():
            rows, cols = (256, 512) if name == "ffn_down" else ((512 if name in ("ffn_gate", "ffn_up") else
                          128 if name in ("attn_k", "attn_v") else 256), 256)  # fmt: skip
            raw[f"blk.{i}.{name}.weight"] = (random_blocks(types[i], rows, cols, i, 0.0004), Q[types[i]])
    raw["token_embd.weight"] = (random_blocks("Q6_K", model.config.vocab_size, 256, 9, 0.002), Q.Q6_K)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, model, tokenizer, raw=raw)
    quantized, config = load_model(resolve_model(str(path)), torch.float32)
    layer = quantized.layers[1]
    assert {m.kind for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)} == {
        "q8_c", "q8_0"}  # fmt: skip
    assert quantized.layers[0].qkv_proj.kind == "q4_1"  # all Q4_K: nibbles kept

    convert_gguf_to_hf(path, tmp_path / "float", progress=lambda _: None)
    reference, _ = load_model(tmp_path / "float", torch.float32)
    gen = torch.Generator().manual_seed(3)
    tokens = {"A": torch.randint(0, config.vocab_size, (12,), generator=gen).tolist(),
              "B": torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()}  # fmt: skip
    use_quant_kernels(quantized, probe(), cache / ".kernels")
    for got, want in zip(logits_of(quantized, tokens), logits_of(reference, tokens), strict=True):
        error = float((got - want).norm() / want.norm())
        assert 0 < error < 0.01, error  # x's int16 rounding and Q6_K's requantization
    engine = Engine.from_config(EngineConfig(model=str(path), num_kv_blocks=32))  # the fused decode layer
    prompts = [tokens["A"], tokens["B"], tokens["A"][:5]]
    assert greedy(engine, prompts, batched=True) == greedy(engine, prompts, batched=False)


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


def test_mixed_precision_keeps_the_named_modules_float(tmp_path: Path, cache: Path) -> None:
    """keep_full_precision: a GGUF file's attention and logits dequantized exactly into float linears,
    a float checkpoint's mlp left unquantized; the engine serves both (without the fused layer)."""
    path = write_quantized(tmp_path / "tiny.gguf", "q4_1")
    convert_gguf_to_hf(path, tmp_path / "float", progress=lambda _: None)
    reference, _ = load_model(tmp_path / "float", torch.float32)

    model, _ = load_model(resolve_model(str(path)), torch.float32)
    apply_quantization(
        model, EngineConfig(dtype="float32", keep_full_precision=("attention", "lm_head")), path
    )
    for layer, want in zip(model.layers, reference.layers, strict=True):
        assert type(layer.qkv_proj) is torch.nn.Linear and type(layer.o_proj) is torch.nn.Linear
        assert torch.equal(layer.qkv_proj.weight, want.qkv_proj.weight)  # the file's values, exactly
        assert isinstance(layer.gate_up_proj, QuantLinear) and isinstance(layer.down_proj, QuantLinear)
    assert type(model.lm_head) is torch.nn.Linear
    assert torch.equal(model.lm_head.weight, reference.embed_tokens.weight)  # tied: the embedding's blocks

    floating, _ = load_model(tmp_path / "float", torch.float32)
    apply_quantization(
        floating, EngineConfig(dtype="float32", quantization="int4", keep_full_precision=("mlp",)), path
    )
    for layer, want in zip(floating.layers, reference.layers, strict=True):
        assert type(layer.down_proj) is torch.nn.Linear and torch.equal(
            layer.down_proj.weight, want.down_proj.weight
        )
        assert isinstance(layer.qkv_proj, QuantLinear) and layer.qkv_proj.kind == "q4_1"
    assert isinstance(floating.lm_head, QuantLinear)

    config = EngineConfig(model=str(path), keep_full_precision=("attention",), num_kv_blocks=32)
    engine = Engine.from_config(config)
    assert isinstance(engine.runner, ModelRunner) and engine.runner.decode_step is None  # mixed layers
    assert len(engine.quant_layer_errors) == 2 * 2 + 1  # the mlp projections and the logits
    prompts = [list(range(5, 17)), list(range(40, 47))]
    assert greedy(engine, prompts, batched=True) == greedy(engine, prompts, batched=False)


def test_mixed_precision_settings_are_checked(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ValueError, match="keep_full_precision: unknown module 'attn'"):
        EngineConfig(keep_full_precision=("attn",))
    path = write_quantized(tmp_path / "tiny.gguf", "q8_0")
    with pytest.raises(ValueError, match=r"'layers\.5' is no module of this model \(2 layers\)"):
        Engine.from_config(EngineConfig(model=str(path), keep_full_precision=("layers.5",), num_kv_blocks=16))
    convert_gguf_to_hf(path, tmp_path / "float", progress=lambda _: None)
    with pytest.raises(ValueError, match=r"keep_full_precision: .* is not quantized"):
        Engine.from_config(
            EngineConfig(model=str(tmp_path / "float"), keep_full_precision=("lm_head",), num_kv_blocks=16)
        )
