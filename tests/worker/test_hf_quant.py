"""GPTQ / AWQ checkpoints served natively (``worker/models/hf_quant.py``).

A reference packer written here from the formats' documentation (AutoGPTQ / optimum's and AutoAWQ's
``pack``) writes the integers a quantizer chose; the conversion must give back exactly the format's own
dequantization. A tiny random Llama quantized by round-to-nearest, saved as a folder the way those
tools save one, must then track a float model holding the same dequantized weights, and serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers import LlamaForCausalLM as HFLlama

from tests.worker.test_gguf_convert import BOS_ID, EOS_ID, SPECIAL_TOKENS, make_tiny_tokenizer
from tests.worker.test_gguf_model import greedy, logits_of
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.config import QuantConfig, UnsupportedModelError, model_config_from_dict
from worker.models.hf_quant import awq_to_q4_1, gptq_to_q4_1
from worker.models.loader import WeightMismatchError, load_model
from worker.models.quant import QuantLinear

HIDDEN, INTERMEDIATE = 128, 256  # every K (128 or 256) holds whole groups of 32, 64 and 128
# prefill logits vs the float model of the same dequantized weights: only x's int16 rounding differs
LOGITS_RTOL = 5e-4  # measured 3e-5 .. 9e-5 (relative norm); a packing slip is of order 1

# ---- the reference packer ------------------------------------------------------------------------

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of an int32 holds column AWQ_PACK_ORDER[i]


def pack_int32(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> [...] int32 with nibble i at bits 4i..4i+3."""
    out = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        out |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


@dataclass(slots=True)
class Quants:
    """A linear [N, K]'s integers: w[n, k] = scales[k // g, n] * (q[k, n] - zeros[k // g, n])."""

    q: np.ndarray  # [K, N] in 0..15
    zeros: np.ndarray  # [K / g, N]
    scales: np.ndarray  # [K / g, N] float16

    def dequantized(self) -> torch.Tensor:
        """The format's own dequantization, [N, K] float32."""
        group = self.q.shape[0] // self.scales.shape[0]
        scales = torch.from_numpy(self.scales).float().repeat_interleave(group, dim=0)
        zeros = torch.from_numpy(self.zeros).repeat_interleave(group, dim=0)
        return (scales * (torch.from_numpy(self.q) - zeros).float()).T.contiguous()


def pack_gptq(quants: Quants, checkpoint_format: str) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: q[8i + j, n] in nibble j of qweight[i, n]; the zero of column 8c + j in
    nibble j of qzeros[r, c], minus one in v1 ("gptq")."""
    cols, rows = quants.q.shape
    num_groups = quants.scales.shape[0]
    stored = quants.zeros - 1 if checkpoint_format == "gptq" else quants.zeros
    assert stored.min() >= 0 and stored.max() <= 15
    return {
        "qweight": torch.from_numpy(pack_int32(quants.q.reshape(cols // 8, 8, rows).transpose(0, 2, 1))),
        "qzeros": torch.from_numpy(pack_int32(stored.reshape(num_groups, rows // 8, 8))),
        "scales": torch.from_numpy(quants.scales),
        "g_idx": torch.arange(cols, dtype=torch.int32) // (cols // num_groups),
    }


def pack_awq(quants: Quants) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: along N, nibble i of each int32 holding column 8c + AWQ_PACK_ORDER[i]."""
    cols, rows = quants.q.shape
    num_groups = quants.scales.shape[0]
    return {
        "qweight": torch.from_numpy(pack_int32(quants.q.reshape(cols, rows // 8, 8)[..., AWQ_PACK_ORDER])),
        "qzeros": torch.from_numpy(
            pack_int32(quants.zeros.reshape(num_groups, rows // 8, 8)[..., AWQ_PACK_ORDER])
        ),
        "scales": torch.from_numpy(quants.scales),
    }


def quantize_rtn(weight: torch.Tensor, group_size: int | None, sym: bool, min_zero: int) -> Quants:
    """Round-to-nearest per group of ``group_size`` inputs (None: the whole row), as GPTQ's quantizer
    sets its grid: sym has z = 8 and scale = 2 max|w| / 15; asym spans [min(w, 0), max(w, 0)]."""
    rows, cols = weight.shape
    group = group_size or cols
    w = weight.detach().double().reshape(rows, cols // group, group)
    if sym:
        scales = (2 * w.abs().amax(-1) / 15).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).half()
        zeros = torch.round(-low / scales.double()).long().clamp(min_zero, 15)  # v1 cannot store 0
    q = torch.round(w / scales.double()[..., None]).long() + zeros[..., None]
    q = q.clamp(0, 15).reshape(rows, cols)
    return Quants(q.T.numpy().copy(), zeros.T.numpy().copy(), scales.T.numpy().copy())


# ---- the conversion is exact ---------------------------------------------------------------------

FORMATS = ["gptq", "gptq_v2", "awq"]


def convert(quants: Quants, fmt: str) -> Any:
    if fmt == "awq":
        packed = pack_awq(quants)
        return awq_to_q4_1(packed["qweight"], packed["qzeros"], packed["scales"])
    packed = pack_gptq(quants, fmt)
    return gptq_to_q4_1(packed["qweight"], packed["qzeros"], packed["scales"], fmt)


@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("fmt", FORMATS)
def test_conversion_equals_the_formats_dequantization_bit_for_bit(fmt: str, group_size: int | None) -> None:
    rng = np.random.default_rng(7)
    cols, rows = 256, 40
    num_groups = cols // (group_size or cols)
    low = 1 if fmt == "gptq" else 0  # v1's nibbles 0..15 are zeros 1..16
    quants = Quants(
        rng.integers(0, 16, (cols, rows)),
        rng.integers(low, low + 16, (num_groups, rows)),
        # every exponent fp16 has, subnormals included: each product must still be exact
        (rng.standard_normal((num_groups, rows)) * 2.0 ** rng.integers(-24, 8, (num_groups, rows))).astype(
            np.float16
        ),
    )
    weight = convert(quants, fmt)
    assert weight.kind == "q4_1" and weight.shape == (rows, cols)
    assert torch.equal(weight.quants(), torch.from_numpy(quants.q).T.int())
    assert torch.equal(weight.dequantize(), quants.dequantized())


# ---- a tiny quantized checkpoint -----------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Scheme:
    fmt: str  # "gptq" (v1), "gptq_v2" or "awq"
    group_size: int | None
    sym: bool = False
    is_tied: bool = True
    has_bias: bool = False
    desc_act: bool = False

    def quantization_config(self) -> dict[str, Any]:
        group = -1 if self.group_size is None else self.group_size
        if self.fmt == "awq":  # as AutoAWQ writes it into config.json
            return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": self.sym,  # optimum's
                "desc_act": self.desc_act, "damp_percent": 0.1, "true_sequential": True,
                "static_groups": False, "checkpoint_format": self.fmt}  # fmt: skip


def tiny_llama(vocab_size: int, scheme: Scheme) -> HFLlama:
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=scheme.is_tied,
        attention_bias=scheme.has_bias,
        mlp_bias=scheme.has_bias,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        initializer_range=0.1,
    )
    model = HFLlama(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # ones / zeros by default would hide a swap
                param.copy_(
                    1.0 + 0.1 * torch.randn_like(param) if "norm" in name else torch.randn_like(param)
                )
    return model


def write_checkpoint(root: Path, scheme: Scheme) -> tuple[Path, Path]:
    """(the quantized folder, a float folder with its dequantized weights), float tensors in fp16 in both
    (as GPTQ / AWQ tools keep them)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=make_tiny_tokenizer(),
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
    )
    model = tiny_llama(len(tokenizer), scheme)
    quantized, dequantized = root / "quantized", root / "float"
    model.save_pretrained(quantized)
    tensors: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(quantized / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if name.startswith("model.layers.") and prefix.endswith("_proj") and name.endswith(".weight"):
            quants = quantize_rtn(tensor, scheme.group_size, scheme.sym, min_zero=int(scheme.fmt == "gptq"))
            packed = pack_awq(quants) if scheme.fmt == "awq" else pack_gptq(quants, scheme.fmt)
            tensors |= {f"{prefix}.{key}": value for key, value in packed.items()}
            floats[name] = quants.dequantized()
        else:
            tensors[name] = floats[name] = tensor.half()
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = scheme.quantization_config()
    (quantized / "config.json").write_text(json.dumps(raw))
    tokenizer.save_pretrained(quantized)
    model.load_state_dict({k: v.float() for k, v in floats.items()}, strict=not scheme.is_tied)
    model.save_pretrained(dequantized)
    return quantized, dequantized


SCHEMES = {
    "gptq-sym-g128-tied": Scheme("gptq", 128, sym=True),
    "gptq-asym-g64-biases-untied": Scheme("gptq", 64, is_tied=False, has_bias=True),
    "gptq_v2-asym-g32": Scheme("gptq_v2", 32),
    "gptq-sym-per-row-desc-act-trivial": Scheme("gptq", None, sym=True, desc_act=True),
    "awq-g128-untied": Scheme("awq", 128, is_tied=False),
    "awq-g32-biases": Scheme("awq", 32, has_bias=True),
}


@pytest.mark.parametrize("name", SCHEMES)
def test_loaded_model_tracks_the_float_model_of_its_dequantized_weights(name: str, tmp_path: Path) -> None:
    scheme = SCHEMES[name]
    quantized, dequantized = write_checkpoint(tmp_path, scheme)
    model, config = load_model(quantized, torch.float32)
    reference, _ = load_model(dequantized, torch.float32)
    assert config.quantization is not None and config.quantization.method == scheme.fmt.removesuffix("_v2")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 and {m.kind for m in linears} == {"q4_1"}  # the logits stay float
    for ours, theirs in zip(model.layers, reference.layers, strict=True):
        for projection in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear, exact = getattr(ours, projection), getattr(theirs, projection)
            assert torch.equal(linear.dequantized(), exact.weight), projection  # rows fused in order
            assert (linear.bias is None) == (exact.bias is None)
            if exact.bias is not None:
                assert torch.equal(linear.bias, exact.bias)
    gen = torch.Generator().manual_seed(3)
    tokens = {"A": torch.randint(0, config.vocab_size, (12,), generator=gen).tolist(),
              "B": torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()}  # fmt: skip
    for got, want in zip(logits_of(model, tokens), logits_of(reference, tokens), strict=True):
        error = float((got - want).norm() / want.norm())
        assert 0 < error < LOGITS_RTOL, error  # x in int16 blocks: close, never bitwise


@pytest.mark.isa  # the C kernel and the fused decode layer where the CPU runs them
@pytest.mark.parametrize("name", ["gptq-asym-g64-biases-untied", "awq-g128-untied"])
def test_engine_greedy_output_does_not_depend_on_batching(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path / "cache"))
    quantized, _ = write_checkpoint(tmp_path, SCHEMES[name])
    engine = Engine.from_config(EngineConfig(model=str(quantized), num_kv_blocks=64))
    assert engine.config.dtype == "float32"  # auto: quantized linears compute in float32
    assert len(engine.quant_layer_errors) == 2 * 4 and max(engine.quant_layer_errors.values()) < 1e-3
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 7, 1)]
    alone = greedy(engine, prompts, batched=False)
    assert greedy(engine, prompts, batched=True) == alone
    assert all(len(ids) == 12 for ids in alone)  # greedy's max_tokens, eos ignored


# ---- config and refusals -------------------------------------------------------------------------

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 1, "num_attention_heads": 4,
}  # fmt: skip


def parse(quantization_config: dict[str, Any]) -> QuantConfig | None:
    return model_config_from_dict({**BASE_CONFIG, "quantization_config": quantization_config}).quantization


def test_configs_as_the_tools_write_them_are_parsed() -> None:
    assert parse(Scheme("gptq", 128, sym=True).quantization_config()) == QuantConfig(
        "gptq", 4, 128, True, False, "gptq"
    )
    optimum = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False}
    assert parse(optimum) == QuantConfig("gptq", 4, None, False, False, "gptq")  # v1 is the default
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    assert parse(autoawq) == QuantConfig("awq", 4, 64, False, False, "gemm")


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"_config\.bits = 8: only 4-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
         r"quantization_config\.version = 'gemv'.*gemm"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         r"quantization_config\.quant_method = 'bitsandbytes'.*gptq, awq"),
        ({"quant_method": "fp8"}, r"quant_method = 'fp8'"),
        ({"quant_method": "compressed-tensors"}, r"quant_method = 'compressed-tensors'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"group_size = 16.*multiple of 32"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
         r"checkpoint_format = 'marlin'"),
    ],
)  # fmt: skip
def test_unsupported_quantization_is_refused_naming_key_and_value(
    quantization_config: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        parse(quantization_config)


def test_act_order_with_a_shuffled_g_idx_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    quantized, _ = write_checkpoint(tmp_path, Scheme("gptq", 32, desc_act=True))
    file = quantized / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(INTERMEDIATE, generator=torch.Generator().manual_seed(0))]
    save_file(tensors, file)
    with pytest.raises(UnsupportedModelError, match=rf"{name} is not k // group_size .*desc_act = True"):
        load_model(quantized, torch.float32)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    quantized, _ = write_checkpoint(tmp_path, Scheme("gptq", 64))
    file = quantized / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(HIDDEN, dtype=torch.float16)  # AutoGPTQ's
    save_file(tensors, file)
    load_model(quantized, torch.float32)  # a zero bias on a layer without one carries nothing: dropped

    del tensors["model.layers.1.self_attn.k_proj.qzeros"]
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.ones(INTERMEDIATE, dtype=torch.float16)
    save_file(tensors, file)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.self_attn\.k_proj\.qzeros") as info:
        load_model(quantized, torch.float32)
    assert "unexpected ['model.layers.0.mlp.up_proj.bias']" in str(info.value)


def test_a_misshapen_packed_tensor_is_named(tmp_path: Path) -> None:
    quantized, _ = write_checkpoint(tmp_path, Scheme("awq", 64))
    file = quantized / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.gate_proj.scales"] = tensors["model.layers.0.mlp.gate_proj.scales"][:1]
    save_file(tensors, file)
    with pytest.raises(WeightMismatchError, match=r"mlp\.gate_proj\.scales has shape \(1, 256\)"):
        load_model(quantized, torch.float32)
