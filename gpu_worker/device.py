"""Where the engine runs and in which precision, chosen automatically."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(
    cpuinfo: Path = Path("/proc/cpuinfo"), capability: str | None = None
) -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and torch
    uses its AVX-512 kernels (``capability``, default torch's: not held to AVX2 by
    ``ATEN_CPU_CAPABILITY``).

    Without those units torch emulates bf16 on the CPU, several times slower
    than fp32, so ``--weights int4`` (bf16 arithmetic) runs only where they exist.
    """
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False
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
    """``requested`` by name, else bf16 on CUDA and fp32 on the CPU.

    fp32 on every CPU, bf16 units or not: there ``--weights auto`` packs the
    matrices (fp16 weights, fp32 arithmetic),
    and a single chat's decode step took twice as long with a whole bf16
    model on an avx512_bf16 Xeon (40 against 20 ms; docs/history/benchmarks-notebook.md,
    *int4 on a Xeon with bf16 units, side by side with llama.cpp*).
    """
    if requested:
        if requested not in DTYPES:
            raise ValueError(f"dtype {requested!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def inductor_cache_dir(cache_dir: Path) -> Path:
    """Where the worker keeps inductor's compiled graphs: beside the prepared models,
    one folder per vector ISA torch runs (``AVX512``, ``AVX2``: its
    ``ATEN_CPU_CAPABILITY``). Inductor's cache does not keep them apart: a graph
    compiled under one and loaded under the other gave garbage or corrupted the
    heap (the warm-up checks refused it, or the process died)."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return cache_dir / "inductor" / capability
