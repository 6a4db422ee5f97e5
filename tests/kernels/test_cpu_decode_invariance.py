"""A row's result from the fused C decode layer is the same bits whatever else its step holds: a
decode row alone or behind other rows, a prompt's rows however the prompt was cut (chunks, slices).
A seeded request's logits, and so its tokens, must not depend on what it is batched with
(``tests/worker/test_batch_invariance.py`` checks it on the real model; docs/kernels.md says why it
holds). Tiny random-weight models, every build the CPU can run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels.cpu.decode import QUANT_KERNELS, DecodeLayerKernel, load_quant_decode_kernel
from tests.kernels.cc import NEEDS_CC
from tests.kernels.decode_cases import BLOCK_SIZE, NUM_BLOCKS, fused_step, key_id, skip_wide_bf16
from tests.worker.test_models_tiny import _save_hf
from worker.cpu_isa import probe
from worker.models.cpu_decode import CpuDecodeStep
from worker.models.loader import load_model
from worker.models.quant import quant_isa, quantize_linears, use_quant_kernels

pytestmark = [pytest.mark.isa, NEEDS_CC]


def _rows_out(
    step: CpuDecodeStep,
    sequences: list[tuple[int, int, list[int], list[int]]],
    prompt_lens: list[int] | None = None,
) -> torch.Tensor:
    """One step of (tokens cached, new tokens, blocks, token ids) sequences, a token a row; a row is
    a prompt's below its sequence's ``prompt_lens`` (default: a sequence of one new token a decode,
    the others prompts)."""
    if prompt_lens is None:
        prompt_lens = [done + new if new > 1 else done for done, new, _, _ in sequences]
    ids, positions, slots, lens, tables, in_prompt = [], [], [], [], [], []
    for (done, new, blocks, tokens), prompt_len in zip(sequences, prompt_lens, strict=True):
        for p in range(done, done + new):
            ids.append(tokens[p - done])
            positions.append(p)
            slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            lens.append(p + 1)
            tables.append(blocks)
            in_prompt.append(p < prompt_len)
    with torch.inference_mode():
        return step.run(ids, positions, slots, lens, tables, in_prompt).clone()


def _assert_a_decode_row_is_the_same_wherever_it_sits(step: CpuDecodeStep, vocab: int) -> None:
    rng = random.Random(3)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)

    def sequence(done: int, new: int) -> tuple[int, int, list[int], list[int]]:
        blocks = [free.pop() for _ in range(-(-(done + new) // BLOCK_SIZE))]
        return done, new, blocks, [rng.randrange(3, vocab) for _ in range(new)]

    target = sequence(37, 1)
    decodes = [sequence(n, 1) for n in (50, 9, 120, 3)]
    prompts = [sequence(0, 6), sequence(20, 5)]
    alone = _rows_out(step, [target])[0]
    for before, after in [(decodes[:1], []), (decodes, prompts), (decodes[2:], decodes[:2] + prompts)]:
        got = _rows_out(step, [*before, target, *after])[len(before)]
        assert torch.equal(got, alone), (len(before), float((got - alone).abs().max()))


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-head-dim-12", "llama-group3-dim64"])
def test_a_decode_rows_result_does_not_depend_on_its_place_in_the_step(
    kernel: DecodeLayerKernel, name: str, tmp_path: Path, kernel_dir: Path
) -> None:
    """Bit for bit, alone or behind other rows: a seeded request's logits, and so its tokens, must not
    depend on what it is batched with. GCC compiled an `omp simd reduction` over a row (the RMS norm's
    sum of squares) in two versions with different summation orders, one for the first row of the
    loop and one for the rest, and the Q4_1 default's logits moved by up to ~0.03 with the batch."""
    _save_hf(name, tmp_path)
    model, _ = load_model(tmp_path, kernel.dtype)
    step = fused_step(model, kernel, kernel_dir)
    _assert_a_decode_row_is_the_same_wherever_it_sits(step, model.config.vocab_size)


@pytest.mark.parametrize(("kv_dtype", "isa"), list(QUANT_KERNELS), ids=[key_id(k) for k in QUANT_KERNELS])
def test_a_quantized_decode_rows_result_does_not_depend_on_its_place_in_the_step(
    kv_dtype: torch.dtype, isa: str, tmp_path: Path, kernel_dir: Path
) -> None:
    caps = probe()
    if quant_isa(caps) is None or (isa == "avx512_vnni" and quant_isa(caps) != isa):
        pytest.skip(f"this CPU (as probed) cannot run the {isa} build ({caps.describe()})")
    _save_hf("llama-group3-dim64", tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    quantize_linears(model, "q4_1")
    assert use_quant_kernels(model, caps, kernel_dir) > 0
    step = fused_step(model, load_quant_decode_kernel(isa, kernel_dir, kv_dtype), kernel_dir)
    _assert_a_decode_row_is_the_same_wherever_it_sits(step, model.config.vocab_size)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-group3-dim64", "mistral-sliding-window"])
def test_a_prompts_rows_are_the_same_bits_however_the_prompt_is_cut(
    kernel: DecodeLayerKernel, name: str, tmp_path: Path, kernel_dir: Path
) -> None:
    """A 45-token prompt prefilled whole, or in chunks cut anywhere (tails of 1 to 3 rows, beside
    decodes), or in slices of 6 rows: each prompt row's output the same bits. The chunks, the token
    budget, a prefix-cache hit and the slicing all move where a prompt is cut; its rows attend in
    tiles whatever their number, a tile's lane independent of its other rows (key chunks at fixed
    positions), so the cut moves nothing (the sliding window too)."""
    skip_wide_bf16(kernel, name)
    _save_hf(name, tmp_path)
    model, _ = load_model(tmp_path, kernel.dtype)
    rng = random.Random(5)
    tokens = [rng.randrange(3, model.config.vocab_size) for _ in range(45)]
    blocks = list(range(40, 40 + -(-45 // BLOCK_SIZE)))
    vocab = model.config.vocab_size
    decodes = [(n, 1, [100 + n, 120 + n, 140 + n], [rng.randrange(3, vocab)]) for n in (3, 11)]

    def prefill(cut: list[int], beside: bool = False, rows_a_call: int | None = None) -> torch.Tensor:
        step = fused_step(model, kernel, kernel_dir)  # the same random cache each time
        if rows_a_call is not None:
            step.max_rows = rows_a_call
        outs, done = [], 0
        for new in cut:
            chunk = (done, new, blocks, tokens[done : done + new])
            rows = [*decodes, chunk] if beside else [chunk]
            prompt_lens = [done for done, *_ in rows[:-1]] + [45]  # the decodes' rows: output tokens
            outs.append(_rows_out(step, rows, prompt_lens)[len(rows) - 1 :])
            done += new
        return torch.cat(outs)

    whole = prefill([45])
    for cut, beside, rows_a_call in [
        ([5, 40], False, None),
        ([1, 2, 42], True, None),
        ([16, 29], True, None),
        ([3, 17, 25], False, None),
        ([45], True, 6),
    ]:
        got = prefill(cut, beside, rows_a_call)
        assert torch.equal(got, whole), (cut, beside, rows_a_call, float((got - whole).abs().max()))
