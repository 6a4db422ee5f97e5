"""Pre-packed oneDNN linears give bit-identical bfloat16 results to the plain model, where the CPU can
run them; where it cannot, the transform is skipped (with its reason) and nothing crashes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.worker.test_models_tiny import _save_hf
from worker.attention import AttentionMetadata, allocate_kv_cache
from worker.cpu_isa import caps_from_flags, probe
from worker.models.cpu_packing import PackedLinear, can_pack, pack_linears, pack_linears_if_supported
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.isa,
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN"),
]


def run(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Prefill ``token_ids`` then decode one more token; return the logits of both steps."""
    cfg = model.config  # type: ignore[union-attr]
    caches = allocate_kv_cache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    table = torch.tensor([[5, 2, 7, 1]])
    logits = []
    with torch.inference_mode():
        for start, end, num_decodes in ((0, len(token_ids) - 1, 0), (len(token_ids) - 1, len(token_ids), 1)):
            positions = torch.arange(start, end)
            slots = table[0, positions // 4] * 4 + positions % 4
            meta = AttentionMetadata.build(
                slot_mapping=slots,
                query_start_loc=[0, end - start],
                seq_lens=[end],
                block_tables=table,
                num_decodes=num_decodes,
                block_size=4,
            )
            hidden = model(torch.tensor(token_ids[start:end]), positions, caches, meta)
            logits.append(model.compute_logits(hidden))  # type: ignore[operator]
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["llama-tied", "llama-gqa-untied", "qwen2-qkv-bias-yarn"])
def test_packed_model_is_bit_identical_in_bf16(name: str, tmp_path: Path) -> None:
    _save_hf(name, tmp_path)
    plain, _ = load_model(tmp_path, torch.bfloat16)
    packed, _ = load_model(tmp_path, torch.bfloat16)
    why_not = can_pack(packed, probe())
    if why_not is not None:
        pytest.skip(f"not packed on this CPU: {why_not}")
    num_linears = sum(isinstance(m, nn.Linear) for m in packed.modules())
    count = pack_linears(packed)
    assert count == num_linears + (1 if plain.lm_head is None else 0)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    tokens = [3, 17, 99, 4, 250, 8, 61, 12, 40, 7, 1]
    assert torch.equal(run(plain, tokens), run(packed, tokens))


def test_float32_models_are_not_packed(tmp_path: Path) -> None:
    _save_hf("llama-tied", tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    assert can_pack(model, probe()) == "not a bfloat16 model on CPU"
    assert pack_linears_if_supported(model, probe()) == 0


def test_an_avx2_cpu_leaves_bf16_unpacked_and_still_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_hf("llama-tied", tmp_path)
    plain, _ = load_model(tmp_path, torch.bfloat16)
    model, _ = load_model(tmp_path, torch.bfloat16)
    avx2 = caps_from_flags({"avx", "avx2", "fma"}, "an AVX2 CPU")
    with caplog.at_level("INFO"):
        assert pack_linears_if_supported(model, avx2) == 0
    assert "left unpacked" in caplog.text and "avx2" in caplog.text
    assert any(isinstance(m, nn.Linear) for m in model.modules())
    tokens = [3, 17, 99, 4, 250, 8]
    assert torch.equal(run(plain, tokens), run(model, tokens))
