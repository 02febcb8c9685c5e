"""An engine's counters (no torch here: the worker's Redis shell mirrors them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since the engine started, and the step paths it serves on."""

    num_steps: int = 0
    num_tokens: int = 0
    busy_s: float = 0.0
    live_paths: list[str] = field(default_factory=list)  # by name (step_path.py)
    compiling_paths: bool = False  # more are being compiled (path_compiler.py)
