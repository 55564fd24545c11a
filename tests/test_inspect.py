"""``grpo-stream inspect``'s step view (the chaos test runs the rest of inspect on a real run): a step's groups
come from every lineage line of that step -- a ``no_update`` line drops groups at the step number of the line
before it (nothing trainable was left to take them), and those drops belong to the step's view too."""

from __future__ import annotations

import pytest

from grpo_learner.config import LearnerConfig
from grpo_stream import inspect_run


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
