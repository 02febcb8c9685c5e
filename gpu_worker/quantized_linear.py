"""Weight matrices packed once at load into fewer bytes per token (CPU, fbgemm).

The forward pass calls ``linear(x, weight)`` for every projection and the LM
head; ``weight`` is either a plain tensor (``F.linear``: the exact path) or a
matrix packed for one of fbgemm's x86 kernels, which ship in every x86 torch
wheel:

- ``int8``: weights quantized symmetrically per output channel
  (``scale = max|w| / 127``); each call quantizes its activations with one
  scale per call (7 bits, fbgemm's ``reduce_range``, which keeps AVX2's
  16-bit pair sums from saturating) and accumulates in int32. 1-2 % relative
  error per layer on random inputs, but 5-21 % on SmolLM2's own activations,
  whose outlier channels that one scale flattens; a row's result also
  depends on the other rows of its step through that shared scale.
- ``float16``: weights rounded to fp16 once; activations and accumulation
  stay fp32 (about 0.02 % per layer, independent of the batch).

``pack_weights`` turns loaded fp32 ``ModelWeights`` into packed ones, or
hands them back unchanged with one log line saying why it cannot: not the
CPU, not fp32, no fbgemm, a matrix the format cannot hold, or logits of a
probe prompt that stray from the loaded weights' (int8's do, on SmolLM2).
Why these kernels and not others, and what they cost in agreement:
docs/benchmarks.md, *Issue 14, second step*.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F

from shared.settings import WEIGHT_FORMATS

if TYPE_CHECKING:
    from gpu_worker.weights import ModelWeights

# What ``auto`` packs where fbgemm runs: every greedy token of 20 chat prompts
# identical to fp32's, logits within 0.15 %, 1.6-1.8x fp32's decode at batch 1
# (docs/benchmarks.md, *Issue 14, second step*). int8 is not near-exact there.
AUTO_CPU_FORMAT = "float16"
# Packed weights whose probe logits differ from the loaded weights' by more
# than this (relative L2) are not used. Measured: float16 0.04 % on SmolLM2
# and 0.03 % on the tests' tiny model; int8 26 % and 2.4 %.
MAX_PROBE_LOGIT_ERROR = 0.01

_log = structlog.get_logger(__name__)


class PackError(ValueError):
    """A matrix that a packed format cannot hold faithfully."""


@dataclass(frozen=True)
class Int8Linear:
    """``[out, in]`` weights as int8 per output channel, for ``quantized::linear_dynamic``."""

    packed: Any  # fbgemm's LinearPackedParamsBase (a TorchScript object)
    out_features: int
    in_features: int
    bytes_per_weight = 1

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Int8Linear:
        """Quantize ``weight`` [out, in] (fp32) per row."""
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        zero_points = torch.zeros(len(weight), dtype=torch.int64)
        # These ops are deprecated in favour of torchao, whose CPU int8 paths
        # have no AVX2 kernels (5-100x slower here, docs/benchmarks.md).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(
                weight.contiguous(), scales.double(), zero_points, 0, torch.qint8
            )
            packed = torch.ops.quantized.linear_prepack(quantized, None)
        return cls(packed, int(weight.shape[0]), int(weight.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


@dataclass(frozen=True)
class Float16Linear:
    """``[out, in]`` weights rounded to fp16, for ``quantized::linear_dynamic_fp16``."""

    packed: Any  # fbgemm's PackedGemmMatrixFP16 (a TorchScript object)
    out_features: int
    in_features: int
    bytes_per_weight = 2

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Float16Linear:
        """Round ``weight`` [out, in] (fp32) to fp16."""
        largest = float(weight.abs().max()) if weight.numel() else 0.0
        if largest > torch.finfo(torch.float16).max:
            raise PackError(f"holds {largest:.3g}, beyond fp16's range")
        packed = torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), None)
        return cls(packed, int(weight.shape[0]), int(weight.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] fp32 -> [T, out] fp32."""
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


PackedLinear = Int8Linear | Float16Linear
_PACKERS: dict[str, type[Int8Linear] | type[Float16Linear]] = {
    "int8": Int8Linear,
    "float16": Float16Linear,
}


def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a packed weight; x [T, in] -> [T, out]."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out + bias


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, engines: list[str] | None = None
) -> str | None:
    """Why packed weights cannot run on ``device`` in ``dtype``, or None when they can.

    ``engines``: torch's quantized engines (default: this build's).
    """
    if device.type != "cpu":
        return f"packed weights run on the CPU only, not on {device.type}"
    if dtype != torch.float32:
        return f"packed weights take fp32 activations, not {str(dtype).removeprefix('torch.')}"
    available = torch.backends.quantized.supported_engines if engines is None else engines
    if "fbgemm" not in available:
        return "this torch build has no fbgemm (x86) kernels"
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
    format cannot run on ``device``/``dtype``, ``weights`` come back unchanged
    and one ``weights_not_packed`` line says why. ``float32`` returns
    ``weights``; ``auto`` is ``resolve_weight_format``'s choice. The embedding
    table stays as it is (a lookup reads T rows).
    """
    weight_format = resolve_weight_format(weight_format, device, dtype)
    if weight_format == "float32":
        return weights
    packed: ModelWeights | None = None
    logit_error: float | None = None
    reason = unsupported_reason(device, dtype)
    if reason is None:
        try:
            packed, num_bytes = _pack_all(weights, _PACKERS[weight_format], include_lm_head)
        except PackError as error:
            reason = str(error)
    if packed is not None and probe is not None:
        exact = probe(weights)  # [tokens, vocab]
        logit_error = float((probe(packed) - exact).norm() / exact.norm())
        if not logit_error <= MAX_PROBE_LOGIT_ERROR:  # also catches NaN
            reason = (
                f"{weight_format} logits stray {logit_error:.2%} from the loaded weights' "
                f"on a probe prompt (bound {MAX_PROBE_LOGIT_ERROR:.0%})"
            )
            packed = None
    if packed is None:
        _log.warning(
            "weights_not_packed", weight_format=weight_format, reason=reason,
            using=f"the loaded {str(dtype).removeprefix('torch.')} tensors (exact path)",
        )  # fmt: skip
        return weights
    _log.info(
        "weights_packed", weight_format=weight_format, lm_head=include_lm_head,
        packed_mib=round(num_bytes / 2**20, 1),
        probe_logit_error=None if logit_error is None else round(logit_error, 6),
    )  # fmt: skip
    return packed


def resolve_weight_format(weight_format: str, device: torch.device, dtype: torch.dtype) -> str:
    """``weight_format``, with ``auto`` made concrete: ``AUTO_CPU_FORMAT`` where
    fbgemm runs (the CPU, float32), else ``float32`` (the loaded tensors)."""
    if weight_format not in WEIGHT_FORMATS:
        choices = ", ".join(WEIGHT_FORMATS)
        raise ValueError(f"weight format {weight_format!r} is not one of {choices}")
    if weight_format != "auto":
        return weight_format
    return AUTO_CPU_FORMAT if unsupported_reason(device, dtype) is None else "float32"


def weight_format_of(weights: ModelWeights) -> str:
    """The format the projections of ``weights`` are in ('float32' for plain tensors)."""
    matrix = weights.layers[0].qkv_proj if weights.layers else weights.lm_head
    for name, packer in _PACKERS.items():
        if isinstance(matrix, packer):
            return name
    assert isinstance(matrix, torch.Tensor)
    return str(matrix.dtype).removeprefix("torch.")


def _pack_all(
    weights: ModelWeights, packer: type[Int8Linear] | type[Float16Linear], include_lm_head: bool
) -> tuple[ModelWeights, int]:
    """Packed weights and their bytes; PackError names the first matrix the format cannot hold."""
    num_bytes = 0

    def pack(name: str, weight: torch.Tensor | PackedLinear) -> PackedLinear:
        nonlocal num_bytes
        assert isinstance(weight, torch.Tensor), f"{name} is packed already"
        if weight.dim() != 2 or 0 in weight.shape:
            raise PackError(f"{name} has shape {tuple(weight.shape)}, not a 2-D matrix")
        if not bool(torch.isfinite(weight).all()):
            raise PackError(f"{name} holds non-finite values")
        try:
            packed = packer.pack(weight)
        except PackError as error:
            raise PackError(f"{name} {error}") from None
        except RuntimeError as error:  # fbgemm refused the matrix
            raise PackError(f"{name} cannot be packed: {error}") from None
        num_bytes += weight.numel() * packer.bytes_per_weight
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
    lm_head = pack("lm_head", weights.lm_head) if include_lm_head else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head), num_bytes
