"""Weight matrices packed once at load into fewer bytes per token (CPU).

The forward pass calls ``linear(x, weight)`` for every projection and the LM
head; ``weight`` is either a plain tensor (``F.linear``: the exact path) or a
matrix packed for one of the x86 kernels: the project's own Q4_1 one, or those
that ship in every x86 torch wheel (fbgemm's fp16 one, and torch's own 4-bit one):

- ``q4_1``: for weights on llama.cpp's Q4_1 grid (the packaged model's layers),
  held exactly (4-bit levels, an fp16 scale and minimum per 32) for
  ``q4_1_kernel.py``'s C++ kernel; fp32 activations and accumulation, the same
  arithmetic for a row alone or in a batch of any size, prefills included. An
  LM head off that grid but on Q8_0's (the packaged one) takes the same kernel's
  Q8_0 form, exactly (half of fp16's bytes); one on neither is kept as the
  float16 format keeps it.

- ``float16``: weights rounded to fp16 once; activations and accumulation
  stay fp32 (about 0.02 % per layer, independent of the batch).
- ``int4``: for weights that already lie on a 4-bit grid per 32 values (a
  scale and a minimum per group: llama.cpp's Q4_1, the packaged model's
  format), held exactly in 4 bits for torch's ``_weight_int4pack_mm_for_cpu``
  with bf16 activations, scales and output (about 0.3 % per layer); calls of
  more rows than ``INT4_MAX_ROWS`` take a bf16 copy of the same matrix
  instead, where the 4-bit kernel is slower than a dense one. Only on CPUs
  with avx512_bf16: elsewhere bf16 is emulated, slower than fp32. A tied LM
  head that is not on the grid (the packaged model's embedding is Q8_0)
  gets fp16 for few rows and the bf16 copy for more.

Whatever the format, an LM head on llama.cpp's Q8_0 grid also keeps its exact
int8 form (``Int8GroupLinear``) on AVX-512 CPUs, which compiled graphs read
instead of the format's kernel (``WithTracedForm``): half of fp16's bytes,
one fused loop.

``pack_weights`` turns loaded fp32 ``ModelWeights`` into packed ones, or
hands them back unchanged with one log line per format tried saying why it
cannot: not the CPU, not fp32, no fbgemm, no bf16 units (int4), a matrix the
format cannot hold, or logits of a probe prompt that stray from the loaded
weights'. Why these kernels and not others, and what they cost in agreement:
docs/performance.md, *Weights against float32*; how they were chosen:
docs/history/benchmarks-notebook.md, *fewer weight bytes per token* (AVX2) and
*int4 on a Xeon with bf16 units, side by side with llama.cpp* (AVX-512 with BF16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import structlog
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gpu_worker.device import cpu_has_native_bf16
from gpu_worker.q4_1_kernel import (
    OffGridError,
    Q41Matrix,
    Q80Matrix,
    kernel_unavailable_reason,
    q8_0_grid,
)
from shared.settings import WEIGHT_FORMATS

if TYPE_CHECKING:
    from gpu_worker.weights import ModelWeights

# What ``auto`` tries on the CPU, in order, the first that packs and passes the
# probe winning (docs/performance.md has the figures), on every CPU alike.
# q4_1: the packaged model's layers as its file holds them, a third of
# float16's bytes, for the project's kernel, whose fp32 arithmetic is the same
# for a row alone or in a batch of any size (a request's answer does not
# depend on what runs beside it). Measured on 2 cores, q4_1 against float16:
# a lone decode 1.2-1.3x float16's speed (1.1x held to AVX2), a step of 64
# decodes and a 512-token prefill no slower; every greedy answer of
# bench/quant_agreement.py's chats but one identical to float32's (float16:
# all), its first-step logits closer to float32's than float16's. A checkpoint
# off the Q4_1 grid (safetensors, other GGUF types) does not pack, and a CPU
# without AVX2, FMA and F16C or a kernel that did not build cannot run it:
# one ``weights_not_packed`` line, then float16.
# float16: every greedy token of 20 chat prompts identical to fp32's, logits
# within 0.15 %, 1.6-1.8x fp32's decode at batch 1 (AVX2), the same
# arithmetic row by row.
# int4 is not tried, though it reads a quarter of float16's bytes where it
# runs: it rounds every layer's output to bf16, and by one kernel at up to 8
# rows and another above, so a greedy answer can change with the batch it ran
# in. Measured on an avx512_bf16 EPYC: "What is rain?" opens with a near-tie
# (fp32 logits 23.940 against 23.934), which int4 resolves one way alone and
# the other beside other chats. An answer that depends on who else is served
# is not a default; ``--weights int4`` is a choice.
# q4_1_i16 is not tried either, for the same reason: the same matrices with
# the activations of the layers and the head rounded to int16 per 32 values,
# the products in integers, a lone decode about 1.3x q4_1's speed (held to
# AVX2: tg128 145 against 113 tok/s, where llama.cpp's Q4_1 made 125), every
# greedy answer of bench/quant_agreement.py's 20 chats alone float32's. But
# each rounding turns the few-ulp differences between a decode alone (the
# lone graph) and in a batch (eager steps, the batch's attention) into
# differences of half a level, and 1 of the 20 chats parted from its lone
# answer when batched (float16 and q4_1: none); ``--weights q4_1_i16`` is a
# choice.
AUTO_CPU_FORMATS = ("q4_1", "float16")
# How far two computations of the same step may stray, relative to the largest
# logit, where the layers round to bf16 (int4): bf16 keeps three significant
# digits, and two bf16 computations rounding in other places drift apart over
# 30 layers (SmolLM2's batch graph: 1.7 %, while both were 7-9 % from the fp32
# logits of the same step; the eager step beside the paged attention, which
# differs from SDPA by 1e-6, 0.8 %); a path reading the wrong data strays by
# far more, or gives NaN.
BF16_LOGIT_ERROR = 5e-2
# The 4-bit groups: one scale and one minimum per this many weights of a row.
INT4_GROUP_SIZE = 32
# Calls of at most this many rows take the 4-bit kernel, larger ones the bf16
# copy: measured crossover between 8 and 16 rows on SmolLM2's shapes
# (docs/history/benchmarks-notebook.md, *int4 on a Xeon with bf16 units*).
INT4_MAX_ROWS = 8
# The int8 groups of an LM head on llama.cpp's Q8_0 grid, and how many rows its
# layout interleaves: one AVX-512 vector of fp32. Measured on SmolLM2's head
# (49152 x 576, 2 threads): 1.1 ms a token with AVX-512, against 1.3-2.2 for
# fbgemm's fp16; the same loop in AVX2 code took 3.9 ms, so only CPUs whose
# vector code torch and inductor run in AVX-512 take it
# (docs/history/benchmarks-notebook.md, *the LM head and attention inside the
# compiled decode*).
INT8_GROUP_SIZE = 32
INT8_ROW_TILE = 16
INT8_GROUP_CPU_CAPABILITIES = ("AVX512",)
# Packed weights whose probe logits differ from the loaded weights' by more
# than this (relative L2) are not used. Measured: float16 0.04 % on SmolLM2
# and 0.03 % on the tests' tiny model.
MAX_PROBE_LOGIT_ERROR = 0.01

_log = structlog.get_logger(__name__)


class PackError(ValueError):
    """A matrix that a packed format cannot hold faithfully."""


@dataclass(frozen=True)
class Float16Linear:
    """``[out, in]`` weights rounded to fp16: for ``quantized::linear_dynamic_fp16``
    eagerly, and as a plain fp16 tensor inside a compiled graph (layers only)."""

    packed: Any  # fbgemm's PackedGemmMatrixFP16 (a TorchScript object)
    weight: torch.Tensor | None  # the same [out, in] fp16, which torch.compile can trace
    out_features: int
    in_features: int

    weight_format: ClassVar[str] = "float16"
    # A graph of a batch would read every weight once per row through the traced
    # form (products and a sum), and fbgemm's object not at all.
    traceable_for_batches: ClassVar[bool] = False
    # Above how many rows a call takes another kernel: never (fbgemm's fp16 one).
    kernel_changes_above: ClassVar[int | None] = None
    # A Q8_0 head's exact int8 form for graphs (``_pack_head``): fbgemm's object cannot
    # be traced, and the int8 form is faster in a graph than fp16 products.
    head_takes_traced_form: ClassVar[bool] = True

    @classmethod
    def pack(cls, weight: torch.Tensor, traceable: bool = True) -> Float16Linear:
        """Round ``weight`` [out, in] (fp32) to fp16; ``traceable`` keeps the plain
        copy a compiled graph reads (the LM head, which no graph traces as fp16, need not)."""
        largest = float(weight.abs().max()) if weight.numel() else 0.0
        if largest > torch.finfo(torch.float16).max:
            raise PackError(f"holds {largest:.3g}, beyond fp16's range")
        packed = torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), None)
        plain = weight.to(torch.float16).contiguous() if traceable else None
        return cls(packed, plain, int(weight.shape[0]), int(weight.shape[1]))

    @classmethod
    def pack_head(cls, weight: torch.Tensor) -> Float16Linear:
        """The LM head [vocab, hidden] (fp32) without the plain copy, which no graph
        traces (a head that is fbgemm's alone runs after the graph)."""
        return cls.pack(weight, traceable=False)

    @property
    def traceable(self) -> bool:
        """Whether a compiled graph can trace a call of one row: through the plain copy."""
        return self.weight is not None

    def computes_dense_bf16(self, num_rows: int) -> bool:
        """Whether a compiled graph's calls of ``num_rows`` rows are a dense bf16
        matmul: never (fp16 weights, fp32 arithmetic)."""
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        if torch.compiler.is_compiling():
            assert self.weight is not None, "packed without its traceable copy"
            # fbgemm's object is opaque to the tracer. Written as products and a
            # sum, inductor makes one vectorised loop that reads each fp16 weight
            # once and accumulates in fp32 (the compiled decode, where T is 1).
            return (self.weight.float() * x[:, None, :]).sum(-1)
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    @property
    def num_bytes(self) -> int:
        plain = 0 if self.weight is None else self.weight.nbytes
        return 2 * self.out_features * self.in_features + plain


@dataclass(frozen=True)
class Int8GroupLinear:
    """``[out, in]`` weights on a symmetric 8-bit grid per ``INT8_GROUP_SIZE`` values
    (``level * scale``, level in -127..127: llama.cpp's Q8_0, the packaged model's
    embedding), held exactly as int8 in a layout made for inductor's loops: the
    compiled decode's form of such an LM head, half of fp16's bytes.

    Rows go in tiles of ``INT8_ROW_TILE``, side by side: a tile's 32-bit words
    (four levels of one row each) for one column range are contiguous, so the
    generated loop loads whole vectors of rows and reads each tile's bytes in
    one stream (rows as the vector's lanes; one row per lane: no sum across lanes).
    """

    words: torch.Tensor  # [out / tile, in / 4, tile] int32: levels of columns 4w..4w+3
    scales: torch.Tensor  # [out / tile, in / group, tile] fp32
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Int8GroupLinear:
        """``weight`` [out, in] (fp32) whose every group of 32 is ``level * scale``
        with the largest |level| 127; PackError when it is not (int8 would change it)."""
        out_features, in_features = weight.shape
        if out_features % INT8_ROW_TILE:
            raise PackError(f"has {out_features} rows, not a multiple of {INT8_ROW_TILE}")
        try:
            levels, scale = q8_0_grid(weight)
        except OffGridError as error:
            raise PackError(str(error)) from None
        tiles, tile = out_features // INT8_ROW_TILE, INT8_ROW_TILE
        # Little-endian: byte b of word w is column 4w + b.
        words = levels.view(torch.int32)
        return cls(
            words.reshape(tiles, tile, -1).transpose(1, 2).contiguous(),
            scale.reshape(tiles, tile, -1).transpose(1, 2).contiguous(),
            int(out_features),
            int(in_features),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32, accumulated in fp32 (for compiled graphs:
        eagerly it is a dozen full-size temporaries)."""
        tiles, _, tile = self.words.shape
        num_groups = self.in_features // INT8_GROUP_SIZE
        words = self.words.view(tiles, num_groups, INT8_GROUP_SIZE // 4, tile)
        columns = x.reshape(len(x), 1, num_groups, INT8_GROUP_SIZE // 4, 4)
        group_sums: torch.Tensor | None = None
        for byte in range(4):  # sign-extend byte ``byte`` of every word
            level = ((words << (24 - 8 * byte)) >> 24).float()
            term = level * columns[..., byte, None]  # [T, tiles, groups, words, tile]
            group_sums = term if group_sums is None else group_sums + term
        assert group_sums is not None
        out = (group_sums * self.scales[:, :, None, :]).sum((2, 3))  # [T, tiles, tile]
        return out.reshape(len(x), self.out_features)

    @property
    def num_bytes(self) -> int:
        return self.words.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Int4Kernel:
    """``[out, in]`` weights on a 4-bit grid per ``INT4_GROUP_SIZE`` values, exactly,
    for ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations and output)."""

    packed: torch.Tensor  # [out, in / 2] uint8, torch's int4pack layout
    scales_and_zeros: torch.Tensor  # [in / group, out, 2] bf16: w = (q - 8) * scale + zero

    # torch's own op, which a compiled graph calls as it is.
    traceable: ClassVar[bool] = True

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Int4Kernel:
        """``weight`` [out, in] (fp32), whose every group of 32 is ``q * scale + minimum``
        with q in 0..15; PackError when it is not (a 4-bit form would change it)."""
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP_SIZE:
            raise PackError(f"has {in_features} columns, not a multiple of {INT4_GROUP_SIZE}")
        if out_features % 16:  # the kernel's tiles
            raise PackError(f"has {out_features} rows, not a multiple of 16")
        groups = weight.reshape(out_features, -1, INT4_GROUP_SIZE)
        minimum = groups.amin(dim=-1)
        scale = (groups.amax(dim=-1) - minimum) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant groups: q = 0
        levels = ((groups - minimum[..., None]) / scale[..., None]).round().clamp(0, 15)
        # fp32 rounding of q * scale + minimum is far below a thousandth of a step.
        off_grid = (levels * scale[..., None] + minimum[..., None] - groups).abs()
        if not bool((off_grid <= 1e-3 * scale[..., None]).all()):  # NaN too (an overflow)
            raise PackError(f"is not on a 4-bit grid of {INT4_GROUP_SIZE} values (not Q4_1)")
        zeros = minimum + 8 * scale  # the kernel subtracts 8 from each level
        scales_and_zeros = torch.stack((scale, zeros), dim=-1).transpose(0, 1).to(torch.bfloat16)
        if not bool(torch.isfinite(scales_and_zeros).all()):
            raise PackError("has 4-bit scales beyond bf16's range")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.reshape(out_features, in_features).to(torch.int32), 1
        )
        return cls(packed, scales_and_zeros.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, INT4_GROUP_SIZE, self.scales_and_zeros
        )

    @property
    def num_bytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


@dataclass(frozen=True)
class Int4Linear:
    """One matrix twice: ``few_rows`` (4-bit, or fp16 for a tied LM head off the grid)
    for calls of at most ``INT4_MAX_ROWS`` rows, a bf16 copy for larger ones."""

    few_rows: Int4Kernel | Float16Linear
    many_rows: torch.Tensor  # [out, in] bf16
    out_features: int
    in_features: int

    weight_format: ClassVar[str] = "int4"
    # A graph of a batch reads the bf16 copy as one matmul.
    traceable_for_batches: ClassVar[bool] = True
    # More rows take the bf16 copy (a compiled graph each side: ``batch_ranges``).
    kernel_changes_above: ClassVar[int | None] = INT4_MAX_ROWS
    # A Q8_0 head's exact int8 form for graphs (``_pack_head``), as float16's.
    head_takes_traced_form: ClassVar[bool] = True

    @classmethod
    def pack(cls, weight: torch.Tensor, off_grid_ok: bool = False) -> Int4Linear:
        """``weight`` [out, in] (fp32) on a 4-bit grid (PackError otherwise), or any
        ``weight`` with ``off_grid_ok``, which then keeps fp16 for few rows."""
        try:
            few_rows: Int4Kernel | Float16Linear = Int4Kernel.pack(weight)
        except PackError:
            if not off_grid_ok:
                raise
            few_rows = Float16Linear.pack(weight, traceable=False)
        out_features, in_features = weight.shape
        return cls(few_rows, weight.to(torch.bfloat16), int(out_features), int(in_features))

    @classmethod
    def pack_head(cls, weight: torch.Tensor) -> Int4Linear:
        """The LM head [vocab, hidden] (fp32), often the tied embedding, kept finer
        than the layers: fp16 for few rows where it is off the 4-bit grid."""
        return cls.pack(weight, off_grid_ok=True)

    @property
    def traceable(self) -> bool:
        """Whether a compiled graph can trace a call of one row (the few-rows form)."""
        return self.few_rows.traceable

    def computes_dense_bf16(self, num_rows: int) -> bool:
        """Whether a compiled graph's calls of ``num_rows`` rows are a dense bf16
        matmul: the bf16 copy's, above ``INT4_MAX_ROWS`` rows."""
        return num_rows > INT4_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32. In a graph traced for a range of T
        (the compiled batch decode), the bf16 copy: the range decides nothing."""
        if statically_known_true(len(x) <= INT4_MAX_ROWS):
            return self.few_rows(x).float()
        return F.linear(x.to(torch.bfloat16), self.many_rows).float()

    @property
    def num_bytes(self) -> int:
        return self.few_rows.num_bytes + self.many_rows.nbytes


@dataclass(frozen=True)
class Q41Linear:
    """``[out, in]`` weights on llama.cpp's Q4_1 grid (the packaged model's layers),
    held exactly in 4 bits plus an fp16 scale and minimum per 32, for the project's
    own kernel (``q4_1_kernel.py``): fp32 activations and accumulation, the same
    arithmetic for every row of a call whatever else is in it, at any number of
    rows (exact to fp32 rounding), about a third of float16's bytes. Eager steps
    and the lone compiled graph call the same op."""

    matrix: Q41Matrix | Q80Matrix  # the layers' Q4_1; an LM head's Q8_0

    weight_format: ClassVar[str] = "q4_1"
    traceable: ClassVar[bool] = True
    # A batch's graph could call the op as well (it ran), but each graph costs a
    # worker's first start a minute or more on two cores: batches run eagerly,
    # as float16's do, the kernel doing the same arithmetic either way.
    traceable_for_batches: ClassVar[bool] = False
    # One kernel, one arithmetic, for any number of rows.
    kernel_changes_above: ClassVar[int | None] = None
    # Whether a Q8_0 head gets the exact int8 form for compiled graphs on AVX-512
    # (``_pack_head``): both forms are exact, so the lone graph's head and the batches'
    # agree to fp32 rounding.
    head_takes_traced_form: ClassVar[bool] = True

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Q41Linear:
        """``weight`` [out, in] (fp32) on the Q4_1 grid; PackError otherwise."""
        try:
            return cls(Q41Matrix.pack(weight))
        except OffGridError as error:
            raise PackError(str(error)) from None

    @classmethod
    def pack_head(cls, weight: torch.Tensor) -> Q41Linear | Float16Linear:
        """The LM head [vocab, hidden] (fp32): Q4_1 where it lies on that grid, else
        Q8_0 where it lies on that one (the packaged model's head does), both exact;
        else fp16 as the float16 format keeps it."""
        for matrix in (Q41Matrix, Q80Matrix):
            try:
                return cls(matrix.pack(weight))
            except OffGridError:
                pass
        return Float16Linear.pack_head(weight)

    @property
    def out_features(self) -> int:
        return self.matrix.out_features

    @property
    def in_features(self) -> int:
        return self.matrix.in_features

    def computes_dense_bf16(self, num_rows: int) -> bool:
        """Never: fp32 arithmetic."""
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        return self.matrix(x)

    @property
    def num_bytes(self) -> int:
        return self.matrix.num_bytes


@dataclass(frozen=True)
class Q41I16Linear(Q41Linear):
    """``Q41Linear``'s matrices with the layers' activations rounded to int16 levels
    and a scale per 32 values of a row (llama.cpp's Q4_1 x Q8_1 scheme with twice its
    bits), the products in integers: about half the exact kernel's time at one row,
    level with it or faster from 16 rows on (docs/performance.md). Each row is rounded
    alone, so a row's product does not depend on its batch; a chat's answer can
    (``AUTO_CPU_FORMATS`` says why it is not a default). An LM head in Q8_0 takes the
    same rounding (the packaged head at one row: 0.65 ms against the exact 1.74)."""

    weight_format: ClassVar[str] = "q4_1_i16"
    # Its head rounds x as the layers do; an exact int8 form in the lone graph would
    # give a chat other logits alone than in a batch (an answer parted on a near-tie,
    # measured), and is slower than this op (1.1 against 0.65 ms on AVX-512).
    head_takes_traced_form: ClassVar[bool] = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        return self.matrix.with_16_bit_activations(x)


@dataclass(frozen=True)
class WithTracedForm:
    """One matrix in two forms: ``eager``'s kernels (fbgemm's, opaque to the tracer)
    outside compiled graphs, ``traced`` inside them. The LM head on a Q8_0 grid."""

    eager: Float16Linear | Int4Linear | Q41Linear | Q41I16Linear
    traced: Int8GroupLinear

    # Graphs trace the int8 form; only the lone graph, at one row, takes the head.
    traceable: ClassVar[bool] = True
    traceable_for_batches: ClassVar[bool] = False
    kernel_changes_above: ClassVar[int | None] = None

    @property
    def weight_format(self) -> str:
        """The format of the eager form, which the head was packed as."""
        return self.eager.weight_format

    @property
    def in_features(self) -> int:
        return self.eager.in_features

    def computes_dense_bf16(self, num_rows: int) -> bool:
        """Whether a compiled graph's calls of ``num_rows`` rows are a dense bf16
        matmul: no, a graph reads the int8 form (fp32 arithmetic)."""
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        if torch.compiler.is_compiling():
            return self.traced(x)
        return self.eager(x).float()

    @property
    def num_bytes(self) -> int:
        return self.eager.num_bytes + self.traced.num_bytes


PackedLinear = Float16Linear | Int4Linear | Q41Linear | Q41I16Linear | WithTracedForm
Packer = type[Float16Linear] | type[Int4Linear] | type[Q41Linear] | type[Q41I16Linear]
_PACKERS: dict[str, Packer] = {
    packer.weight_format: packer for packer in (Float16Linear, Int4Linear, Q41Linear, Q41I16Linear)
}


def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a packed weight; x [T, in] -> [T, out]."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out + bias


def traceable(weight: torch.Tensor | PackedLinear) -> bool:
    """Whether torch.compile can trace ``linear(x, weight)`` for one row: plain
    tensors, torch's 4-bit kernel, and the plain fp16 copies or a Q8_0 head's int8
    form kept for graphs can; fbgemm's packed objects alone cannot."""
    return isinstance(weight, torch.Tensor) or weight.traceable


def traceable_for_batches(weight: torch.Tensor | PackedLinear) -> bool:
    """Whether a compiled graph of a batch (rows a dynamic size) reads ``weight`` as a
    matmul: plain tensors and int4's bf16 copy do; float16's traced form (products
    and a sum) would read every weight once per row, fbgemm's objects not at all."""
    return isinstance(weight, torch.Tensor) or weight.traceable_for_batches


def unsupported_reason(
    device: torch.device,
    dtype: torch.dtype,
    engines: list[str] | None = None,
    weight_format: str = "float16",
    bf16_native: bool | None = None,
) -> str | None:
    """Why ``weight_format`` cannot run on ``device`` in ``dtype``, or None when it can.

    ``engines``: torch's quantized engines (default: this build's);
    ``bf16_native``: whether the CPU has avx512_bf16 (default: this one's).
    """
    if device.type != "cpu":
        return f"packed weights run on the CPU only, not on {device.type}"
    if dtype != torch.float32:
        return f"packed weights take fp32 activations, not {str(dtype).removeprefix('torch.')}"
    available = torch.backends.quantized.supported_engines if engines is None else engines
    if "fbgemm" not in available:
        return "this torch build has no fbgemm (x86) kernels"
    if weight_format == "int4":
        native = cpu_has_native_bf16() if bf16_native is None else bf16_native
        if not native:
            return "int4 computes in bf16, which this CPU emulates (no avx512_bf16): slow"
    if weight_format in (Q41Linear.weight_format, Q41I16Linear.weight_format):
        return kernel_unavailable_reason()
    return None


def pack_weights(
    weights: ModelWeights,
    weight_format: str,
    device: torch.device,
    dtype: torch.dtype,
    probe: Callable[[ModelWeights], torch.Tensor] | None = None,
    include_lm_head: bool = True,
) -> ModelWeights:
    """``weights`` with every projection (and the LM head) packed as ``weight_format``.

    ``probe`` maps weights to the logits of a fixed prompt; the packed weights
    are kept only when theirs stay within ``MAX_PROBE_LOGIT_ERROR`` of the
    loaded weights' (None: no check; benchmarks only). Otherwise, or when the
    format cannot run on ``device``/``dtype`` or hold a matrix, one
    ``weights_not_packed`` line says why and the next of ``candidate_formats``
    is tried (``auto`` has several); after the last, ``weights`` come back
    unchanged. ``float32`` returns ``weights``. The embedding table stays as it
    is (a lookup reads T rows).
    """
    candidates = candidate_formats(weight_format, device, dtype)
    if weight_format == "auto":
        _log_auto_formats_that_cannot_run(candidates, device, dtype)
    exact: torch.Tensor | None = None
    for index, candidate in enumerate(candidates):
        packed: ModelWeights | None = None
        logit_error: float | None = None
        reason = unsupported_reason(device, dtype, weight_format=candidate)
        if reason is None:
            try:
                packed, num_bytes = _pack_all(weights, _PACKERS[candidate], include_lm_head)
            except PackError as error:
                reason = str(error)
        if packed is not None and probe is not None:
            exact = probe(weights) if exact is None else exact  # [tokens, vocab]
            logit_error = float((probe(packed) - exact).norm() / exact.norm())
            if not logit_error <= MAX_PROBE_LOGIT_ERROR:  # also catches NaN
                reason = (
                    f"{candidate} logits stray {logit_error:.2%} from the loaded weights' "
                    f"on a probe prompt (bound {MAX_PROBE_LOGIT_ERROR:.0%})"
                )
                packed = None
        if packed is not None:
            _log.info(
                "weights_packed", weight_format=candidate, lm_head=include_lm_head,
                packed_mib=round(num_bytes / 2**20, 1),
                probe_logit_error=None if logit_error is None else round(logit_error, 6),
            )  # fmt: skip
            return packed
        loaded = f"the loaded {str(dtype).removeprefix('torch.')} tensors (exact path)"
        _log.warning(
            "weights_not_packed", weight_format=candidate, reason=reason,
            using=candidates[index + 1] if index + 1 < len(candidates) else loaded,
        )  # fmt: skip
    return weights


def _log_auto_formats_that_cannot_run(
    candidates: tuple[str, ...], device: torch.device, dtype: torch.dtype
) -> None:
    """One ``weights_not_packed`` line for each of ``AUTO_CPU_FORMATS`` that cannot run
    on this CPU (the Q4_1 kernel not built, no fbgemm), so that the fallback says
    why; none on another device or dtype, where no packed format runs."""
    if device.type != "cpu" or dtype != torch.float32:
        return
    for skipped in AUTO_CPU_FORMATS:
        if skipped in candidates:
            continue
        reason = unsupported_reason(device, dtype, weight_format=skipped)
        loaded = "the loaded tensors (exact path)"
        _log.warning(
            "weights_not_packed", weight_format=skipped, reason=reason,
            using=candidates[0] if candidates else loaded,
        )  # fmt: skip


def candidate_formats(
    weight_format: str, device: torch.device, dtype: torch.dtype
) -> tuple[str, ...]:
    """The packed formats to try for ``weight_format``, in order: none for
    ``float32``, ``AUTO_CPU_FORMATS`` that run here for ``auto``, else itself."""
    if weight_format not in WEIGHT_FORMATS:
        choices = ", ".join(WEIGHT_FORMATS)
        raise ValueError(f"weight format {weight_format!r} is not one of {choices}")
    if weight_format == "float32":
        return ()
    if weight_format != "auto":
        return (weight_format,)
    return tuple(
        candidate
        for candidate in AUTO_CPU_FORMATS
        if unsupported_reason(device, dtype, weight_format=candidate) is None
    )


def resolve_weight_format(weight_format: str, device: torch.device, dtype: torch.dtype) -> str:
    """The format ``weight_format`` packs first here: ``auto``'s first candidate that
    runs on ``device``/``dtype`` (``float32``, the loaded tensors, where none does)."""
    candidates = candidate_formats(weight_format, device, dtype)
    return candidates[0] if candidates else "float32"


def rounds_in_bf16(weights: ModelWeights) -> bool:
    """Whether the layers of ``weights`` round their outputs to bf16 (int4), so
    that two ways of computing one step agree only to ``BF16_LOGIT_ERROR``."""
    return weight_format_of(weights) == "int4"


def weight_format_of(weights: ModelWeights) -> str:
    """The format the projections of ``weights`` are in ('float32' for plain tensors)."""
    matrix = weights.layers[0].qkv_proj if weights.layers else weights.lm_head
    if isinstance(matrix, torch.Tensor):
        return str(matrix.dtype).removeprefix("torch.")
    return matrix.weight_format


def _pack_all(
    weights: ModelWeights, packer: Packer, include_lm_head: bool
) -> tuple[ModelWeights, int]:
    """Packed weights and their bytes; PackError names the first matrix the format cannot hold."""
    num_bytes = 0

    def pack(name: str, weight: torch.Tensor | PackedLinear, is_head: bool = False) -> PackedLinear:
        nonlocal num_bytes
        assert isinstance(weight, torch.Tensor), f"{name} is packed already"
        if weight.dim() != 2 or 0 in weight.shape:
            raise PackError(f"{name} has shape {tuple(weight.shape)}, not a 2-D matrix")
        if not bool(torch.isfinite(weight).all()):
            raise PackError(f"{name} holds non-finite values")
        try:
            packed = _pack_head(weight, packer) if is_head else packer.pack(weight)
        except PackError as error:
            raise PackError(f"{name} {error}") from None
        except RuntimeError as error:  # fbgemm refused the matrix
            raise PackError(f"{name} cannot be packed: {error}") from None
        num_bytes += packed.num_bytes
        return packed

    layers = [
        dataclasses.replace(
            layer,
            qkv_proj=pack(f"layers.{i}.qkv_proj", layer.qkv_proj),
            o_proj=pack(f"layers.{i}.o_proj", layer.o_proj),
            gate_up_proj=pack(f"layers.{i}.gate_up_proj", layer.gate_up_proj),
            down_proj=pack(f"layers.{i}.down_proj", layer.down_proj),
        )
        for i, layer in enumerate(weights.layers)
    ]
    lm_head = pack("lm_head", weights.lm_head, True) if include_lm_head else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head), num_bytes


def _pack_head(weight: torch.Tensor, packer: Packer) -> PackedLinear:
    """The LM head (often the tied embedding, often kept finer than the layers):
    ``packer``'s head form for eager calls (``pack_head``), with its exact int8 form
    for compiled graphs where it lies on a Q8_0 grid (the packaged model's does), the
    CPU's vector code is AVX-512 (``INT8_GROUP_CPU_CAPABILITIES``) and the format's
    head is exact (``head_takes_traced_form``)."""
    eager = packer.pack_head(weight)
    if torch.backends.cpu.get_cpu_capability() not in INT8_GROUP_CPU_CAPABILITIES:
        return eager
    if not packer.head_takes_traced_form:
        return eager
    try:
        return WithTracedForm(eager, Int8GroupLinear.pack(weight))
    except PackError:
        return eager
