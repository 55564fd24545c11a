"""``grpo-stream bench throughput``: the report's arithmetic (pure functions) and the short mode, which runs every
arm -- S, S-hybrid, the four pipeline arms and TRL's GRPOTrainer -- for a few steps of the tiny preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_stream.bench.throughput import ARMS, DEMO, Plan, preset_scenario, window_rate
from grpo_stream.bench.throughput_report import ideal_ratio, ratios, summarize, verdicts

FIELDS = ("steps_per_s", "steps_measured", "generated_tokens_per_s", "generated_completions_per_s",
          "trained_tokens_per_s", "engine_busy", "learner_busy", "staleness", "arm_seconds")


def test_the_window_starts_at_the_end_of_the_warm_up() -> None:
    assert window_rate([10.0, 12.0, 13.0, 14.0], 1) == (3 / 4, 3, 4.0)
    assert window_rate([10.0, 12.0, 13.0, 14.0], 2) == (2 / 2, 2, 2.0)
    assert window_rate([10.0, 12.0], 2) == (0.0, 0, 0.0)  # nothing measured after the warm-up


def _fake(rates: dict[str, list[float]], gen: float = 2.0, train: float = 1.0) -> dict[str, list[dict[str, float]]]:
    out = {arm: [{"steps_per_s": r} for r in rs] for arm, rs in rates.items()}
    for run in out.get("S", []):
        run |= {"gen_s_per_step": gen, "train_s_per_step": train}
    return out


def test_ratios_ideal_and_verdicts() -> None:
    results = _fake({"S": [0.30, 1 / 3, 0.40], "S-hybrid": [0.4, 0.4, 0.4], "P v1 inflight": [0.5, 0.6, 0.7],
                     "TRL": [0.2, 0.2, 0.2]})
    summary = summarize(results)
    assert summary["S"]["steps_per_s"] == {"median": 1 / 3, "min": 0.30, "max": 0.40}
    assert ideal_ratio(summary) == {"gen_s": 2.0, "train_s": 1.0, "ratio": 1.5}
    rel = ratios(summary)
    assert rel["P v1 inflight"] == pytest.approx({"S": 1.8, "S-hybrid": 1.5, "TRL": 3.0})
    lines = verdicts(Plan(preset_scenario("50m", DEMO.lengths), ARMS), summary)
    assert lines[0] == "best pipeline arm: P v1 inflight"
    assert "P v1 inflight / S = 1.80 (target >= 1.6): MET" in lines[1]
    assert "P v1 inflight / S-hybrid = 1.50 (target >= 1.2): MET" in lines[2]
    assert "P v1 inflight / TRL = 3.00 (target >= 1.3): MET" in lines[3]
    assert "1.20 of the ideal 1.50 (target >= 0.85): MET" in lines[4]  # 1.8 / 1.5: above the ideal (noise)
    assert "balance 2.00x" in lines[5]
    demo = verdicts(Plan(DEMO, ARMS), summarize(_fake({"P demo": [1.0], "TRL": [4.0]})))
    assert demo == ["P demo / TRL = 0.25 (target >= 0.5): MISSED"]


def test_predict_combines_steps_to_target_with_steps_per_second(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_stream import cli
    from grpo_stream.bench import predict

    run = tmp_path / "demo-seed0"
    run.mkdir()
    evals = [(0, 0.4), (20, 0.96), (40, 0.80), (60, 0.95), (80, 0.97), (100, 1.0)]  # 20 alone: not held
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval_reward": r}) + "\n" for s, r in evals))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 1000.0 + 0.5 * s}) + "\n"
                                               for s in range(1, 101)))
    tp = tmp_path / "throughput.json"
    tp.write_text(json.dumps({"summary": {"P demo": {"steps_per_s": {"median": 2.5, "min": 2, "max": 3}}}}))
    assert predict.steps_to_target([{"step": s, "eval_reward": r} for s, r in evals], 0.95) == 60
    assert predict.main(str(tp), [str(run)], "P demo", 0.95) == 0
    row = json.loads((tmp_path / "predict.json").read_text())["runs"][0]
    # 59 steps at 2.5 steps/s predicted; the run took 0.5 s a step: 29.5 s measured.
    assert row == {"run": str(run), "steps_to_target": 60, "predicted_s": 23.6, "measured_s": 29.5,
                   "error": pytest.approx(23.6 / 29.5 - 1)}
    assert "mean absolute error 20.0%" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not in"):
        predict.main(str(tp), [str(run)], "P v1", 0.95)
    # the documented command line: the run directories after the options
    (tmp_path / "predict.json").unlink()
    assert cli.main(["bench", "predict", "--throughput", str(tp), "--arm", "P demo", "--target", "0.95",
                     str(run)]) == 0
    assert json.loads((tmp_path / "predict.json").read_text())["runs"][0]["steps_to_target"] == 60


@pytest.mark.slow
def test_the_short_mode_runs_every_arm_and_reports_every_field(tmp_path: Path) -> None:
    out = tmp_path / "tp"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.cli", "bench", "throughput", "--short", "--out",
                           str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "throughput.json").read_text())
    assert set(data["results"]) == {a.name for a in ARMS}
    for arm, runs in data["results"].items():
        assert len(runs) == 1 and runs[0]["steps_measured"] == 3, (arm, runs)
        for field in FIELDS:
            assert isinstance(runs[0].get(field), int | float), (arm, field)
        assert runs[0]["steps_per_s"] > 0 and runs[0]["trained_tokens_per_s"] > 0, (arm, runs)
        if arm.startswith("P "):  # the producer's counters and the CPUs by role over the window
            assert runs[0]["generated_tokens_per_s"] > 0 and {"learner", "producer-0", "rest"} <= set(
                runs[0]["cpu_by_role"]), (arm, runs)
    assert data["ideal"]["ratio"] >= 1.0 and set(data["ratios"]["TRL"]) == {"S", "S-hybrid", "TRL"}
    assert data["results"]["TRL"][0]["trl_version"]
    printed = proc.stdout
    for arm in data["results"]:
        assert f"\n{arm} " in printed
    assert "ideal ratio" in printed and "best pipeline arm" in printed and "not matched" in printed
    assert (out / "throughput.png").stat().st_size > 10_000
