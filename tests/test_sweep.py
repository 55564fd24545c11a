"""``grpo-stream sweep``: arms from names and a grid, the budget and lockstep settings, resume, the report's
table and figure; and the short mode for real (configs/sweeps/smoke.yaml: two arms x two seeds through the broker)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from grpo_core.config import ConfigError, load_config
from grpo_stream import sweep, sweep_report
from grpo_stream.sweep import SweepConfig

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "sweeps" / "smoke.yaml"


def _cfg(tmp_path: Path, *extra: str) -> SweepConfig:
    return load_config(SweepConfig, SMOKE, [f"out_dir={tmp_path / 'sweep'}", f"base={REPO / 'configs/demo.yaml'}",
                                            *extra])


def test_arms_come_from_names_and_every_grid_combination(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "grid={learner.publish_every: [1, 4], learner.grad_steps_per_batch: [1, 2]}")
    assert list(sweep.arm_names(cfg)) == ["v1-i1", "v2-i2", "publish_every=1,grad_steps_per_batch=1",
                                          "publish_every=1,grad_steps_per_batch=2",
                                          "publish_every=4,grad_steps_per_batch=1",
                                          "publish_every=4,grad_steps_per_batch=2"]
    runs = sweep.plan(cfg)
    assert len(runs) == 6 * 2 and runs[0].out == tmp_path / "sweep" / "v1-i1" / "seed0"
    with pytest.raises(ConfigError, match="both a named arm and a grid combination"):
        _cfg(tmp_path, "arms={publish_every=1: {learner.publish_every: 1}}", "grid={learner.publish_every: [1]}")
    with pytest.raises(ConfigError, match="unknown key"):  # a typo in an arm is refused before any run
        sweep.plan(_cfg(tmp_path, "arms={x: {learner.publish_evry: 1}}"))


def test_the_budget_and_lockstep_become_run_overrides(tmp_path: Path) -> None:
    [v1, *_] = sweep.plan(_cfg(tmp_path))
    assert v1.overrides[-1] == "learner.max_steps=4"  # 256 samples / (4 groups x G 16)
    cfg = _cfg(tmp_path, "lockstep=true", "budget.max_steps=3")
    v2 = sweep.plan(cfg)[2]
    assert v2.arm == "v2-i2" and v2.overrides[-4:] == [
        "producers.config.max_backlog_groups=4", "producers.config.max_version_lag=0", "pipeline.max_staleness=2",
        "learner.max_steps=3"]
    assert sweep.base_config("configs/demo.yaml").name == "demo.yaml"  # a checkout path or the shipped one
    with pytest.raises(ConfigError, match="does not exist"):
        sweep.base_config("configs/nope.yaml")


def _fake_run(calls: list[str]) -> Any:
    """Stands in for run_demo: writes what a finished run leaves (the report's inputs) without running."""
    def run_demo(*, out: str, seed: int, **kwargs: Any) -> dict[str, Any]:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        calls.append(f"{d.parent.name}/{seed}")
        (d / "run-config.yaml").write_text("pipeline: {group_size: 16}\n")
        rewards = [0.4, 0.6, 0.9 if seed == 0 else 0.7, 0.95]
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * i, "eval_reward": r, "time": 100.0 + 30 * i,
                                                          "pass_at_1": r / 2}) + "\n" for i, r in enumerate(rewards)))
        (d / "lineage.jsonl").write_text("".join(json.dumps({"step": s, "dropped": [], "trained": [
            {"staleness": s % 3}] * 4}) + "\n" for s in range(1, 7)))
        summary = {"final_eval_reward": rewards[-1], "initial_eval_reward": 0.4, "weight_versions_published": 7,
                   "learner_steps": 6, "groups_dropped_stale": 1, "groups_dropped_other": 0, "wall_seconds": 90.0}
        (d / "summary.json").write_text(json.dumps(summary))
        return summary

    return run_demo


def test_a_restarted_sweep_skips_finished_runs_and_reports_every_arm(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_stream import demo

    calls: list[str] = []
    monkeypatch.setattr(demo, "run_demo", _fake_run(calls))
    cfg = _cfg(tmp_path, "target=0.9")
    (tmp_path / "sweep" / "v2-i2" / "seed1").mkdir(parents=True)  # started, killed: no final evaluation
    (tmp_path / "sweep" / "v2-i2" / "seed1" / "summary.json").write_text('{"learner_steps": 2}')
    sweep.run_sweep(cfg, emit=lambda line: None)
    assert calls == ["v1-i1/0", "v1-i1/1", "v2-i2/0", "v2-i2/1"]
    sweep.run_sweep(cfg, emit=calls.append)
    assert sum("done before, skipped" in c for c in calls) == 4
    table = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "greedy decoding, mean exact match" in table and "Pass@1: exact match" in table
    assert "partial credit per digit" in sweep_report.measures("copy_short")
    row = next(line for line in table.splitlines() if line.startswith("| v1-i1 "))
    # final 0.95 both seeds; best 0.95; Pass@1 0.475; seed 0 reaches 0.9 at step 4 (samples 4 steps x 64), seed 1
    # at step 6; 7 pushes; staleness 1.0 mean, p95 2; 1 dropped; 90 s
    assert row == ("| v1-i1 | 2 | 0.950 ± 0.000 | 0.950 ± 0.000 | 0.475 ± 0.000 | 5 ± 1 (2/2) | 320 ± 64 (2/2) | "
                   "7 ± 0 | 1.00 ± 0.00 | 2.0 ± 0.0 | 1 ± 0 | 90 ± 0 |")
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_short_sweep_runs_two_arms_by_two_seeds(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.cli", "sweep", str(SMOKE), f"out_dir={out}",
                           f"base={REPO / 'configs/demo.yaml'}"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "sweep.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| v")]
    assert [r.split(" | ")[0] for r in rows] == ["| v1-i1", "| v2-i2"] and all(" | 2 | " in r for r in rows)
    assert all("-" not in r.split(" | ")[4] for r in rows), table  # a Pass@1 for every arm
    for arm in ("v1-i1", "v2-i2"):
        for seed in (0, 1):
            run = out / arm / f"seed{seed}"
            assert json.loads((run / "summary.json").read_text())["learner_steps"] == 4
            evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
            assert evals[0]["step"] == 0 and all(0 <= e["pass_at_1"] <= 1 for e in evals if "pass_at_1" in e)
    assert (out / "sweep.png").stat().st_size > 10_000
