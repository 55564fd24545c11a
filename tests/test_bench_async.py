"""``grpo-stream bench async``: the report's arithmetic on known curves, and a short real run of two arms (S and
the pipeline with in-flight swaps) that prints every field and writes the JSON and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_stream.bench import async_bench as ab


def fake(curve: list[tuple[float, float]], gen_s: float = 0.0, train_s: float = 0.0) -> dict:
    return {"curve": curve, "wall_s": 10.0, "tokens": 500, "engine_busy": 0.5, "learner_busy": 0.25,
            "mean_staleness": 1.5, "steps": 20, "gen_s": gen_s, "train_s": train_s}


def test_the_report_times_each_arm_to_the_target_against_s(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    results = {"S": [fake([(0, 0.3), (4, 0.5), (8, 0.7), (9, 0.7)], gen_s=6.0, train_s=4.0)],
               "P v1 inflight": [fake([(0, 0.3), (2, 0.6), (6, 0.8)]), fake([(0, 0.3), (3, 0.65), (4, 0.6)])],
               "P v4 between": [fake([(0, 0.3), (9, 0.4)])]}
    summary = ab.report(results, 0.6, tmp_path)
    assert summary["ideal_ratio"] == pytest.approx(0.6)  # max(6, 4) / (6 + 4)
    p = summary["arms"]["P v1 inflight"]
    assert [r["time_to_target_s"] for r in p["runs"]] == [2, 3]
    assert p["median"]["ratio_to_S"] == pytest.approx(2.5 / 8) and p["min"]["ratio_to_S"] == pytest.approx(2 / 8)
    assert summary["arms"]["P v4 between"]["median"]["time_to_target_s"] is None  # never reached: no ratio
    assert summary["best_pipeline_ratio"] == pytest.approx(2.5 / 8)
    assert p["runs"][0]["reward_gain_per_s"] == pytest.approx(0.05) and p["runs"][0]["tokens_per_s"] == 50
    by_target = summary["ratio_by_target"]  # S holds 0.5 from 4 s; P v1's runs from 2 s and 3 s
    assert list(by_target) == ["0.50", "0.55", "0.60", "0.65", "0.70"]
    assert by_target["0.50"]["P v1 inflight"] == pytest.approx(2.5 / 4) and by_target["0.50"]["P v4 between"] is None
    assert by_target["0.65"]["P v1 inflight"] is None  # 0.8 at the last point only: unconfirmed
    out = capsys.readouterr().out
    assert all(field in out for field in ab.FIELDS) and "ideal ratio 0.600" in out and "min/max" in out
    assert json.loads((tmp_path / "async.json").read_text())["target"] == 0.6
    assert (tmp_path / "async.png").stat().st_size > 1000


def test_arms_are_picked_by_name_or_slug_and_a_run_without_s_reports_no_ratios(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ab.pick_arms(False, None) == ab.ARMS and ab.pick_arms(True, None) == ab.SHORT_ARMS
    picked = ab.pick_arms(False, "P-v1-between, p v1 inflight")
    assert [a.name for a in picked] == ["P v1 between", "P v1 inflight"]
    with pytest.raises(SystemExit, match="unknown arm.*P-v9"):
        ab.pick_arms(False, "S,P-v9")
    summary = ab.report({"P v1 inflight": [fake([(0, 0.3), (2, 0.6), (3, 0.6)])]}, 0.6, tmp_path)
    assert summary["ideal_ratio"] is None and summary["best_pipeline_ratio"] is None
    assert summary["arms"]["P v1 inflight"]["median"]["time_to_target_s"] == 2
    assert "no arm S in this run" in capsys.readouterr().out


def test_the_target_counts_when_two_evaluations_in_a_row_reach_it() -> None:
    # (second, reward, step): a lone spike at 2 s and an unconfirmed last point are not the target reached
    curve = [(0, 0.3, 0), (2, 0.62, 5), (4, 0.5, 9), (6, 0.61, 14), (8, 0.7, 19), (10, 0.4, 24), (12, 0.9, 29)]
    assert ab.time_to(curve, 0.6) == 6 and ab.steps_to(curve, 0.6) == 14
    assert ab.time_to(curve, 0.8) is None and ab.steps_to(curve, 0.8) is None
    assert ab.steps_to([(0, 0.7), (1, 0.7)], 0.6) is None  # curves without steps (older JSON) still time


@pytest.mark.slow
def test_a_short_run_measures_both_kinds_of_arm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("vllm")
    assert ab.main(budget_s=12, short=True, target=0.99, out=str(tmp_path / "b")) == 0
    out = capsys.readouterr().out
    assert all(field in out for field in ab.FIELDS) and "best pipeline ratio to S" in out
    summary = json.loads((tmp_path / "b" / "async.json").read_text())
    assert set(summary["arms"]) == {"S", "P v1 inflight"}
    assert summary["arms"]["S"]["runs"][0]["steps"] >= 1 and summary["sync_warmup_s"] > 0  # S's untimed batch
    assert summary["sync_gen_s"] > 0 and summary["sync_train_s"] > 0 and 0.5 <= summary["ideal_ratio"] < 1
    for name, arm in summary["arms"].items():
        row = arm["runs"][0]
        assert set(row) == set(ab.FIELDS)
        assert row["steps"] >= 1 and row["tokens_per_s"] > 0, (name, row)
        assert 0 < row["engine_busy"] <= 1 and 0 < row["learner_busy"] <= 1, (name, row)
        curve = summary["curves"][name][0]
        assert len(curve) >= 2 and curve[0][0] <= 1.0, (name, curve)  # the first version, then later ones
        assert curve[0][2] == 0 and 1 <= curve[-1][2] <= row["steps"] + 1, (name, curve)  # each point's step
    assert summary["arms"]["P v1 inflight"]["runs"][0]["mean_staleness"] >= 0
    assert (tmp_path / "b" / "async.png").is_file()


def test_a_one_token_task_is_refused_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "async.json").write_text("{}")  # the last run's results
    with pytest.raises(SystemExit, match="copy_short"):  # time-to-target is read off the positions reward
        ab.main(task="last_digit", out=str(tmp_path / "b"))
    assert (tmp_path / "b" / "async.json").is_file()
    assert ab.TASK == "copy_short" and "copy_short" in ab.base_config(
        Path("m"), tmp_path, ab.ARMS[0], 10).feeder["synthetic"]["tasks"]
