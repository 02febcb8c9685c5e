"""What ran a benchmark, as its JSON records it (docs/performance.md, *How to measure*:
record the machine).

Two shapes, kept as the results so far have them: ``lscpu_machine`` (lscpu's model,
flags and CPU count; the llama.cpp and kernel benchmarks) and ``torch_machine`` (the
CPU model, cores and torch's threads; the engine benchmarks). The service benchmarks
record ``orcapod.bench.run.machine``, ``orcapod bench``'s own.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from datetime import date
from pathlib import Path
from typing import Any

LSCPU_FIELDS = ("Model name", "Flags", "CPU(s)")


def today() -> str:
    """The date, as every benchmark's JSON writes it (``2026-12-05``)."""
    return date.today().isoformat()


def loadavg_1m() -> float:
    """The 1-minute load average, to two places: what else ran beside the benchmark."""
    return round(os.getloadavg()[0], 2)


def lscpu() -> dict[str, str]:
    """lscpu's Model name, Flags and CPU(s) (none where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in LSCPU_FIELDS:
            fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` says)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def lscpu_machine(with_torch: bool = False) -> dict[str, str]:
    """Python, the date, the load average and lscpu's fields; with torch's version and
    threads when ``with_torch`` (torch is not imported otherwise)."""
    info = {"python": platform.python_version(), "date": today(),
            "loadavg_1m": f"{loadavg_1m():.2f}"}  # fmt: skip
    if with_torch:
        import torch

        info |= {"torch": torch.__version__, "threads": str(torch.get_num_threads())}
    return info | lscpu()


def torch_machine() -> dict[str, Any]:
    """The CPU model, cores, torch's version and threads, Python and the date."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": today()}  # fmt: skip
