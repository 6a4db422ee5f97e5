"""gguf_convert: a tiny random Llama written as llama.cpp would write it must come back exactly."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from worker.models.gguf_convert import convert_gguf_to_hf, hf_tensor_name, unpermute_qk

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Tiers of service: interactive requests first, batch requests when there is room.",
] * 20
NUM_HEADS, NUM_KV_HEADS = 4, 2
ROPE_THETA = 50000.0  # not the default, so a dropped rope_theta shows in the logits
PROMPT = "The capital of Italy is Rome, and blocks are fixed-size."


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama_cpp_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    layer_parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, *middle, last = hf_name.split(".")
    return f"blk.{layer}.{layer_parts['.'.join(middle)]}.{last}"


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


def make_tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def tiny_model(
    vocab_size: int, *, is_tied: bool, hidden_size: int = 64, intermediate_size: int = 128
) -> LlamaForCausalLM:
    torch.manual_seed(0 if is_tied else 1)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-5,
        tie_word_embeddings=is_tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones by default, which would hide a swapped norm
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def write_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    *,
    quantize: frozenset[str] | Mapping[str, gguf.GGMLQuantizationType] = frozenset(),
    architecture: str = "llama",
    raw: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> None:
    """Write `model` the way llama.cpp's convert_hf_to_gguf.py does; names in `quantize` go as Q8_0
    (a set) or as the type it maps them to; names in `raw` are written as the given blocks instead
    (types the gguf package cannot quantize: the k-quants)."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    types = quantize if isinstance(quantize, Mapping) else dict.fromkeys(quantize, q8_0)
    config = model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // NUM_HEADS)
    writer.add_vocab_size(config.vocab_size)

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = model.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    for hf_name, tensor in state.items():
        data = tensor.numpy().astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, NUM_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, NUM_KV_HEADS)
        name = llama_cpp_name(hf_name)
        if raw is not None and name in raw:
            blocks, qtype = raw[name]
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        elif name in types:
            qtype = types[name]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(slots=True)
class Converted:
    model: LlamaForCausalLM
    folder: Path
    lines: list[str]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request: pytest.FixtureRequest, tiny_tokenizer: Tokenizer, tmp_path_factory) -> Converted:
    is_tied: bool = request.param
    root = tmp_path_factory.mktemp("tied" if is_tied else "untied")
    model = tiny_model(tiny_tokenizer.get_vocab_size(), is_tied=is_tied)
    write_llama_gguf(root / "tiny.gguf", model, tiny_tokenizer)
    lines: list[str] = []
    convert_gguf_to_hf(root / "tiny.gguf", root / "hf", progress=lines.append)
    return Converted(model, root / "hf", lines)


def test_folder_has_every_file(converted: Converted) -> None:
    names = {path.name for path in converted.folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names


def test_weights_equal_the_original_exactly(converted: Converted) -> None:
    original = converted.model.state_dict()
    written = load_file(str(converted.folder / "model.safetensors"))
    expected_names = set(original)
    if converted.model.config.tie_word_embeddings:
        expected_names.discard("lm_head.weight")
    assert set(written) == expected_names
    for name, tensor in written.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, original[name]), name


def test_config_states_the_shape(converted: Converted) -> None:
    config = json.loads((converted.folder / "config.json").read_text())
    source = converted.model.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["rope_theta"] == ROPE_THETA
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is source.tie_word_embeddings
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert config[key] == getattr(source, key), key
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_ID, EOS_ID)
    generation = json.loads((converted.folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_ID, EOS_ID)


def test_transformers_logits_equal_the_original(converted: Converted, tiny_tokenizer: Tokenizer) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(converted.folder, dtype=torch.float32).eval()
    assert loaded.config.rope_parameters["rope_theta"] == ROPE_THETA
    input_ids = torch.tensor([tiny_tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        expected = converted.model(input_ids).logits
        actual = loaded(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_tokenizer_round_trips_and_matches_the_source(
    converted: Converted, tiny_tokenizer: Tokenizer
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert ids == tiny_tokenizer.encode(PROMPT).ids
    assert tokenizer.decode(ids) == PROMPT
    # Control tokens stay whole rather than being cut into byte pieces.
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [BOS_ID]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


def test_chat_template_is_carried(converted: Converted) -> None:
    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_progress_reports_stages_and_counter(converted: Converted) -> None:
    num_tensors = 20 if converted.model.config.tie_word_embeddings else 21
    assert f"dequantized {num_tensors}/{num_tensors} tensors" in converted.lines
    assert any("tokenizer" in line for line in converted.lines)
    assert converted.lines[-1].startswith("wrote ")


def test_q8_0_tensors_are_dequantized(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    model = tiny_model(tiny_tokenizer.get_vocab_size(), is_tied=True)
    # attn_q also proves the un-permute runs on the dequantized rows, not on the packed blocks.
    quantized = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
                 "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight"}  # fmt: skip
    write_llama_gguf(tmp_path / "q.gguf", model, tiny_tokenizer, quantize=frozenset(quantized))
    convert_gguf_to_hf(tmp_path / "q.gguf", tmp_path / "hf", progress=lambda _: None)
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    original = model.state_dict()
    for hf_name in quantized.values():
        expected, actual = original[hf_name], written[hf_name]
        # Q8_0: blocks of 32 along a row share one step max|x|/127 (stored as float16, which rounds it
        # by up to 2^-11), so each value is off by half a step plus 127 times that rounding: < 0.6 steps.
        block_max = expected.reshape(expected.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
        bound = (block_max / 127 * 0.6).expand(-1, -1, 32).reshape(expected.shape)
        assert not torch.equal(actual, expected), "tensor was not quantized; the test proves nothing"
        assert bool(((actual - expected).abs() <= bound).all()), hf_name


def test_non_llama_architecture_is_refused(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    model = tiny_model(tiny_tokenizer.get_vocab_size(), is_tied=True)
    write_llama_gguf(tmp_path / "g.gguf", model, tiny_tokenizer, architecture="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        convert_gguf_to_hf(tmp_path / "g.gguf", tmp_path / "hf", progress=lambda _: None)
    assert not (tmp_path / "hf").exists()


def test_failure_leaves_no_folder_and_no_staging(
    converted: Converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = converted.folder.parent / "tiny.gguf"

    def explode(*_args: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr("worker.models.gguf_convert._write_tokenizer", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf_to_hf(gguf_path, tmp_path / "hf", progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_reconverting_replaces_an_existing_folder(converted: Converted, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf_to_hf(converted.folder.parent / "tiny.gguf", out, progress=lambda _: None)
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(("rows", "num_heads"), [(64, 4), (32, 2), (576, 9), (192, 3)])
def test_unpermute_inverts_llama_cpp_permute(rows: int, num_heads: int) -> None:
    weight = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_unknown_tensor_name_is_refused() -> None:
    assert hf_tensor_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")
