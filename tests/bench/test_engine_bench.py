"""Smoke test of ``bench/engine.py`` on a tiny random model (no files needed)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import engine as engine_bench


def test_quick_run_writes_results_and_a_positive_cost_model(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"

    # Uncompiled: the compiled decodes are tests/gpu_worker's (a compile here is 20 s).
    argv = ["--quick", "--config", "tiny", "--dtype", "float32", "--no-compile-decode"]
    engine_bench.main([*argv, "--out", str(out)])

    result = json.loads(out.read_text())
    assert {"machine", "results", "overhead", "targets", "cost_model"} <= result.keys()
    model = result["cost_model"]
    assert model["a_s"] > 0
    assert model["b_s_per_token"] >= 0 and model["c_s_per_attended_token"] >= 0
    impls = {(r["measurement"], r["impl"]) for r in result["results"]}
    assert {("decode", "cpu"), ("decode", "reference"), ("decode", "transformers")} <= impls
    assert ("mixed", "transformers (padded)") in impls
    assert all(r["step_ms"] > 0 for r in result["results"])
    assert result["overhead"]["us_per_layer"] > 0
    assert {t["result"] for t in result["targets"]} <= {"PASS", "MISS"}
