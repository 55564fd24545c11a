"""``grpo-stream inspect``'s step view (the chaos test runs the rest of inspect on a real run): a step's groups
come from every lineage line of that step -- a ``no_update`` line drops groups at the step number of the line
before it (nothing trainable was left to take them), and those drops belong to the step's view too. The views
also name the learner's incarnations (a restarted learner announces version numbers again), read from synthetic
run files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_learner.config import LearnerConfig
from grpo_stream import inspect_run
from grpo_stream.versions import read_incarnations


def entry(offset: int, reason: str = "", staleness: int = 0) -> dict:
    return {"partition": 0, "offset": offset, "group_id": f"g{offset}", "staleness": staleness,
            **({"reason": reason} if reason else {})}


def test_a_step_view_holds_the_drops_of_its_no_update_lines() -> None:
    lineage = [{"step": 4, "trained": [entry(0)], "dropped": []},
               {"step": 5, "trained": [entry(1), entry(2)], "dropped": [entry(3, "stale: 9 > 8")]},
               {"step": 5, "trained": [], "dropped": [entry(4, "duplicate: g1 trained at step 5")], "no_update": True}]
    log = inspect_run.RunLog(LearnerConfig(), lineage)
    view = inspect_run.step_view(log, 5)
    assert [g["offset"] for g in view["trained"]] == [1, 2]
    assert [g["reason"].split(":")[0] for g in view["dropped"]] == ["stale", "duplicate"]
    assert all(g["missing"] for g in view["trained"] + view["dropped"])  # no groups topic read here
    with pytest.raises(SystemExit, match="no learner step 6 in the lineage \\(steps 4-5\\)"):
        inspect_run.step_view(log, 6)


def restarted_run(out: Path) -> list[dict]:
    """A run whose learner started three times: incarnation 0 announced v10-v12, crashed, and incarnation 1
    (resumed from the checkpoint of step 10) announced v10 again with the same bytes, v11-v13 with others;
    incarnation 2 (resumed at step 11) announced nothing and dropped the feed's tail. Returns the lineage."""
    lineage = [{"step": 10, "incarnation": 0, "trained": [{**entry(0), "version": 10}], "dropped": []},
               {"step": 11, "incarnation": 1, "trained": [{**entry(1), "version": 11}], "dropped": []},
               {"step": 11, "incarnation": 2, "trained": [], "dropped": [entry(2, "stale: 9 > 8")], "no_update": True}]
    announced = [(10, 0, "a"), (11, 0, "b"), (12, 0, "c"), (10, 1, "a"), (11, 1, "d"), (12, 1, "e"), (13, 1, "f")]
    (out / "lineage.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lineage))
    (out / "versions.jsonl").write_text("".join(
        json.dumps({"version": v, "incarnation": i, "sha256": sha * 64, "size_bytes": 8, "store": "fs",
                    "published_at": 0.0}) + "\n" for v, i, sha in announced))
    (out / "incarnation").write_text("2\n")
    return lineage


def test_the_views_name_the_learners_incarnations(tmp_path: Path) -> None:
    lineage = restarted_run(tmp_path)
    log = inspect_run.RunLog(LearnerConfig(), lineage, incarnations=read_incarnations(tmp_path, lineage))
    s = inspect_run.summary(log)
    assert (s["incarnations"], s["restarts"], s["announced_other_weights"]) == ([0, 1, 2], 2, [11, 12])
    assert ("versions announced again after a restart: v10-v12 (incarnations 0 -> 1); with other weights: v11, v12"
            in inspect_run.format_summary(s))
    step = inspect_run.step_view(log, 11)
    assert step["incarnations"] == [1, 2]
    assert inspect_run.format_step(step).startswith("step 11: 1 trained, 1 dropped (incarnations 1 and 2)")
    assert inspect_run.format_step(inspect_run.step_view(log, 10)).startswith("step 10: 1 trained, 0 dropped "
                                                                              "(incarnation 0)")


def test_a_groups_view_flags_a_version_announced_with_other_weights(tmp_path: Path) -> None:
    """v11 names two sets of weights (incarnation 0's, lost in its crash, and incarnation 1's): the group's
    records do not say which sampled it. v10 was announced again with the same bytes: one set, no flag."""
    lineage = restarted_run(tmp_path)
    log = inspect_run.RunLog(LearnerConfig(), lineage, incarnations=read_incarnations(tmp_path, lineage))
    trace = inspect_run.group_trace(log, "g1")
    assert trace["outcome"][0]["incarnation"] == 1
    assert trace["weights"] == [{"version": 11, "announcements": [{"incarnation": 0, "sha256": "b" * 12},
                                                                  {"incarnation": 1, "sha256": "d" * 12}],
                                 "ambiguous": "announced by incarnations 0 and 1"}]
    assert (f"v11: i0 sha256 {'b' * 12}, i1 sha256 {'d' * 12}  AMBIGUOUS: announced by incarnations 0 and 1"
            in inspect_run.format_trace(trace))
    same = inspect_run.group_trace(log, "g0")["weights"]
    assert same == [{"version": 10, "announcements": [{"incarnation": 0, "sha256": "a" * 12},
                                                      {"incarnation": 1, "sha256": "a" * 12}]}]


def test_a_run_from_before_incarnations_says_nothing_of_them(tmp_path: Path) -> None:
    lineage = [{"step": 4, "trained": [{**entry(0), "version": 3}], "dropped": []}]
    (tmp_path / "lineage.jsonl").write_text(json.dumps(lineage[0]) + "\n")
    log = inspect_run.RunLog(LearnerConfig(), lineage, incarnations=read_incarnations(tmp_path, lineage))
    text = inspect_run.format_summary(inspect_run.summary(log))
    assert "incarnation" not in text and "announced again" not in text
    assert inspect_run.format_step(inspect_run.step_view(log, 4)).startswith("step 4: 1 trained")
    trace = inspect_run.group_trace(log, "g0")
    assert trace["weights"] == [] and "weights" not in inspect_run.format_trace(trace)
