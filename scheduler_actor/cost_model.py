"""Step-time cost model of the simulator: ``step_s = a + b * new + c * attended``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scheduler_actor.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """Seconds of one forward pass from its new and attended token counts.

    The defaults are bench/engine.py's fit for SmolLM2-135M in fp32 on a
    2-core AVX2 CPU (docs/history/benchmarks-notebook.md, "Engine").
    """

    a_s: float = 0.0698
    b_s_per_token: float = 0.000890
    c_s_per_attended_token: float = 0.00000654

    def step_s(self, num_new_tokens: int, num_attended_tokens: int) -> float:
        """Duration of one step."""
        return (
            self.a_s
            + self.b_s_per_token * num_new_tokens
            + self.c_s_per_attended_token * num_attended_tokens
        )

    def decode_step_s(self, batch_size: int, mean_context_tokens: float) -> float:
        """One decode step of a full batch: one new token per request."""
        return self.step_s(batch_size, round(batch_size * mean_context_tokens))

    def latency_target_s_per_token(self, batch_size: int, mean_context_tokens: float) -> float:
        """Orca's latency target: 2 x the engine's normalized execution time at the
        largest batch (each request gets one token per decode step)."""
        return 2 * self.decode_step_s(batch_size, mean_context_tokens)

    def saturation_rps(
        self, batch_size: int, mean_prompt_tokens: float, mean_output_tokens: float
    ) -> float:
        """Requests per second an iteration-level scheduler can at best sustain.

        Each request costs its prompt's tokens (prefill shares steps with
        decodes, so no fixed cost) and a 1/batch share of a full decode step
        per generated token.
        """
        mean_context = mean_prompt_tokens + mean_output_tokens / 2
        prefill_s = (
            self.b_s_per_token * mean_prompt_tokens
            + self.c_s_per_attended_token * mean_prompt_tokens**2 / 2
        )
        decode_s = mean_output_tokens * self.decode_step_s(batch_size, mean_context) / batch_size
        return 1.0 / (prefill_s + decode_s)

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
