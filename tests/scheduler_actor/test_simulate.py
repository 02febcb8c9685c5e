"""The simulator end to end, small."""

from __future__ import annotations

import json

from scheduler_actor.cost_model import CostModel
from scheduler_actor.simulate import main


def test_simulate_writes_results_and_plots(tmp_path) -> None:
    engine = tmp_path / "engine.json"
    engine.write_text(
        json.dumps(
            {"cost_model": {"a_s": 0.02, "b_s_per_token": 3e-4, "c_s_per_attended_token": 4e-7}}
        )
    )
    assert CostModel.from_engine_json(engine).b_s_per_token == 3e-4
    out = tmp_path / "out"
    argv = ["--rates", "1,4", "--num-requests", "40", "--engine-json", str(engine)]
    assert main([*argv, "--tenant-duration-s", "5", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert len(report["rows"]) == 6
    assert (out / "fig10.png").stat().st_size > 0 and (out / "tenants.png").stat().st_size > 0
    by_policy = {(r["policy"], r["rate_rps"]): r for r in report["rows"]}
    # Iteration-level beats request-level on latency at the same load.
    assert (
        by_policy["fair", 4.0]["latency_p50_s_per_token"]
        < by_policy["request", 4.0]["latency_p50_s_per_token"]
    )


def test_simulate_rejects_bad_cost() -> None:
    assert main(["--cost", "1,2"]) == 2
