"""bench quant's measures: agreement and perplexity arithmetic; per-layer errors (quant_check) on a
tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from loadtest.quant_bench import TEXT, compare, parse_args
from tests.worker.test_models_tiny import _save_hf
from worker.models.loader import load_model
from worker.models.quant import QuantLinear, quantize_linears
from worker.models.quant_check import layer_errors, prefill_logits


def test_compare_counts_agreement_and_divides_perplexities() -> None:
    ids = [0, 1, 2, 1]
    reference = torch.log(torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.1, 0.8, 0.1], [0.8, 0.1, 0.1]]))
    other = reference.clone()
    other[3] = torch.log(torch.tensor([0.1, 0.1, 0.8]))  # the last argmax differs (not a scored target)
    other[0] = torch.log(torch.tensor([0.5, 0.4, 0.1]))  # target 1 now has 0.4
    got = compare(other, reference, ids)
    assert got["top1_agreement"] == 0.5  # positions 0 and 3 changed their argmax
    ppl_ref = math.exp(-(3 * math.log(0.8)) / 3)
    ppl = math.exp(-(math.log(0.4) + 2 * math.log(0.8)) / 3)
    assert got["ppl"] == pytest.approx(ppl, abs=1e-3)
    assert got["ppl_ratio"] == pytest.approx(ppl / ppl_ref, abs=1e-4)


def test_layer_errors_measure_each_quantized_linear(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    model, config = load_model(tmp_path, torch.float32)
    exact = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_linears(model, "q4_0")
    ids = list(range(3, 40))
    with layer_errors(model, exact) as errors:
        logits = prefill_logits(model, ids)
    assert logits.shape == (len(ids), config.vocab_size)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(errors) == quantized and len(quantized) == 4 * config.num_layers + 1  # the lm_head too
    logits = errors.pop("lm_head")
    assert all(0.01 < e < 0.5 for e in errors.values()), errors  # 4-bit weights: percent-level
    assert 0 < logits < 0.01  # the logits stay 8-bit (quant.LOGITS_KIND)
    with layer_errors(model, exact) as after:  # hooks removed on exit: a new context starts empty
        pass
    assert after == {}


def test_the_text_ships_with_the_bench() -> None:
    assert len(TEXT.read_text().split()) > 400
    assert parse_args(["--max-tokens", "64"]).max_tokens == 64
