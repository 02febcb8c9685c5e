"""The project's C++ Q4_1 kernel (``gpu_worker/csrc/q4_1_linear.cpp``), and its
Q8_0 form for an LM head, against a reference dequantize-then-matmul in float64:
every shape SmolLM2 has, odd row counts and output counts, both of the kernel's
paths and each way it splits a call's rows between tiles; the same bits for a
row alone and inside any batch, a 512-row prefill included; the packed layout as
the kernel reads it; what it refuses; and the op inside a compiled graph. Then
both forms with activations rounded to int16 (``--weights q4_1_i16``) against the
same rounding done here, and against the exact product."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.q4_1_kernel import (
    PANEL_ROWS,
    OffGridError,
    Q41Matrix,
    Q80Matrix,
    kernel_unavailable_reason,
    missing_cpu_flags,
    unavailable_reason,
)
from gpu_worker.quantized_linear import PackError, Q41I16Linear, Q41Linear, unsupported_reason

# Skipped only on a CPU that cannot run the kernel; where it can, a kernel that does
# not build or load fails every test (the fixture below), never skips.
pytestmark = pytest.mark.skipif(
    bool(missing_cpu_flags()), reason=f"this CPU lacks {', '.join(missing_cpu_flags())}"
)


@pytest.fixture(autouse=True)
def _kernel_loaded() -> None:
    assert kernel_unavailable_reason() is None


# SmolLM2-135M's matrices [out, in]: qkv, o, gate_up, down; then odd ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (7, 64), (33, 32), (1, 96)]
# The kernel decodes into registers only up to 4 rows (kFewRows; a lone row two
# panels at a time, which 1 and 3 panels leave odd), and from 5 rows has 2 to 4
# rows decode into a buffer that tiles of 3 to 6 rows then read: 5 is 2 + 3, 6 is
# 3 + 3, 7 is 4 + 3, 10 is 4 + 6, 11 is 4 + 4 + 3, 17 is 4 + 5 + 4 + 4.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 17, 64]


def q4_1_weights(out: int, columns: int, seed: int = 0) -> torch.Tensor:
    """A matrix on llama.cpp's Q4_1 grid: per 32, levels 0..15 (both ends present,
    as llama.cpp's quantizer makes them), an fp16 scale and an fp16 minimum."""
    generator = torch.Generator().manual_seed(seed)
    groups = columns // 32
    levels = torch.randint(0, 16, (out, groups, 32), generator=generator).float()
    levels[..., 5], levels[..., 27] = 0, 15
    scale = (torch.rand(out, groups, 1, generator=generator) * 0.02 + 1e-4).half().float()
    minimum = (-torch.rand(out, groups, 1, generator=generator) * 0.15).half().float()
    return (levels * scale + minimum).reshape(out, columns)


@pytest.mark.parametrize(("out", "columns"), SHAPES)
def test_the_kernel_is_exact_to_fp32_rounding_and_the_same_for_a_row_alone(out, columns):
    weight = q4_1_weights(out, columns)
    assert_exact_and_alone(Q41Matrix.pack(weight), weight, ROWS)


def assert_exact_and_alone(
    matrix: Q41Matrix | Q80Matrix, weight: torch.Tensor, row_counts: list[int]
) -> None:
    """``matrix`` holds ``weight`` exactly, its products of each number of rows are
    within fp32 rounding of float64's, and each row's bits are its own alone."""
    out, columns = weight.shape
    assert torch.equal(matrix.dequantized(), weight)  # the packing loses nothing
    generator = torch.Generator().manual_seed(1)
    for rows in row_counts:
        x = torch.randn(rows, columns, generator=generator)
        y = matrix(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        reference = x.double() @ weight.double().T
        # fp32 rounding of sums of `columns` products: a few ulps of the magnitudes summed.
        bound = 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-30
        assert bool(((y.double() - reference).abs() <= bound).all()), rows
        # Batch invariance: each row's bits whatever else is in the call.
        alone = torch.cat([matrix(x[row : row + 1]) for row in range(rows)])
        assert torch.equal(y, alone), rows


def test_a_prefill_gets_each_rows_bits_alone() -> None:
    """One arithmetic at every size: a 512-row prefill through the buffered path
    gives each row exactly what a decode step of that row alone gives."""
    weight = q4_1_weights(960, 576, seed=3)
    matrix = Q41Matrix.pack(weight)
    x = torch.randn(512, 576, generator=torch.Generator().manual_seed(4))
    y = matrix(x)
    rows = [0, 1, 5, 255, 506, 511]
    assert torch.equal(y[rows], torch.cat([matrix(x[row : row + 1]) for row in rows]))
    assert torch.equal(y[100:104], matrix(x[100:104]))
    bound = 1e-6 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((y.double() - x.double() @ weight.double().T).abs() <= bound).all())


def test_the_packed_layout_is_the_one_the_kernel_reads() -> None:
    """Panels of 16 outputs (the last padded with zeros), blocks of 8 columns, a
    32-bit lane per output holding a block's levels, column j in bits 4j..4j+3;
    scales and minimums per panel and group (csrc/q4_1_linear.cpp's layout)."""
    weight = q4_1_weights(20, 64, seed=5)  # two panels, the second of 4 outputs
    matrix = Q41Matrix.pack(weight)
    assert matrix.levels.shape == (2, 8, 64) and matrix.scales.shape == (2, 2, PANEL_ROWS)
    assert matrix.out_features == 20 and matrix.in_features == 64
    lanes = matrix.levels.view(torch.int32).reshape(2, 8, 2, 8)  # little-endian lanes
    output, column = 17, 45  # panel 1, lane 1 of outputs 0-7; block 5, column 5; group 1
    level = (int(lanes[1, 5, 0, 1]) >> (4 * 5)) & 0x0F
    scale, minimum = float(matrix.scales[1, 1, 1]), float(matrix.minimums[1, 1, 1])
    assert weight[output, column] == torch.tensor(level * scale + minimum, dtype=torch.float32)
    # Outputs 20-31 are padding: lanes 4-7 of the second panel's outputs 0-7, all of 8-15.
    padding = torch.cat((lanes[1, :, 0, 4:].flatten(), lanes[1, :, 1].flatten()))
    assert not bool(padding.any() or matrix.scales[1, :, 4:].any())
    assert not bool(matrix.minimums[1, :, 4:].any())
    assert torch.equal(matrix.dequantized(), weight)


def test_a_non_contiguous_input_and_numeric_edges() -> None:
    weight = q4_1_weights(64, 128)
    matrix = Q41Matrix.pack(weight)
    x = torch.randn(128, 6)[:, :3].T  # [3, 128], not contiguous
    assert torch.equal(matrix(x), matrix(x.contiguous()))
    assert matrix(torch.empty(0, 128)).shape == (0, 64)
    edges = torch.zeros(3, 128)
    edges[0, 0] = float("inf")
    edges[1, 5] = float("nan")
    edges[2] = torch.finfo(torch.float32).tiny  # the smallest normal
    y = matrix(edges)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isfinite(y[2]).all())
    assert not bool(torch.isfinite(y[0]).all())
    # Subnormal and huge activations: no trap. Near fp32's largest value the
    # kernel's partial sums (d * sum(q x) and m * sum(x)) overflow, and the row is
    # non-finite (the sampler then ends that request with an error), never a
    # wrong finite number.
    extremes = torch.tensor([[1e-45] * 128, [1e-40] * 128, [3e38] * 128, [-3e38] * 128])
    y = matrix(extremes)
    assert bool(torch.isfinite(y[:2]).all()) and float(y[:2].abs().max()) < 1e-30
    reference = extremes.double() @ weight.double().T
    finite = torch.isfinite(y)
    assert bool(torch.allclose(y[finite].double(), reference[finite], rtol=1e-5))


def test_the_op_refuses_bad_inputs_with_a_message() -> None:
    matrix = Q41Matrix.pack(q4_1_weights(16, 64))
    op = torch.ops.orcapod.q4_1_linear
    with pytest.raises(RuntimeError, match="x has 32 columns, W has 64"):
        matrix(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="2-D fp32"):
        matrix(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D fp32"):
        matrix(torch.randn(64))
    levels, scales, minimums = matrix.levels, matrix.scales, matrix.minimums
    with pytest.raises(RuntimeError, match="contiguous fp16"):
        op(torch.randn(1, 64), levels, scales.float(), minimums, 16)
    with pytest.raises(RuntimeError, match="contiguous fp16"):
        op(torch.randn(1, 64), levels, scales, minimums[:, :1], 16)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        op(torch.randn(1, 48), torch.zeros(1, 6, 64, dtype=torch.uint8), scales, minimums, 16)
    with pytest.raises(RuntimeError, match=r"levels must be a contiguous uint8 tensor \[panels"):
        op(torch.randn(1, 64), levels.reshape(1, -1), scales, minimums, 16)
    with pytest.raises(RuntimeError, match="17 outputs do not fill 1 panels of 16"):
        op(torch.randn(1, 64), levels, scales, minimums, 17)


def test_matrices_off_the_grid_are_not_packed() -> None:
    on_grid = q4_1_weights(8, 64)
    with pytest.raises(OffGridError, match="not a multiple of 32"):
        Q41Matrix.pack(torch.randn(8, 40))
    with pytest.raises(OffGridError, match="not on a 4-bit grid"):
        Q41Matrix.pack(torch.randn(8, 64))  # the tests' random models
    nudged = on_grid.clone()
    nudged[3, 7] += 1e-2 * float(nudged[3].abs().max())
    with pytest.raises(OffGridError, match="not on a 4-bit grid"):
        Q41Matrix.pack(nudged)
    with pytest.raises(OffGridError):
        Q41Matrix.pack(torch.full((8, 64), float("nan")))
    with pytest.raises(OffGridError, match="fp16's range"):
        Q41Matrix.pack(on_grid * 1e6)
    # Constant groups (a zero matrix) are on the grid: levels 0, scale 0.
    zeros = Q41Matrix.pack(torch.zeros(8, 64))
    assert torch.equal(zeros(torch.randn(2, 64)), torch.zeros(2, 8))
    # Through the format: a PackError, so the worker falls back with one log line.
    with pytest.raises(PackError, match="not on a 4-bit grid"):
        Q41Linear.pack(torch.randn(8, 64))
    head = Q41Linear.pack_head(torch.randn(64, 32))
    assert head.weight_format == "float16"  # a head off the grid keeps fp16


def test_a_cpu_without_avx2_fma_or_f16c_or_a_failed_build_is_told_so() -> None:
    assert missing_cpu_flags("flags\t\t: fpu sse2 avx avx2 fma f16c\n") == []
    assert missing_cpu_flags("flags\t\t: fpu sse2 avx\n") == ["avx2", "fma", "f16c"]
    assert missing_cpu_flags("processor : 0\n") == ["avx2", "fma", "f16c"]

    def never(): raise AssertionError("not loaded on a CPU that cannot run it")  # fmt: skip

    reason = unavailable_reason(["avx2", "f16c"], never)
    assert reason == "the Q4_1 kernel needs avx2, f16c, which this CPU lacks"

    def failing_build() -> None:  # what torch.utils.cpp_extension raises
        raise RuntimeError("Error building extension 'orcapod_q4_1'\n[1/2] c++ ...")

    reason = unavailable_reason([], failing_build)
    assert reason == (
        "the Q4_1 kernel could not be built or loaded: Error building extension 'orcapod_q4_1'"
    )
    assert unavailable_reason([], lambda: None) is None
    assert unsupported_reason(torch.device("cpu"), torch.float32, weight_format="q4_1") is None
    reason = unsupported_reason(torch.device("cpu"), torch.bfloat16, weight_format="q4_1")
    assert reason is not None and "fp32 activations" in reason


def test_a_compiled_graph_calls_the_op_and_gets_the_same_bits() -> None:
    """The op is opaque to inductor (its shape rule registered): the graph around
    it fuses, the kernel runs as it does eagerly."""
    matrix = Q41Linear.pack(q4_1_weights(96, 64))

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(matrix(x * 2.0)) + 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = torch.randn(3, 64)
    assert torch.equal(compiled(x), step(x))


def q8_0_weights(out: int, columns: int, seed: int = 0) -> torch.Tensor:
    """A matrix on llama.cpp's Q8_0 grid: per 32, levels -127..127 (the largest
    |level| 127, as llama.cpp's quantizer makes it) and an fp16 scale."""
    generator = torch.Generator().manual_seed(seed)
    groups = columns // 32
    levels = torch.randint(-127, 128, (out, groups, 32), generator=generator).float()
    levels[..., 11] = 127 * torch.where(torch.rand(out, groups, generator=generator) < 0.5, -1, 1)
    scale = (torch.rand(out, groups, 1, generator=generator) * 1e-3 + 1e-5).half().float()
    return (levels * scale).reshape(out, columns)


# The packaged model's LM head [vocab, hidden] (its tied Q8_0 embedding), then odd shapes.
Q8_0_SHAPES = [(49152, 576), (960, 576), (7, 64), (33, 32)]
Q8_0_ROWS = [1, 2, 3, 4, 5, 7, 8, 17]


@pytest.mark.parametrize(("out", "columns"), Q8_0_SHAPES)
def test_the_q8_0_form_is_exact_to_fp32_rounding_and_the_same_for_a_row_alone(out, columns):
    weight = q8_0_weights(out, columns)
    # The whole head at a lone row and on both sides of the buffered path's threshold.
    row_counts = Q8_0_ROWS if out < 10_000 else [1, 5]
    assert_exact_and_alone(Q80Matrix.pack(weight), weight, row_counts)


def test_the_q8_0_layout_is_the_one_the_kernel_reads() -> None:
    """Panels of 16 outputs (the last padded with zeros), column by column the
    panel's 16 levels; scales per panel and group."""
    weight = q8_0_weights(20, 64, seed=5)
    matrix = Q80Matrix.pack(weight)
    assert matrix.levels.shape == (2, 8, 128) and matrix.levels.dtype == torch.int8
    assert matrix.scales.shape == (2, 2, PANEL_ROWS) and matrix.in_features == 64
    output, column = 17, 45  # panel 1, output 1; column 45, group 1
    level = int(matrix.levels.reshape(2, 64, 16)[1, column, 1])
    assert weight[output, column] == level * float(matrix.scales[1, 1, 1])
    assert not bool(matrix.levels.reshape(2, 64, 16)[1, :, 4:].any())
    assert not bool(matrix.scales[1, :, 4:].any())
    assert matrix.num_bytes == 2 * 16 * 64 + 2 * 2 * 16 * 2


def test_an_lm_head_on_the_q8_0_grid_takes_the_kernel_and_off_it_keeps_fp16() -> None:
    weight = q8_0_weights(40, 64, seed=7)
    head = Q41Linear.pack_head(weight)
    assert isinstance(head, Q41Linear) and isinstance(head.matrix, Q80Matrix)
    x = torch.randn(3, 64)
    assert torch.equal(head(x), head.matrix(x))
    assert isinstance(Q41Linear.pack_head(q4_1_weights(40, 64)).matrix, Q41Matrix)
    nudged = weight.clone()
    nudged[3, 7] += 1e-2 * float(nudged[3].abs().max())
    with pytest.raises(OffGridError, match="not on an 8-bit grid"):
        Q80Matrix.pack(nudged)
    assert Q41Linear.pack_head(nudged).weight_format == "float16"
    with pytest.raises(OffGridError, match="fp16 does not hold"):
        Q80Matrix.pack(weight * 1.1)  # on a grid, but its scales are not fp16
    with pytest.raises(OffGridError):
        Q80Matrix.pack(torch.full((8, 64), float("nan")))
    zeros = Q80Matrix.pack(torch.zeros(8, 64))
    assert torch.equal(zeros(torch.randn(2, 64)), torch.zeros(2, 8))


def test_the_q8_0_op_refuses_bad_inputs_and_takes_numeric_edges() -> None:
    matrix = Q80Matrix.pack(q8_0_weights(16, 64))
    op = torch.ops.orcapod.q8_0_linear
    with pytest.raises(RuntimeError, match="q8_0_linear: x has 32 columns, W has 64"):
        matrix(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="contiguous fp16"):
        op(torch.randn(1, 64), matrix.levels, matrix.scales.float(), 16)
    with pytest.raises(RuntimeError, match=r"contiguous int8 tensor \[panels, in / 8, 128\]"):
        op(torch.randn(1, 64), matrix.levels.view(torch.uint8), matrix.scales, 16)
    with pytest.raises(RuntimeError, match="17 outputs do not fill 1 panels of 16"):
        op(torch.randn(1, 64), matrix.levels, matrix.scales, 17)
    edges = torch.zeros(3, 64)
    edges[0, 0] = float("inf")
    edges[1, 5] = float("nan")
    edges[2] = torch.finfo(torch.float32).tiny
    y = matrix(edges)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isfinite(y[2]).all())
    assert not bool(torch.isfinite(y[0]).all())
    # Subnormal and huge activations: no trap; a group's sum near fp32's largest
    # value overflows to a non-finite row, never a wrong finite number.
    extremes = torch.tensor([[1e-45] * 64, [1e-40] * 64, [3e38] * 64, [-3e38] * 64])
    y = matrix(extremes)
    assert bool(torch.isfinite(y[:2]).all()) and float(y[:2].abs().max()) < 1e-30
    reference = extremes.double() @ matrix.dequantized().double().T
    finite = torch.isfinite(y)
    assert bool(torch.allclose(y[finite].double(), reference[finite], rtol=1e-5))


@pytest.mark.parametrize(
    "packed",
    [
        lambda: Q41Linear.pack_head(q8_0_weights(96, 64)),  # the Q8_0 op
        lambda: Q41I16Linear.pack(q4_1_weights(48, 64)),  # the int16 activations' ops
        lambda: Q41I16Linear.pack_head(q8_0_weights(96, 64)),
    ],
    ids=["q8_0", "q4_1_i16", "q8_0_i16"],
)
def test_a_compiled_graph_calls_the_q8_0_and_int16_ops_and_gets_the_same_bits(packed) -> None:
    matrix = packed()

    def step(x: torch.Tensor) -> torch.Tensor:
        return matrix(torch.nn.functional.silu(x)) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = torch.randn(1, 64)
    assert torch.equal(compiled(x), step(x))


# --- Q4_1 times activations rounded to int16 (--weights q4_1_i16) -------------------------


def rounded_to_16_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's groups of 32 as the kernel rounds them: int16 levels v (as fp32) and
    the fp32 scale e = max|x| / 32767 a group, x ~ v * e (ties to even)."""
    groups = x.reshape(len(x), -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 32767
    levels = torch.where(scale > 0, torch.round(groups / scale), torch.zeros_like(groups))
    return levels.clamp(-32767, 32767), scale


def assert_16_bit_products_and_alone(
    matrix: Q41Matrix | Q80Matrix, weight: torch.Tensor, row_counts: list[int]
) -> None:
    """The int16 form's product of each number of rows is the rounded x's integer
    products scaled, plus (Q4_1) the exact minimum term, to fp32 rounding; off the
    exact product by no more than x's rounding accounts for; and each row's bits are
    its own alone."""
    out, columns = weight.shape
    minimums = torch.zeros_like(weight, dtype=torch.float64)  # Q8_0: none
    if isinstance(matrix, Q41Matrix):
        minimums = torch.repeat_interleave(
            weight.reshape(out, -1, 32).amin(-1), 32, dim=1
        ).double()  # each group's m: its smallest weight (level 0 is present in every group)
    generator = torch.Generator().manual_seed(2)
    for rows in row_counts:
        x = torch.randn(rows, columns, generator=generator)
        x[:, 3] *= 200  # an outlier channel, as real activations have
        y = matrix.with_16_bit_activations(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        levels, scale = rounded_to_16_bits(x)
        rounded = (levels * scale).reshape(rows, columns).double()
        levels_part = weight.double() - minimums
        reference = rounded @ levels_part.T + x.double() @ minimums.T
        bound = 1e-6 * (rounded.abs() @ levels_part.abs().T + x.double().abs() @ minimums.abs().T)
        assert bool(((y.double() - reference).abs() <= bound + 1e-30).all()), rows
        # Against the exact product: at most half a level of each x (1.5e-5 of its
        # group's largest), times |w|.
        exact = x.double() @ weight.double().T
        half_levels = torch.repeat_interleave(scale.reshape(rows, -1), 32, dim=1).double() / 2
        rounding = half_levels @ weight.double().abs().T
        magnitude = x.double().abs() @ weight.double().abs().T
        assert bool(((y.double() - exact).abs() <= rounding + 1e-6 * magnitude).all()), rows
        alone = torch.cat([matrix.with_16_bit_activations(x[row : row + 1]) for row in range(rows)])
        assert torch.equal(y, alone), rows


@pytest.mark.parametrize(("out", "columns"), SHAPES)
def test_the_16_bit_form_is_its_rounded_products_and_the_same_for_a_row_alone(out, columns):
    weight = q4_1_weights(out, columns)
    assert_16_bit_products_and_alone(Q41Matrix.pack(weight), weight, [1, 2, 3, 4, 5, 7, 9, 17, 64])


@pytest.mark.parametrize(("out", "columns"), Q8_0_SHAPES)
def test_the_q8_0_16_bit_form_is_its_rounded_products_and_the_same_for_a_row_alone(out, columns):
    weight = q8_0_weights(out, columns)
    row_counts = Q8_0_ROWS if out < 10_000 else [1, 5]
    assert_16_bit_products_and_alone(Q80Matrix.pack(weight), weight, row_counts)


def test_the_16_bit_form_takes_numeric_edges_and_refuses_bad_inputs() -> None:
    weight = q4_1_weights(64, 128)
    matrix = Q41Matrix.pack(weight)
    x = torch.randn(128, 6)[:, :3].T  # [3, 128], not contiguous
    assert torch.equal(
        matrix.with_16_bit_activations(x), matrix.with_16_bit_activations(x.contiguous())
    )
    assert matrix.with_16_bit_activations(torch.empty(0, 128)).shape == (0, 64)
    edges = torch.zeros(4, 128)
    edges[0, 0] = float("inf")
    edges[1, 5] = float("nan")
    edges[2] = torch.finfo(torch.float32).tiny  # the smallest normal
    y = matrix.with_16_bit_activations(edges)
    assert not bool(torch.isfinite(y[0]).any()) and bool(torch.isnan(y[1]).all())
    assert bool(torch.isfinite(y[2]).all()) and bool(torch.equal(y[3], torch.zeros(64)))
    # Subnormal activations round to zero levels (their group's minimum term stays
    # exact); near fp32's largest value a group's sum overflows to a non-finite row,
    # never a wrong finite number.
    extremes = torch.tensor([[1e-45] * 128, [1e-40] * 128, [3e38] * 128, [-3e38] * 128])
    y = matrix.with_16_bit_activations(extremes)
    assert bool(torch.isfinite(y[:2]).all()) and float(y[:2].abs().max()) < 1e-30
    reference = extremes.double() @ weight.double().T
    finite = torch.isfinite(y)
    assert bool(torch.allclose(y[finite].double(), reference[finite], rtol=1e-4))
    op = torch.ops.orcapod.q4_1_i16_linear
    with pytest.raises(RuntimeError, match="q4_1_i16_linear: x has 32 columns, W has 128"):
        op(torch.randn(2, 32), matrix.levels, matrix.scales, matrix.minimums, 64)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        op(torch.randn(2, 128).half(), matrix.levels, matrix.scales, matrix.minimums, 64)
    with pytest.raises(RuntimeError, match="contiguous fp16"):
        op(torch.randn(1, 128), matrix.levels, matrix.scales, matrix.minimums.float(), 64)
    with pytest.raises(RuntimeError, match="65 outputs do not fill 4 panels of 16"):
        op(torch.randn(1, 128), matrix.levels, matrix.scales, matrix.minimums, 65)


def test_the_q8_0_16_bit_form_takes_numeric_edges_and_refuses_bad_inputs() -> None:
    weight = q8_0_weights(16, 64)
    matrix = Q80Matrix.pack(weight)
    edges = torch.zeros(4, 64)
    edges[0, 0] = float("inf")
    edges[1, 5] = float("nan")
    edges[2] = torch.finfo(torch.float32).tiny
    y = matrix.with_16_bit_activations(edges)
    assert not bool(torch.isfinite(y[0]).any()) and bool(torch.isnan(y[1]).all())
    assert bool(torch.isfinite(y[2]).all()) and bool(torch.equal(y[3], torch.zeros(16)))
    # Subnormal activations round to zero levels, so to a zero row (no minimum term);
    # huge ones stay finite where their products do.
    extremes = torch.tensor([[1e-45] * 64, [1e-40] * 64, [3e38] * 64, [-3e38] * 64])
    y = matrix.with_16_bit_activations(extremes)
    assert bool(torch.equal(y[:2], torch.zeros(2, 16)))
    reference = extremes.double() @ weight.double().T
    finite = torch.isfinite(y)
    assert bool(torch.allclose(y[finite].double(), reference[finite], rtol=1e-4))
    op = torch.ops.orcapod.q8_0_i16_linear
    with pytest.raises(RuntimeError, match="q8_0_i16_linear: x has 32 columns, W has 64"):
        matrix.with_16_bit_activations(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match=r"contiguous int8 tensor \[panels, in / 8, 128\]"):
        op(torch.randn(1, 64), matrix.levels.view(torch.uint8), matrix.scales, 16)
    with pytest.raises(RuntimeError, match="17 outputs do not fill 1 panels of 16"):
        op(torch.randn(1, 64), matrix.levels, matrix.scales, 17)
