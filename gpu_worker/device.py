"""Where the engine runs and in which precision, chosen automatically."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX).

    Without those units torch emulates bf16 on the CPU, several times slower
    than fp32, so bf16 is only the CPU default where they exist.
    """
    try:
        flags = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(flag in flags.split() for flag in _CPU_BF16_FLAGS)


def choose_device(requested: str | None = None) -> torch.device:
    """``requested`` ('cpu', 'cuda', 'cuda:1') or CUDA when present, else the CPU."""
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} asked for, but CUDA is not available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_dtype(device: torch.device, requested: str | None = None) -> torch.dtype:
    """``requested`` by name, else bf16 on CUDA and on CPUs with bf16 units, else fp32."""
    if requested:
        if requested not in DTYPES:
            raise ValueError(f"dtype {requested!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32
