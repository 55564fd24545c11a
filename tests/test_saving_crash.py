"""kill -9 of the learner in the middle of a background publish and of an asynchronous checkpoint: it resumes from
the last complete checkpoint, nothing is trained twice, no offset is unaccounted for, every announcement names
bytes that were completely written, and the versions re-trained after the crash are announced under a new
incarnation. A real broker, a learner process, a model big enough (~12M parameters) that its writes take a while,
and a kill sent the moment the write's temporary directory appears."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from kafka import KafkaAdminClient
from test_learner_service import _announcements, _start, synthetic_group

from grpo_core import wire
from grpo_core.config import KafkaConfig, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_producer
from grpo_core.topics import ensure_topics
from grpo_learner import checkpoint
from grpo_learner.lineage import read_lines
from grpo_stream.tiny_model import build_tiny_model

G, B, STEPS, EVERY = 4, 2, 12, 4


def _kill_when(marker: Callable[[], Path | None], lineage: Path, after_step: int, proc: Any, timeout_s: float = 240
               ) -> Path:
    """SIGKILL ``proc`` as soon as ``marker()`` finds a write in flight, once the learner is past ``after_step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the learner exited before the write could be interrupted"
        if lineage.exists() and any(line["step"] > after_step for line in read_lines(lineage)):
            found = marker()
            if found is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return found
        time.sleep(0.0005)
    raise AssertionError("no write in flight was seen")


def _in_flight(root: Path, pattern: str, past: int) -> Callable[[], Path | None]:
    """The temporary directory of a write of a step (a version) past ``past``, if one is being written now."""
    def find() -> Path | None:
        try:
            return next((p for p in root.glob(pattern) if int(p.name.split("-")[-1 if "step" in p.name else 1]
                                                                 .lstrip("v")) > past), None)
        except FileNotFoundError:
            return None
    return find


@pytest.mark.slow
@pytest.mark.parametrize("during", ["publish", "checkpoint"])
def test_kill9_during_a_background_save_loses_nothing(tmp_path: Path, kafka_cfg: KafkaConfig,
                                                      admin: KafkaAdminClient, unique: Callable[[str], str],
                                                      during: str) -> None:
    plan = PipelineContract(run=unique("crash"), group_size=G, max_staleness=-1)
    plan.topics.groups.partitions = 1
    ensure_topics(admin, plan)
    model_dir = build_tiny_model(tmp_path / "model", hidden=512, heads=8, layers=3, intermediate=2048)
    out, weights = tmp_path / "run", tmp_path / "weights"
    config = tmp_path / "learner.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": to_dict(plan), "out_dir": str(out), "kafka": {"bootstrap": kafka_cfg.bootstrap},
        "model": {"path": str(model_dir)}, "optim": {"lr": 1e-3}, "metrics": {"port": -1},
        "weights": {"kind": "fs", "fs": {"root": str(weights), "keep": 3}},
        "groups_per_batch": B, "publish_every": 1, "checkpoint_every": EVERY, "max_steps": STEPS}))
    rng = np.random.default_rng(0)
    sender = make_producer(kafka_cfg, "test")
    ids = []
    for i in range(B * STEPS):
        g = synthetic_group(f"p{i}@e0r0", version=0, rng=rng)
        ids.append(g.group_id)
        sender.send(plan.topic("groups"), key=g.group_id.encode(), value=wire.encode(g))
    sender.close()

    lineage = out / "lineage.jsonl"
    proc = _start(config)
    if during == "publish":
        cut = _kill_when(_in_flight(weights / plan.run, ".tmp-v*", EVERY + 1), lineage, EVERY + 1, proc)
    else:
        cut = _kill_when(_in_flight(out / "checkpoints", ".tmp-step-*", EVERY), lineage, EVERY, proc)
    assert cut.exists(), f"the kill came after {cut.name} was complete"  # it was cut mid-write
    resumed = checkpoint.load_latest(out / "checkpoints")
    assert resumed is not None and resumed.step % EVERY == 0 and resumed.meta["incarnation"] == 0
    base = resumed.step

    proc = _start(config)
    assert proc.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    if during == "checkpoint":
        assert not cut.exists(), "the interrupted checkpoint was cleaned up at start-up"
    # (an interrupted version's directory in the store is swept once stale: weights.common.STALE_S)

    lines = list(read_lines(lineage))
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert {line["incarnation"] for line in lines if line["step"] <= base} == {0}
    assert {line["incarnation"] for line in lines if line["step"] > base} == {1}
    trained = [e["group_id"] for line in lines for e in line["trained"]]
    assert sorted(trained) == sorted(ids), "every group trained exactly once"
    offsets = sorted(e["offset"] for line in lines for e in line["trained"] + line["dropped"])
    assert offsets == list(range(len(ids))), "every offset accounted for once"
    assert checkpoint.load_latest(out / "checkpoints").step == STEPS

    anns = _announcements(kafka_cfg, plan.topic("weights"), plan.run)
    versions = [json.loads(x) for x in (out / "versions.jsonl").read_text().splitlines()]
    recorded = {(v["version"], v["incarnation"]): v["sha256"] for v in versions}
    for ann in anns:  # every announcement names bytes that were written in full before it was sent
        assert recorded.get((ann.version, ann.incarnation)) in (ann.sha256, None)
        assert not ann.location.startswith(f"{plan.run}/.tmp-")
        path = weights / ann.location
        if path.exists() and ann is anns[-1]:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == ann.sha256
    assert (anns[-1].version, anns[-1].incarnation) == (STEPS, 1)
    again = {v["version"] for v in versions if v["incarnation"] == 1}
    assert set(range(base + 1, STEPS + 1)) <= again  # re-trained versions, announced under incarnation 1
