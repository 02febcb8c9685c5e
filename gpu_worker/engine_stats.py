"""An engine's counters (no torch here: the worker's Redis shell mirrors them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started."""

    num_steps: int = 0
    num_tokens: int = 0
    busy_s: float = 0.0
