"""Step-time cost model of the simulator: ``step_s = a + b * new + c * attended``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scheduler_actor.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """Seconds of one forward pass from its new and attended token counts.

    The defaults are roughly SmolLM2-135M in fp32 on a 2-core CPU.
    """

    a_s: float = 0.020
    b_s_per_token: float = 0.00035
    c_s_per_attended_token: float = 0.0000004

    def step_s(self, num_new_tokens: int, num_attended_tokens: int) -> float:
        """Duration of one step."""
        return (
            self.a_s
            + self.b_s_per_token * num_new_tokens
            + self.c_s_per_attended_token * num_attended_tokens
        )

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """From ``"a,b,c"`` (seconds, seconds per token, seconds per attended token)."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ConfigError(f"--cost wants a,b,c; got {text!r}")
        try:
            a_s, b_s, c_s = (float(part) for part in parts)
        except ValueError as error:
            raise ConfigError(f"--cost wants three numbers; got {text!r}") from error
        return cls(a_s, b_s, c_s)

    @classmethod
    def from_engine_json(cls, path: Path) -> CostModel:
        """From the ``cost_model`` object bench/engine.py writes."""
        try:
            fitted = json.loads(path.read_text())["cost_model"]
            return cls(
                float(fitted["a_s"]),
                float(fitted["b_s_per_token"]),
                float(fitted["c_s_per_attended_token"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"cannot read a cost model from {path}: {error}") from error
