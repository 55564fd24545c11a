"""The chaos run (``grpo-stream chaos``): the real pipeline through a broker of its own; every role kill -9'd once,
the broker stopped and restarted, a near-limit record and malformed ones in every topic, an already-trained group
sent again, the producers scaled 1 -> 3 -> 1; then reconciled from the lineage, the checkpoint and the topics."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_stream.chaos import KILLABLE, Chaos, chaos_config, schedule
from grpo_stream.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


def test_the_schedule_is_seeded_and_complete() -> None:
    assert schedule(3) == schedule(3) and schedule(3) != schedule(4)
    for seed in range(5):
        advances, events = zip(*schedule(seed), strict=True)
        assert all(2 <= a <= 4 for a in advances)
        assert sorted(e for e in events if e.startswith("kill")) == sorted(f"kill {r}" for r in KILLABLE)
        assert {"inject", "scale 3", "broker restart", "duplicate", "scale 1"} <= set(events)


def test_chaos_keeps_every_promise(tmp_path: Path) -> None:
    cfg = chaos_config(tmp_path / "run", build_tiny_model(tmp_path / "model"), 256, [])
    result = Chaos(cfg, seed=0, minutes=8).run()
    print("\n".join(result.events))
    print(result.table())
    assert result.broken() == [], result.table()
    a = result.audit
    assert a.fed == a.produced == 256 and a.trained + a.dropped["stale"] >= 256  # each group: trained or stale
    assert a.offsets_pending == 0  # drained: the learner's steps account for the whole groups topic
    # Every injected record is dead-lettered once per topic (8 kinds each), by the role that reads the topic.
    for topic in ("prompts", "completions", "groups"):
        assert sum(n for k, n in a.dead.items() if k.startswith(f"{topic}:")) == 8, a.dead
    assert a.dropped["duplicate"] >= 1  # the already-trained group sent again
    assert set(result.kills) >= {"learner", "verifier-0", "feeder"}
    assert any(k.startswith("producer") for k in result.kills)
    assert result.states["feeder"] == "finished" and result.states["learner"] == "running"
    producers = sorted(s for n, s in result.states.items() if n.startswith("producer"))
    assert producers == ["finished", "finished", "running"]  # scaled 1 -> 3 -> 1
