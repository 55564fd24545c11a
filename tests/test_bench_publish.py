"""``grpo-stream bench publish``: the report's arithmetic (pure functions) and the short mode, which runs every arm --
none, sync, async, async+ckpt-on-publish -- for a few steps of the tiny preset with the real Saver, an fs store and
announcements on the session broker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_stream.bench.saving_cost import ARMS
from grpo_stream.bench.saving_report import FIELDS, extrapolate, ratios, summarize, verdict

STEP_FIELDS = ("step_s", "train_s", "save_s", "drain_s", "publishes", "checkpoints")


def test_ratio_verdict_and_extrapolation() -> None:
    def run(step: float, **kw: float) -> dict[str, float]:
        return {"step_s": step, **kw}

    saved = {"publish_bytes": 2e9, "checkpoint_bytes": 6e9}
    summary = summarize({
        "none": [run(1.0), run(1.2), run(1.1)],
        "sync": [run(3.0, publish_write_s=2.0, checkpoint_write_s=9.0, **saved)],
        "async": [run(1.1, publish_snapshot_s=0.2, checkpoint_snapshot_s=0.6, publish_write_s=2.5,
                      checkpoint_write_s=12.0, **saved)]})
    rel = ratios(summary)
    assert rel == pytest.approx({"none": 1.0, "sync": 3.0 / 1.1, "async": 1.0})
    assert verdict(rel).endswith("(target <= 1.10x): MET")
    assert verdict({"none": 1.0, "async": 1.2}).endswith("MISSED")
    ex = extrapolate("qwen2.5-0.5b", summary, every=10)
    # writes from the sync arm (1 s/GB publish, 1.5 s/GB checkpoint), snapshots from the async arm (0.1 s/GB)
    assert ex["rates_s_per_gb"] == pytest.approx({"publish_write_s_per_gb": 1.0, "publish_snapshot_s_per_gb": 0.1,
                                                  "checkpoint_write_s_per_gb": 1.5,
                                                  "checkpoint_snapshot_s_per_gb": 0.1})
    measured, b7, b32 = ex["rows"]
    assert (measured["kind"], b7["kind"], b32["kind"]) == ("measured", "arithmetic", "arithmetic")
    assert measured["publish_write_s"] == pytest.approx(2.0)
    assert b7["publish_write_s"] == pytest.approx(15.2) and b7["checkpoint_gb"] == pytest.approx(91.2)
    assert b32["checkpoint_write_s"] == pytest.approx(390.0 * 1.5)
    assert b7["hidden_if_step_s"] == pytest.approx(15.2 + 91.2 * 1.5 / 10)


@pytest.mark.slow
def test_the_short_mode_runs_every_arm_and_saves(tmp_path: Path, kafka_bootstrap: str) -> None:
    out = tmp_path / "bp"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.cli", "bench", "publish", "--short", "--bootstrap",
                           kafka_bootstrap, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "publish.json").read_text())
    results = data["results"]["tiny"]
    assert set(results) == set(ARMS)
    for arm, runs in results.items():
        assert len(runs) == 1, (arm, runs)
        r = runs[0]
        assert r["steps"] == 3 and r["step_s"] > 0 and r["train_s"] > 0, (arm, r)
        if arm == "none":
            assert set(STEP_FIELDS) <= set(r) and r["publishes"] == r["checkpoints"] == 0, r
            continue
        missing = [f for f in FIELDS if not isinstance(r.get(f), int | float)]
        assert not missing, (arm, missing, r)
        # three timed publishes, each written, announced and recorded (one more from the warm-up)
        assert r["publishes"] == 3 and r["publish_bytes"] > 0 and r["publish_write_s"] > 0, (arm, r)
        assert r["versions_recorded"] == 4 and r["announced_highest"] == 4 and r["store_files"] > 0, (arm, r)
        # the timed checkpoint (every 2 steps; every publish with ckpt-on-publish) committed
        assert r["checkpoints"] == (3 if arm == "async+ckpt-on-publish" else 1), (arm, r)
        assert r["checkpoint_bytes"] > r["publish_bytes"] and r["checkpoint_write_s"] > 0, (arm, r)
        assert r["checkpoint_dirs"] and all(d.startswith("step-") for d in r["checkpoint_dirs"]), (arm, r)
        assert r["publish_learner_s"] >= 0 and r["publish_snapshot_s"] >= 0, (arm, r)
    summary = data["presets"]["tiny"]
    assert set(summary["ratios"]) == set(ARMS) and "target <= 1.10x" in summary["verdict"]
    assert [row["model"] for row in data["extrapolation"]["rows"]] == ["tiny", "7B", "32B"]
    printed = proc.stdout
    for arm in ARMS:
        assert f"\n    {arm} " in printed, arm
    for header in ("step loop:", "per publish:", "per checkpoint:", "written:", "extrapolation from tiny",
                   "arithmetic", "measured", "async step time ="):
        assert header in printed, header
    pytest.importorskip("matplotlib")
    assert (out / "publish.png").stat().st_size > 10_000
