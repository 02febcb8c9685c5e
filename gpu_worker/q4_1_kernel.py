"""The project's one C++ kernel, ``csrc/q4_1_linear.cpp``: a Q4_1 matrix (the
layers) or a Q8_0 one (an LM head) times fp32 activations on the CPU (AVX2, FMA,
F16C), or either matrix times activations rounded to int16 per 32 values
(``--weights q4_1_i16``), and the packing of a matrix for it.

Built by ``torch.utils.cpp_extension`` with the C++ compiler the compiled
decode already needs, once, into ``<cache>/extensions/<torch>/`` (``scripts/setup.sh``
builds it; a worker that finds it missing builds it at start, about half a
minute; a changed source is rebuilt there by the same call): loading it
registers ``torch.ops.orcapod.q4_1_linear``, ``q8_0_linear`` and their forms
with int16 activations ``q4_1_i16_linear`` and ``q8_0_i16_linear``, which eager
steps call and compiled graphs call as opaque ops (their shape rules are
registered here). A CPU without AVX2, FMA and F16C, or a build that fails,
leaves it out with a reason (``kernel_unavailable_reason``): the worker keeps
the float16 path and says why in one log line.

``python -m gpu_worker.q4_1_kernel`` builds it (or says why it cannot).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

# Weights per group: one scale (and for Q4_1 one minimum) for each 32 of a row.
Q4_1_GROUP_SIZE = 32
Q8_0_GROUP_SIZE = 32
# Output rows per panel and columns per block of the kernel's layout (Q41Matrix).
PANEL_ROWS = 16
BLOCK_COLUMNS = 8
SOURCE = Path(__file__).resolve().parent / "csrc" / "q4_1_linear.cpp"
# The instructions the kernel is compiled for, and the CPU flags that say a CPU has them.
# -fopenmp: at::parallel_for is OpenMP's in torch's CPU builds, and without it the
# loop runs on one thread; torch's wheel ships libgomp.so.1, which the kernel then
# shares (one soname, one thread pool).
# --param=inline-unit-growth: with both formats' instances in the one file, GCC's
# default limit on how much inlining may grow it left Q4_1's lone-row path less
# inlined, its registers spilling: 1.45x its time (measured on SmolLM2's shapes).
COMPILER_FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp",
    "--param=inline-unit-growth=1000",
)  # fmt: skip
LINKER_FLAGS = ("-fopenmp",)
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_log = structlog.get_logger(__name__)


class OffGridError(ValueError):
    """A matrix that Q4_1 (or Q8_0) cannot hold as it is."""


def build_directory(cache_dir: Path | None = None) -> Path:
    """Where the built kernel lives: one folder per torch version (its ABI)."""
    root = cache_dir or Path(
        os.environ.get("ORCAPOD_CACHE_DIR") or Path.home() / ".cache" / "orcapod"
    )
    return root / "extensions" / f"torch-{torch.__version__}"


def missing_cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of ``REQUIRED_CPU_FLAGS`` this CPU (or ``cpuinfo``'s text) lacks."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return list(REQUIRED_CPU_FLAGS)
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """None once the kernel is loaded (built first if needed); else why it cannot be."""
    return unavailable_reason(missing_cpu_flags(), _load)


def unavailable_reason(missing_flags: list[str], load: Callable[[], None]) -> str | None:
    """Why the kernel cannot run, given the CPU flags it lacks and how to load it
    (None once ``load`` returned)."""
    if missing_flags:
        return f"the Q4_1 kernel needs {', '.join(missing_flags)}, which this CPU lacks"
    try:
        load()
    except Exception as error:  # a compiler missing or failing, a broken cache
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else repr(error)
        return f"the Q4_1 kernel could not be built or loaded: {first_line}"
    return None


def _load() -> None:
    """Build (if needed) and load the kernel, and register its shape rule."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="orcapod_q4_1",
        sources=[str(SOURCE)],
        extra_cflags=list(COMPILER_FLAGS),
        extra_ldflags=list(LINKER_FLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )

    def q4_1_shape(
        x: torch.Tensor,
        levels: torch.Tensor,
        scales: torch.Tensor,
        minimums: torch.Tensor,
        out_features: int,
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    for q4_1_op in ("orcapod::q4_1_linear", "orcapod::q4_1_i16_linear"):
        torch.library.register_fake(q4_1_op, q4_1_shape)

    def q8_0_shape(
        x: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    for q8_0_op in ("orcapod::q8_0_linear", "orcapod::q8_0_i16_linear"):
        torch.library.register_fake(q8_0_op, q8_0_shape)


def _panels(out_features: int) -> tuple[int, tuple[int, int, int, int]]:
    """How many panels ``out_features`` rows fill, and the padding (zero rows at the
    end) that completes the last."""
    num_panels = -(-out_features // PANEL_ROWS)
    return num_panels, (0, 0, 0, num_panels * PANEL_ROWS - out_features)


def _per_panel(table: torch.Tensor, num_panels: int) -> torch.Tensor:
    """A table per row and group [out, groups] -> per panel [panels, groups, 16]."""
    padding = (0, 0, 0, num_panels * PANEL_ROWS - len(table))
    table = F.pad(table, padding).reshape(num_panels, PANEL_ROWS, -1)
    return table.transpose(1, 2).contiguous()


def _per_row(table: torch.Tensor) -> torch.Tensor:
    """A table per panel [panels, groups, 16] -> per row [panels * 16, groups, 1] fp32."""
    num_panels = len(table)
    return table.transpose(1, 2).reshape(num_panels * PANEL_ROWS, -1, 1).float()


def q8_0_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels [out, in] (int8) and scales [out, in / 32] (fp32) of ``weight``
    [out, in] (fp32) whose every group of 32 is ``level * scale`` with the largest
    |level| 127 (llama.cpp's Q8_0, as the packaged model's embedding is);
    OffGridError when it is not (int8 would change it)."""
    out_features, in_features = weight.shape
    if in_features % Q8_0_GROUP_SIZE:
        raise OffGridError(f"has {in_features} columns, not a multiple of {Q8_0_GROUP_SIZE}")
    groups = weight.float().reshape(out_features, -1, Q8_0_GROUP_SIZE)
    scale = groups.abs().amax(dim=-1) / 127
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero groups
    levels = (groups / safe_scale[..., None]).round()
    off_grid = (levels * scale[..., None] - groups).abs()
    if not bool((off_grid <= 1e-3 * safe_scale[..., None]).all()):  # NaN too
        raise OffGridError(f"is not on an 8-bit grid of {Q8_0_GROUP_SIZE} values (not Q8_0)")
    return levels.to(torch.int8).reshape(out_features, in_features), scale


class _PanelsOfColumns:
    """What both matrices' layouts share: levels [panels, in / 8, block bytes]."""

    levels: torch.Tensor

    @property
    def in_features(self) -> int:
        return int(self.levels.shape[1]) * BLOCK_COLUMNS


@dataclass(frozen=True)
class Q41Matrix(_PanelsOfColumns):
    """One ``[out, in]`` matrix in the kernel's layout (``csrc/q4_1_linear.cpp`` says
    why): output rows in panels of ``PANEL_ROWS`` (the last padded with zero
    weights), a panel's columns in blocks of ``BLOCK_COLUMNS``."""

    # [panels, in / 8, 64] uint8: per block, outputs 0-7 then 8-15 of the panel, a
    # little-endian uint32 each holding its 8 columns' levels, column j in bits 4j..4j+3
    levels: torch.Tensor
    scales: torch.Tensor  # [panels, in / 32, 16] fp16
    minimums: torch.Tensor  # [panels, in / 32, 16] fp16
    out_features: int

    @property
    def num_bytes(self) -> int:
        return self.levels.nbytes + self.scales.nbytes + self.minimums.nbytes

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Q41Matrix:
        """``weight`` [out, in] (fp32) whose every group of 32 is ``q * d + m`` with q in
        0..15 and d, m fp16 (llama.cpp's Q4_1, as the packaged model's layers are);
        OffGridError when it is not, or not to within a thousandth of a step."""
        out_features, in_features = weight.shape
        if in_features % Q4_1_GROUP_SIZE:
            raise OffGridError(f"has {in_features} columns, not a multiple of {Q4_1_GROUP_SIZE}")
        groups = weight.float().reshape(out_features, -1, Q4_1_GROUP_SIZE)
        minimum = groups.amin(dim=-1).to(torch.float16)
        scale = ((groups.amax(dim=-1) - minimum.float()) / 15).to(torch.float16)
        if not bool(torch.isfinite(scale).all() and torch.isfinite(minimum).all()):
            raise OffGridError("has groups beyond fp16's range (not Q4_1)")
        step = scale.float()[..., None]
        safe_step = torch.where(step > 0, step, torch.ones_like(step))  # constant groups: q = 0
        levels = ((groups - minimum.float()[..., None]) / safe_step).round().clamp(0, 15)
        off_grid = (levels * step + minimum.float()[..., None] - groups).abs()
        if not bool((off_grid <= 1e-3 * safe_step).all()):  # NaN too
            raise OffGridError(f"is not on a 4-bit grid of {Q4_1_GROUP_SIZE} values (not Q4_1)")
        num_panels, padding = _panels(out_features)
        nibbles = F.pad(levels.to(torch.uint8).reshape(out_features, in_features), padding)
        # [panel, half, lane, block, byte, nibble] -> [panel, block, half, lane, byte]
        nibbles = nibbles.reshape(num_panels, 2, 8, in_features // BLOCK_COLUMNS, 4, 2)
        packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).permute(0, 3, 1, 2, 4)
        return cls(
            packed.reshape(num_panels, in_features // BLOCK_COLUMNS, -1).contiguous(),
            _per_panel(scale, num_panels),
            _per_panel(minimum, num_panels),
            out_features,
        )

    def dequantized(self) -> torch.Tensor:
        """The fp32 matrix it holds [out, in]: the reference the kernel is tested against."""
        num_panels, num_blocks, _ = self.levels.shape
        packed = self.levels.reshape(num_panels, num_blocks, 2, 8, 4)
        nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
        # [panel, block, half, lane, byte, nibble] -> [panel, half, lane, block, byte, nibble]
        levels = nibbles.permute(0, 2, 3, 1, 4, 5).reshape(num_panels * PANEL_ROWS, -1, 32)
        weights = levels.float() * _per_row(self.scales) + _per_row(self.minimums)
        return weights.reshape(num_panels * PANEL_ROWS, -1)[: self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32 (the kernel must be loaded); each row's
        bits the same whatever else is in ``x``."""
        return torch.ops.orcapod.q4_1_linear(
            x, self.levels, self.scales, self.minimums, self.out_features
        )

    def with_16_bit_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 rounded to int16 levels and an fp32 scale per 32 values of
        a row, times the matrix in integers -> [T, out] fp32 (``csrc/q4_1_linear.cpp``,
        *Q4_1 with activations rounded to 16-bit integers*): each row's bits the same
        whatever else is in ``x``."""
        return torch.ops.orcapod.q4_1_i16_linear(
            x, self.levels, self.scales, self.minimums, self.out_features
        )


@dataclass(frozen=True)
class Q80Matrix(_PanelsOfColumns):
    """One ``[out, in]`` Q8_0 matrix in the kernel's layout: output rows in panels of
    ``PANEL_ROWS`` (the last padded with zero weights), column by column."""

    levels: torch.Tensor  # [panels, in / 8, 128] int8: per column, the panel's 16 levels
    scales: torch.Tensor  # [panels, in / 32, 16] fp16
    out_features: int

    @property
    def num_bytes(self) -> int:
        return self.levels.nbytes + self.scales.nbytes

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Q80Matrix:
        """``weight`` [out, in] (fp32) on llama.cpp's Q8_0 grid (``q8_0_grid``) with fp16
        scales, as the GGUF file holds them; OffGridError when it is not."""
        levels, scale = q8_0_grid(weight)
        half_scale = scale.to(torch.float16)
        if not bool((half_scale.float() == scale).all()):
            raise OffGridError("has Q8_0 scales that fp16 does not hold (not Q8_0)")
        out_features, in_features = levels.shape
        num_panels, padding = _panels(out_features)
        # [panel, row, column] -> [panel, column, row]
        panels = F.pad(levels, padding).reshape(num_panels, PANEL_ROWS, in_features)
        columns = panels.transpose(1, 2).reshape(num_panels, in_features // BLOCK_COLUMNS, -1)
        return cls(
            columns.contiguous(),
            _per_panel(half_scale, num_panels),
            out_features,
        )

    def dequantized(self) -> torch.Tensor:
        """The fp32 matrix it holds [out, in]: the reference the kernel is tested against."""
        num_panels = len(self.levels)
        levels = self.levels.reshape(num_panels, -1, PANEL_ROWS).transpose(1, 2)
        levels = levels.reshape(num_panels * PANEL_ROWS, -1, Q8_0_GROUP_SIZE)
        weights = levels.float() * _per_row(self.scales)
        return weights.reshape(num_panels * PANEL_ROWS, -1)[: self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32 (the kernel must be loaded); each row's
        bits the same whatever else is in ``x``."""
        return torch.ops.orcapod.q8_0_linear(x, self.levels, self.scales, self.out_features)

    def with_16_bit_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 rounded to int16 as ``Q41Matrix.with_16_bit_activations``
        rounds it, times the matrix in integers -> [T, out] fp32."""
        return torch.ops.orcapod.q8_0_i16_linear(x, self.levels, self.scales, self.out_features)


def main() -> int:
    """Build the kernel into the cache (setup does this once); exit 0 when it loads."""
    reason = kernel_unavailable_reason()
    if reason is None:
        print(f"Q4_1 kernel ready in {build_directory()}")
        return 0
    print(f"note: {reason}; the worker keeps its float16 path", file=sys.stderr)
    return 0 if missing_cpu_flags() else 1


if __name__ == "__main__":
    sys.exit(main())
