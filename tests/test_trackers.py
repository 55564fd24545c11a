"""Experiment trackers (``grpo_core.trackers``): a learner with ``report_to: [tensorboard, wandb]`` writes its
per-step metrics, the same as metrics.jsonl, and its config as hyperparameters; both read back here with the
trackers' own formats (TensorBoard's event reader, W&B's offline record file). Nothing leaves the machine:
``WANDB_MODE=offline``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaAdminClient
from test_learner_service import synthetic_group
from test_producer_service import wait_for

from grpo_core import wire
from grpo_core.config import ConfigError, KafkaConfig
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_producer
from grpo_core.topics import ensure_topics
from grpo_core.trackers import check_installed, hparams, scalars
from grpo_learner.lineage import read_lines
from grpo_stream.tiny_model import build_tiny_model

G, B = 4, 2


def test_a_metrics_line_becomes_scalars_and_a_config_flat_hyperparameters() -> None:
    line = {"step": 3, "time": 1.0, "loss": 0.5, "timings": {"forward": 0.1}, "staleness": [1, 2, 3],
            "dropped": ["stale"], "kl": float("nan"), "flag": True, "version_span": []}
    assert scalars(line) == {"loss": 0.5, "timings/forward": 0.1, "staleness_mean": 2.0, "flag": 1.0}
    assert hparams({"loss": {"variant": "grpo", "eps": 0.2}, "report_to": ["wandb"], "x": None}) == {
        "loss.variant": "grpo", "loss.eps": 0.2, "report_to": "['wandb']", "x": "None"}
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'"):
        check_installed(["mlflow"])


def wandb_records(path: Path) -> Iterator[object]:
    """The records of a W&B run file (LevelDB's log format: 7-byte header, 32 KiB blocks of crc32c, length,
    type; a record may span blocks), as W&B's own protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_finished(path: Path) -> bool:
    """Whether the run file holds the run's ``exit`` record yet. ``finish()`` returns before W&B's service process
    has written everything to disk: a CI run once read this file with the ``run`` record still missing, and found
    it complete afterwards."""
    from google.protobuf.message import DecodeError

    if path.stat().st_size < 7:  # not even the file header is written yet
        return False
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path))
    except DecodeError:  # a record still being written
        return False


def test_the_learner_reports_to_tensorboard_and_wandb(tmp_path: Path, kafka_cfg: KafkaConfig,
                                                      admin: KafkaAdminClient, unique: Callable,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_core.config import load_config
    from grpo_learner.config import LearnerConfig
    from grpo_learner.service import Learner

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    plan = PipelineContract(run=unique("track"), group_size=G, max_staleness=-1)
    plan.topics.groups.partitions = 1
    ensure_topics(admin, plan)
    rng = np.random.default_rng(6)
    producer = make_producer(kafka_cfg, "test")
    for i in range(2 * B):
        g = synthetic_group(f"k{i}@e0r0", version=0, rng=rng)
        producer.send(plan.topic("groups"), key=g.group_id.encode(), value=wire.encode(g))
    producer.close()
    out, model = tmp_path / "run", build_tiny_model(tmp_path / "model")
    learner = Learner(load_config(LearnerConfig, None, [
        f"kafka.bootstrap={kafka_cfg.bootstrap}", f"out_dir={out}", f"model.path={model}", "metrics.port=-1",
        f"weights.fs.root={tmp_path / 'weights'}", f"groups_per_batch={B}", "publish_every=100", "max_steps=2",
        f"pipeline.run={plan.run}", f"pipeline.group_size={G}", "pipeline.max_staleness=-1",
        "pipeline.topics.groups.partitions=1", "report_to=[tensorboard, wandb]", "optim.lr=0.003"]))
    try:
        learner.restore()
        assert learner.run() == 2
    finally:
        learner.close()
    lines = list(read_lines(out / "metrics.jsonl"))

    events = EventAccumulator(str(out / "tensorboard" / "learner"))
    events.Reload()
    assert {"loss", "reward_mean", "timings/forward", "staleness_mean"} <= set(events.Tags()["scalars"])
    for key in ("loss", "reward_mean"):
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(key)] == [
            (m["step"], m[key]) for m in lines]
    from tensorboard.plugins.hparams import plugin_data_pb2

    data = [plugin_data_pb2.HParamsPluginData.FromString(c) for c in events.PluginTagToContent("hparams").values()]
    [hp] = [d.session_start_info for d in data if d.HasField("session_start_info")]
    assert hp.hparams["optim.lr"].number_value == pytest.approx(0.003)

    [run_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    wait_for(lambda: wandb_finished(run_file), 60, f"the exit record in {run_file}")
    records = list(wandb_records(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type) == (plan.run, "learner")
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in run.config.update}
    assert config["optim.lr"] == 0.003 and config["groups_per_batch"] == B
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], pytest.approx(h["loss"], rel=1e-6)) for h in history] == [
        (m["step"], m["loss"]) for m in lines]
