"""The chaos run (``grpo-stream chaos``): the real pipeline through a broker of its own; every role kill -9'd once,
the broker stopped and restarted, a near-limit record and malformed ones in every topic, an already-trained group
sent again, the producers scaled 1 -> 3 -> 1; then reconciled from the lineage, the checkpoint and the topics."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_stream.chaos import KILLABLE, Chaos, chaos_config, schedule
from grpo_stream.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
REPLAY_LOSS_TOL = 1e-4  # measured: see docs/getting-started.md, "Replaying a run"


def test_the_schedule_is_seeded_and_complete() -> None:
    assert schedule(3) == schedule(3) and schedule(3) != schedule(4)
    for seed in range(5):
        advances, events = zip(*schedule(seed), strict=True)
        assert all(2 <= a <= 4 for a in advances)
        assert sorted(e for e in events if e.startswith("kill")) == sorted(f"kill {r}" for r in KILLABLE)
        assert {"inject", "scale 3", "broker restart", "duplicate", "damage weights", "damage checkpoint",
                "scale 1"} <= set(events)


def test_chaos_keeps_every_promise(tmp_path: Path) -> None:
    cfg = chaos_config(tmp_path / "run", build_tiny_model(tmp_path / "model"), 256, [])
    result = Chaos(cfg, seed=0, minutes=12).run()  # a passing run ends once drained (~1.5 min here)
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
    # The learner was killed with its newest checkpoint damaged: it resumed from the previous one (set aside the
    # damaged one) and still trained every group once (the audit above).
    assert len(result.damaged) == 1 and result.quarantined == [f"damaged-{result.damaged[0]}"]
    # Each learner kill is a restart, a new incarnation, in the lineage and in what the audit reports.
    assert a.restarts is not None and a.restarts >= result.kills["learner"] and len(a.incarnations) >= 2
    assert any(k.startswith("producer") for k in result.kills)
    assert result.states["feeder"] == "finished" and result.states["learner"] == "running"
    producers = sorted(s for n, s in result.states.items() if n.startswith("producer"))
    assert producers == ["finished", "finished", "running"]  # scaled 1 -> 3 -> 1
    inspect_the_run(tmp_path / "run")
    replay_the_run(tmp_path / "run", tmp_path)


def inspect_the_run(run_dir: Path) -> None:
    """``grpo-stream inspect`` on the chaos run (its broker started again on its recorded ports): every field of
    a trained group, a dropped group with its reason, a group end to end, the summary and the dead letters."""
    import io
    import json
    from contextlib import redirect_stdout

    from grpo_core.jsonl import read_lines
    from grpo_stream import inspect_run

    lineage = list(read_lines(run_dir / "lineage.jsonl"))
    log = inspect_run.RunLog.read(run_dir)
    G = log.learner.pipeline.group_size
    s = inspect_run.summary(log)
    assert s["steps"] == sum(1 for line in lineage if line["trained"])  # no operator_skip, no no_update lines
    assert sum(r["trained"] for r in s["ranges"]) == sum(len(line["trained"]) for line in lineage)
    assert any("duplicate" in r["dropped"] for r in s["ranges"])
    for topic in ("prompts", "completions", "groups"):
        name = log.learner.pipeline.topic(topic)
        assert sum(n for k, n in s["dead_letters"].items() if k.startswith(f"{name}: ")) >= 8, s["dead_letters"]

    step = next(line["step"] for line in lineage if any(e["reason"].startswith("duplicate") for e in line["dropped"]))
    view = inspect_run.step_view(log, step)
    dup = next(g for g in view["dropped"] if g["reason"].startswith("duplicate"))  # re-deliveries: maybe more
    assert dup["group_id"] and len(dup["completions"]) == G  # a dropped group is shown whole, with its reason
    for g in view["trained"]:
        assert {"group_id", "version", "staleness", "partition", "offset", "coordinates", "prompt_id", "prompt",
                "verifier", "reward_mean"} <= set(g)
        assert g["coordinates"] == f"{log.learner.pipeline.topic('groups')}/{g['partition']}/{g['offset']}"
        assert [c["index"] for c in g["completions"]] == list(range(G))
        for c in g["completions"]:
            assert c["spans"][0][0] >= g["version"]  # the group's version is its oldest member's
            assert c["producer"] and c["tokens"] > 0 and c["finish"] in ("stop", "length")
        if len({c["reward"] for c in g["completions"]}) > 1:
            assert abs(sum(c["advantage"] for c in g["completions"])) < 1e-6  # centred per group
    text = inspect_run.format_step(view)
    assert f"step {step}:" in text and "DROPPED: duplicate" in text

    trained = view["trained"][0]["group_id"]
    trace = inspect_run.group_trace(log, trained)
    assert trace["prompts"] and len({c["index"] for c in trace["completions"]}) == G and trace["scored"]
    assert any(o["trained"] and o["step"] == step for o in trace["outcome"])
    out = io.StringIO()
    with redirect_stdout(out):
        assert inspect_run.main(str(run_dir), group=trained, as_json=True) == 0
    assert json.loads(out.getvalue())["group_id"] == trained


def replay_the_run(run_dir: Path, tmp_path: Path) -> None:
    """``grpo-stream replay`` on the chaos run (kills and restarts included): exact reproduces each step's
    recorded loss; an ablation under another loss variant trains the same groups; a trimmed log is named."""
    import json

    from kafka import KafkaAdminClient, TopicPartition

    from grpo_core.jsonl import read_lines
    from grpo_stream import inspect_run, replay

    exact = replay.replay(run_dir, tmp_path / "exact", [], ablation=False)
    steps = [line for line in read_lines(run_dir / "lineage.jsonl") if line["trained"]]  # no skips, no no_update
    recorded = {m["step"] for m in read_lines(run_dir / "metrics.jsonl")}
    assert exact["steps"] == len(steps)
    # Every step with a recorded loss is compared (a kill -9 between a step's checkpoint and its metrics line
    # leaves a trained step without one: metrics.jsonl is not part of the checkpoint).
    assert len(exact["loss_diffs"]) == len({line["step"] for line in steps} & recorded) >= len(steps) - 4
    print(f"exact replay: max |loss - recorded| {exact['max_abs_loss_diff']:.3g} over {exact['steps']} steps")
    assert exact["max_abs_loss_diff"] <= REPLAY_LOSS_TOL
    assert (tmp_path / "exact" / "report.png").exists() and (tmp_path / "exact" / "metrics.jsonl").exists()

    ablation = replay.replay(run_dir, tmp_path / "ablation", ["loss.variant=decoupled_ppo", "groups_per_batch=4"],
                             ablation=True)
    def ids(d: Path) -> list[str]:
        return [e["group_id"] for line in read_lines(d / "lineage.jsonl") for e in line["trained"]]
    assert ids(tmp_path / "ablation") == ids(tmp_path / "exact") == [e["group_id"] for line in steps
                                                                       for e in line["trained"]]
    assert ablation["steps"] == -(-len(ids(tmp_path / "exact")) // 4)
    assert json.loads((tmp_path / "ablation" / "replay.json").read_text())["mode"] == "ablation"
    from grpo_stream.report import write_comparison
    assert write_comparison([run_dir, tmp_path / "exact", tmp_path / "ablation"]).stat().st_size > 1000
    with pytest.raises(SystemExit, match="takes no overrides"):
        replay.replay(run_dir, tmp_path / "x", ["loss.variant=cispo"], ablation=False)

    log = inspect_run.RunLog.read(run_dir, topics=())
    with inspect_run.run_cluster(run_dir, log.learner) as kafka:  # retention strikes: the first records go
        admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        admin.delete_records({TopicPartition(log.learner.pipeline.topic("groups"), 0): 3})
        admin.close()
    with pytest.raises(SystemExit, match=r"no longer in \S*groups \(partition 0: offsets \d+-\d+ \(\d+ records\)\).*"
                                         r"trimmed by retention"):
        replay.replay(run_dir, tmp_path / "trimmed", [], ablation=False)
