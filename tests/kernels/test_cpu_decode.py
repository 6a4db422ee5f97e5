"""The fused C decode layer equals the model's torch path: same hidden states, same K/V written.
The ``_kv16`` builds (float32 or quantized layers over a bfloat16 cache) against the torch path over
the same bfloat16 cache: both round K/V where they store them, so they agree as the float32 builds do.

Tiny random-weight models of each family (GQA, biases, Qwen2's one KV head, Mistral's sliding window),
decode rows over shuffled blocks whose contexts span several of the kernel's 32-key chunks, every build
the CPU can run: float32 on AVX-512 and AVX2 (equal up to float32 rounding), bfloat16 on AVX512-BF16
(within bf16 rounding: the kernel keeps activations in float32 where torch rounds after each op).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels.cpu.decode import (
    QUANT_KERNELS,
    DecodeLayerKernel,
    LayerArgs,
    StepArgs,
    load_quant_decode_kernel,
)
from tests.kernels.cc import NEEDS_CC
from tests.kernels.decode_cases import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    as_the_runner_gives_it,
    fused_step,
    key_id,
    skip_wide_bf16,
)
from tests.worker.test_models_tiny import _save_hf
from worker.attention import AttentionMetadata, allocate_kv_cache
from worker.cpu_isa import probe
from worker.models.cpu_decode import CpuDecodeStep
from worker.models.cpu_linear import use_decode_linears
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_model
from worker.models.quant import quant_isa, quantize_linears, set_activation_bits, use_quant_kernels

pytestmark = [pytest.mark.isa, NEEDS_CC]


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa-untied",
        "llama-biases-linear-rope",
        "qwen2-qkv-bias-yarn",
        "mistral-sliding-window",
        "llama-head-dim-12",  # attention a head at a time (head_dim no multiple of the vector width)
        "llama-group3-dim64",  # attention compiled for (group, head_dim) as constants
        "mistral-group4-dim64-window",
    ],
)
@pytest.mark.parametrize("seq_lens", [[1], [37], [100, 3, 64, 33, 9]])
def test_fused_step_equals_the_torch_path(
    kernel: DecodeLayerKernel, name: str, seq_lens: list[int], tmp_path: Path, kernel_dir: Path
) -> None:
    skip_wide_bf16(kernel, name)
    _save_hf(name, tmp_path)
    dtype = kernel.dtype
    model, _ = load_model(tmp_path, dtype)
    rng = random.Random(len(seq_lens) * 100 + seq_lens[0])
    got, expected, fused_caches, caches = run_both(model, kernel, seq_lens, rng, kernel_dir)
    assert got.dtype == expected.dtype == dtype
    if dtype == torch.float32:
        # another summation order (and a few-ulp exp): far below what a wrong index would give
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert_caches_close(fused_caches, caches)
        return
    # bf16: torch rounds ~10 times a layer, the kernel twice: within a few % of the values' scale
    for ours, theirs in [(got, expected), *zip(fused_caches, caches, strict=True)]:
        error = (ours.float() - theirs.float()).abs().max().item()
        assert error < 0.05 * theirs.float().abs().max().item(), error


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa-untied",
        "qwen2-qkv-bias-yarn",
        "mistral-sliding-window",
        "llama-group3-dim64",
        "mistral-group4-dim64-window",
    ],
)
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 9)],  # a prompt's first chunk alone
        [(36, 1), (0, 5), (20, 7)],  # a decode, a first chunk, a later chunk (cached context before it)
        [(99, 1), (2, 1), (40, 12), (0, 10)],  # the sliding window (8 tokens) cuts into chunks too
    ],
)
@pytest.mark.parametrize("rows_a_call", [None, 3])
def test_fused_mixed_step_equals_the_torch_path(
    kernel: DecodeLayerKernel,
    name: str,
    chunks: list[tuple[int, int]],
    rows_a_call: int | None,
    tmp_path: Path,
    kernel_dir: Path,
) -> None:
    """Prefill chunks beside decodes, a token a row: each row attends causally, within the window
    (a chunk of 4 rows or more in tiles, attend_tile); also as slices of ``rows_a_call`` rows (a chunk
    split across slices attends to what the slice before it wrote)."""
    skip_wide_bf16(kernel, name)
    _save_hf(name, tmp_path)
    model, _ = load_model(tmp_path, kernel.dtype)
    got, expected, fused_caches, caches = run_step(
        model, kernel, chunks, random.Random(len(chunks)), kernel_dir, rows_a_call
    )
    if kernel.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert_caches_close(fused_caches, caches)
        return
    # bf16: torch rounds ~10 times a layer, the kernel twice; beside a sliding-window chunk an output
    # reached 5.6% of the largest value (the same bits row by row and in tiles), ~2% on average
    for ours, theirs in [(got, expected), *zip(fused_caches, caches, strict=True)]:
        diff, scale = (ours.float() - theirs.float()).abs(), theirs.float().abs()
        assert diff.max() < 0.08 * scale.max(), diff.max()
        assert diff.mean() < 0.03 * scale.mean(), diff.mean()


def assert_caches_close(fused: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """The K/V each path wrote: float32 to its rounding (a later layer's K/V carry the earlier layers'
    rounding, as the hidden states do: 3e-5 in the 192-wide models); a bfloat16 cache rounds the same
    float32 values both paths computed (kv16.h rounds as torch does), so at most one bf16 step apart
    where a value sat on a rounding boundary."""
    for ours, theirs in zip(fused, reference, strict=True):
        assert ours.dtype == theirs.dtype
        tolerance = 1e-4 if ours.dtype == torch.float32 else 8e-3
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("kv_dtype", "isa"), list(QUANT_KERNELS), ids=[key_id(k) for k in QUANT_KERNELS])
@pytest.mark.parametrize(("kind", "bits"), [("q4_1", 16), ("q8_0", 16), ("q4_1", 8)])
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-qkv-bias-yarn", "mistral-sliding-window"])
def test_fused_quantized_step_equals_the_torch_path(
    kv_dtype: torch.dtype, isa: str, kind: str, bits: int, name: str, tmp_path: Path, kernel_dir: Path
) -> None:
    """decode_q.c: the same qlinear kernel inside the fused layer as in the model's QuantLinears."""
    caps = probe()
    if quant_isa(caps) is None or (isa == "avx512_vnni" and quant_isa(caps) != isa):
        pytest.skip(f"this CPU (as probed) cannot run the {isa} build ({caps.describe()})")
    _save_hf(name, tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    quantize_linears(model, kind)
    set_activation_bits(model, bits)
    assert use_quant_kernels(model, caps, kernel_dir) > 0
    kernel = load_quant_decode_kernel(isa, kernel_dir, kv_dtype)
    # decode rows, then prefill chunks beside a decode (a token a row), whole and in slices of 4 rows
    for chunks, rows_a_call in [
        ([(n - 1, 1) for n in (100, 3, 64, 33, 9)], None),
        ([(36, 1), (0, 5), (20, 7)], None),
        ([(36, 1), (0, 5), (20, 7)], 4),
    ]:
        got, expected, _, _ = run_step(model, kernel, chunks, random.Random(5), kernel_dir, rows_a_call)
        error = float((got - expected).norm() / expected.norm())
        # the linears are the same kernel: float32 rounding elsewhere (norms, attention), which int8's
        # coarse rounding mostly absorbs (measured ~3e-7) and int16's passes on (~2e-5), as float32 does.
        # Over a bf16 cache a K/V value on a rounding boundary may land one bf16 step apart on the two
        # paths, and int8 blocks round that on into whole steps: 3e-3 measured (mistral, 5 rows).
        bound = 1e-2 if bits == 8 and kv_dtype == torch.bfloat16 else 1e-4
        assert error < bound, (chunks, error)


def run_both(
    model: LlamaForCausalLM,
    kernel: DecodeLayerKernel,
    seq_lens: list[int],
    rng: random.Random,
    kernel_dir: Path,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One decode step of rows with these context lengths over shuffled blocks (earlier K/V random),
    by the fused kernel and by the model's torch path: (got, expected, their caches after)."""
    return run_step(model, kernel, [(n - 1, 1) for n in seq_lens], rng, kernel_dir)


def run_step(
    model: LlamaForCausalLM,
    kernel: DecodeLayerKernel,
    chunks: list[tuple[int, int]],
    rng: random.Random,
    kernel_dir: Path,
    rows_a_call: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One step of sequences given as (tokens already cached, new tokens), decodes (1 new) first as
    the scheduler lays them out, over shuffled blocks whose earlier K/V are random: by the fused kernel
    (a token a row, each prefill row's context ending at itself; in calls of ``rows_a_call`` rows when
    given) and by the model's torch path. A float32 build reads the weights packed, as the runner
    gives them to it (``use_decode_linears``, on a copy of the model)."""
    cfg, dtype = model.config, kernel.kv_dtype  # the cache's
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seq_lens = [done + new for done, new in chunks]
    rows = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    caches = allocate_kv_cache(
        cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu"
    )
    gen = torch.Generator().manual_seed(7)
    for cache in caches:  # the earlier tokens' K/V: any values attend alike on both paths
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    fused_caches = [c.clone() for c in caches]
    positions = [p for done, new in chunks for p in range(done, done + new)]
    input_ids = [rng.randrange(3, cfg.vocab_size) for _ in positions]
    token_rows = [row for row, (_, new) in zip(rows, chunks, strict=True) for _ in range(new)]
    slots = [
        row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for row, p in zip(token_rows, positions, strict=True)
    ]
    width = max(map(len, rows))
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    meta = AttentionMetadata.build(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        num_decodes=sum(1 for _, new in chunks if new == 1),
        block_size=BLOCK_SIZE,
        sliding_window=cfg.sliding_window,
    )
    row_lens = [p + 1 for p in positions]
    with torch.inference_mode():
        expected = model(torch.tensor(input_ids), torch.tensor(positions), caches, meta)
        step = CpuDecodeStep(as_the_runner_gives_it(model, kernel, kernel_dir), fused_caches, kernel)
        if rows_a_call is not None:
            step.max_rows = rows_a_call
            assert len(positions) > rows_a_call
        in_prompt = [new > 1 for _, new in chunks for _ in range(new)]  # a one-token chunk: a decode
        got = step.run(input_ids, positions, slots, row_lens, token_rows, in_prompt)
    return got, expected, fused_caches, caches


def test_a_float32_step_takes_as_many_rows_a_call_as_the_linears_take_a_pass(
    kernel: DecodeLayerKernel, tmp_path: Path, kernel_dir: Path
) -> None:
    """The float32 builds report linear_f32.c's ROW_BLOCK (one owner of the figure) and a step is
    sliced by it; the bfloat16 ones report none and keep their table's 32."""
    _save_hf("llama-gqa-untied", tmp_path)
    model, _ = load_model(tmp_path, kernel.dtype)
    if kernel.dtype == torch.float32:  # the runner packs them first (use_decode_linears)
        assert use_decode_linears(model, probe(), kernel_dir) > 0
    cfg = model.config
    caches = allocate_kv_cache(
        cfg.num_layers, 4, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, kernel.kv_dtype, "cpu"
    )
    step = CpuDecodeStep(model, caches, kernel)
    if kernel.dtype == torch.float32:
        assert kernel.row_block == 256 and step.max_rows == 256
    else:
        assert kernel.row_block is None and step.max_rows == 32


def test_attention_units_are_a_prompts_rows_or_single_output_rows(kernel: DecodeLayerKernel) -> None:
    """A step's attention units, computed once a step: up to a vector's lanes (16 floats on AVX-512, 8
    on AVX2) of one prompt's consecutive rows make a tile, however few (a chunk's tail of 1 to 3 rows
    too); an output row (a decode, or output tokens recomputed after a preemption, consecutive or not)
    goes alone; prompt rows whose positions follow on from another sequence's, over other blocks,
    start a unit of their own; so do a prompt's rows after its output rows."""
    lanes = 16 if kernel.isa.startswith("avx512") else 8
    # (sequence's first block, first position, rows, in the prompt), consecutive tokens each; the two
    # 6-row runs' positions follow on (6..11, then 12..17) over other blocks: two sequences
    runs = [(0, 7, 1, False), (10, 0, 20, True), (20, 40, 3, True), (30, 5, 6, True), (40, 11, 6, True)]
    runs += [(50, 99, 1, False), (60, 30, 3, False), (70, 8, 2, True)]
    seq_lens, tables, in_prompt = [], [], []
    for first_block, start, rows, prompt in runs:
        for r in range(rows):
            seq_lens.append(start + r + 1)
            tables.append([first_block + b for b in range(8)])
            in_prompt.append(prompt)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    table = torch.tensor(tables, dtype=torch.int64)
    flags = torch.tensor(in_prompt, dtype=torch.uint8)
    layer = LayerArgs(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    step = StepArgs(num_rows=len(seq_lens), table_width=8)
    step.block_tables, step.seq_lens, step.in_prompt = table.data_ptr(), lens.data_ptr(), flags.data_ptr()
    starts = torch.empty(len(seq_lens) + 1, dtype=torch.int64)
    kernel.attention_units(layer, step, starts)
    expected = [0, *range(1, 21, lanes)]  # the decode; the 20-row prompt chunk in tiles of `lanes` rows
    expected += [21, 24, 30, 36]  # 3 rows: a tile; two 6-row tiles; the decode
    expected += [37, 38, 39, 40]  # three recomputed output rows alone; a 2-row prompt tile
    assert step.num_units == len(expected)
    assert starts[: step.num_units + 1].tolist() == [*expected, 42]
    step.in_prompt = None  # no flags: every row an output row
    kernel.attention_units(layer, step, starts)
    assert starts[: step.num_units + 1].tolist() == list(range(43))
    with pytest.raises(ValueError, match="int64"):
        kernel.attention_units(layer, step, torch.empty(3, dtype=torch.int64))


def test_a_step_past_max_rows_goes_in_slices_unless_its_prompt_rows_are_long(
    kernel: DecodeLayerKernel, tmp_path: Path, kernel_dir: Path
) -> None:
    """Up to ``max_rows`` rows always; more in slices, while the prompt rows' mean context is within
    the build's bound (the torch path's SDPA is ahead on long prompts only; bfloat16: no prompt rows):
    output rows never send a step to the torch path, however long their context (64 decodes at ~1,100
    tokens ran 5.3x faster in slices)."""
    _save_hf("llama-gqa-untied", tmp_path)
    model, _ = load_model(tmp_path, kernel.dtype)
    step = fused_step(model, kernel, kernel_dir)
    rows = step.max_rows + 1
    assert step.can_run([50_000] * step.max_rows, [False] * step.max_rows)
    assert step.can_run([50_000] * step.max_rows, [True] * step.max_rows)
    bound = step.sliced_mean_context
    assert bound is not None
    assert step.can_run([50_000] * rows, [False] * rows)  # decodes only
    if bound == 0:  # bfloat16: decode-only steps in slices, prompts past 32 rows the torch path
        assert not step.can_run([10] * rows, [True] + [False] * (rows - 1))
        return
    assert step.can_run([bound] * rows, [True] * rows)
    assert not step.can_run([bound + 1] * rows, [True] * rows)
    # A cold prompt's first chunk at the default token budget (mean 1,024.5) is fused on every build
    # that slices prompts: the 1,024 bound sent it through the torch path, 1.2-1.6x slower.
    chunk = list(range(1, 2049))
    assert step.can_run(chunk, [True] * len(chunk))
    assert step.can_run([50_000] * (rows - 1) + [bound], [False] * (rows - 1) + [True])  # a short prompt
