"""Saving off the step loop (grpo_learner.background, grpo_learner.saving): snapshots taken at the step, writes in
the background, one in flight, errors surfaced at the next step, a checkpoint before the announcement when asked,
and the incarnation in every announcement. Real fs store and real broker; the store is slowed by an event where a
test needs a write to be in flight."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.weights import FsStoreConfig, Payload, WeightPublisher, WeightStoreConfig, latest_announcement
from grpo_learner import checkpoint
from grpo_learner.background import Buffers, Worker
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.saving import SavePolicy, Saver, next_incarnation


def test_a_background_error_is_raised_once_at_the_next_check() -> None:
    worker = Worker("w")

    def fail() -> None:
        raise OSError("disk on fire")

    worker.submit(fail)
    with pytest.raises(OSError, match="disk on fire"):
        worker.wait()
    worker.check()  # raised once, not again
    worker.submit(lambda: None)
    assert worker.wait() >= 0


def test_buffers_are_reused_and_cast() -> None:
    buffers = Buffers()
    live = {"w": torch.ones(4), "n": {"i": torch.arange(3)}, "meta": [1, "x"]}
    first = buffers.copy(live, torch.bfloat16)
    live["w"].mul_(3)  # the live tensor changes after the snapshot
    assert first["w"].dtype == torch.bfloat16 and first["w"].tolist() == [1.0] * 4
    assert first["n"]["i"].dtype == torch.int64 and first["meta"] == [1, "x"]
    second = buffers.copy(live, torch.bfloat16)
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["w"].tolist() == [3.0] * 4


def test_incarnations_count_starts(tmp_path: Path) -> None:
    assert [next_incarnation(tmp_path) for _ in range(3)] == [0, 1, 2]
    assert (tmp_path / "incarnation").read_text().strip() == "2"


class GatedFs:
    """The fs store, each publish held until the test opens the gate (a slow disk or upload, on demand)."""

    def __init__(self, store: Any) -> None:
        self.store, self.kind = store, store.kind
        self.gate, self.entered = threading.Event(), threading.Event()

    def publish(self, run: str, version: int, files: Mapping[str, Path | Payload]) -> wire.WeightsAnnouncement:
        self.entered.set()
        assert self.gate.wait(30)
        return self.store.publish(run, version, files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _saver(tmp_path: Path, kafka_cfg: KafkaConfig, new_topic: Callable[..., str], gated: bool = False,
           **policy: Any) -> tuple[Saver, WeightPublisher, list[checkpoint.Checkpoint]]:
    fields: dict[str, Any] = {"publish_async": True, "publish_overlap": "wait", "publish_dtype": "auto",
                              "checkpoint_async": True, "checkpoint_on_publish": False, "keep_checkpoints": 2,
                              "fs_root": str(tmp_path / "weights"), "fs_keep": 3, **policy}
    cfg = WeightStoreConfig(fs=FsStoreConfig(root=fields["fs_root"], keep=3))
    run = new_topic("save")
    publisher = WeightPublisher(cfg, kafka_cfg, new_topic("weights"), "unused-weight-data", run)
    if gated:
        publisher.store = GatedFs(publisher.store)  # type: ignore[assignment]
    committed: list[checkpoint.Checkpoint] = []
    config = Payload.of_bytes(b'{"model_type": "test"}')
    saver = Saver(SavePolicy(**fields), tmp_path / "checkpoints", publisher, LearnerMetrics(),
                  {"config.json": config}, incarnation=4, versions=tmp_path / "versions.jsonl",
                  on_committed=committed.append)
    return saver, publisher, committed


def _published(tmp_path: Path, run: str, version: int) -> dict[str, torch.Tensor]:
    path = tmp_path / "weights" / run / f"v{version:08d}" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open is not a mapping


def test_publish_snapshots_at_the_step_and_writes_in_the_background(tmp_path: Path, kafka_cfg: KafkaConfig,
                                                                     new_topic: Callable[..., str]) -> None:
    saver, publisher, _ = _saver(tmp_path, kafka_cfg, new_topic, gated=True, publish_dtype="bfloat16")
    weights = {"w": torch.full((8,), 1.5)}
    spent = saver.publish(1, weights)
    assert spent is not None and publisher.store.entered.wait(10)  # type: ignore[attr-defined]
    weights["w"].fill_(-7.0)  # the learner trains on while v1 is still being written
    assert saver.publishes.busy()
    publisher.store.gate.set()  # type: ignore[attr-defined]
    saver.drain()
    got = _published(tmp_path, publisher.run, 1)["w"]
    assert got.dtype == torch.bfloat16 and got.tolist() == [1.5] * 8  # the step's weights, in the published dtype
    ann = latest_announcement(kafka_cfg, publisher.weights_topic, publisher.run)
    assert ann is not None and (ann.version, ann.incarnation) == (1, 4)
    line = json.loads((tmp_path / "versions.jsonl").read_text().splitlines()[-1])
    assert (line["version"], line["incarnation"], line["sha256"]) == (1, 4, ann.sha256)
    saver.close()
    publisher.close()


@pytest.mark.parametrize("overlap", ["wait", "skip"])
def test_one_publish_in_flight_the_next_waits_or_is_skipped(tmp_path: Path, kafka_cfg: KafkaConfig,
                                                            new_topic: Callable[..., str], overlap: str) -> None:
    saver, publisher, _ = _saver(tmp_path, kafka_cfg, new_topic, gated=True, publish_overlap=overlap)
    weights = {"w": torch.zeros(4)}
    saver.publish(1, weights)
    assert publisher.store.entered.wait(10)  # type: ignore[attr-defined]
    threading.Timer(0.5, publisher.store.gate.set).start()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    second = saver.publish(2, weights)
    if overlap == "wait":
        assert second is not None and time.perf_counter() - t0 >= 0.4  # waited for v1 to be written
        assert saver.metrics.save_wait.labels(kind="publish")._value.get() >= 0.4
    else:
        assert second is None and time.perf_counter() - t0 < 0.4
        assert saver.metrics.publishes_skipped._value.get() == 1
    saver.drain()
    versions = [json.loads(x)["version"] for x in (tmp_path / "versions.jsonl").read_text().splitlines()]
    assert versions == ([1, 2] if overlap == "wait" else [1])
    saver.close()
    publisher.close()


def test_a_failed_background_publish_fails_the_next_step(tmp_path: Path, kafka_cfg: KafkaConfig,
                                                         new_topic: Callable[..., str]) -> None:
    saver, publisher, _ = _saver(tmp_path, kafka_cfg, new_topic)
    saver.publish(1, {"w": torch.tensor([1.0, float("nan")])})
    saver.publishes.join()
    with pytest.raises(checkpoint.CheckpointError, match="non-finite"):
        saver.poll()
    assert not (tmp_path / "versions.jsonl").read_text()  # never announced
    saver.close()
    publisher.close()


def _state(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    opt = torch.optim.AdamW([torch.nn.Parameter(weights["w"])], lr=0.1)
    return {"trainer": {"optimizer": opt.state_dict()}, "rng": checkpoint.rng_state()}


def test_a_checkpoint_is_a_snapshot_of_its_step_written_in_the_background(
        tmp_path: Path, kafka_cfg: KafkaConfig, new_topic: Callable[..., str]) -> None:
    saver, publisher, committed = _saver(tmp_path, kafka_cfg, new_topic)
    weights = {"w": torch.full((16,), 2.0)}
    meta = {"offsets": {"0": 17}, "incarnation": 4}
    saver.checkpoint(10, weights, _state(weights), meta)
    weights["w"].fill_(5.0)  # training goes on
    saver.checkpoints.join()
    saver.poll()
    assert [c.step for c in committed] == [10]
    ckpt = checkpoint.load_latest(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.step == 10 and ckpt.meta["offsets"] == {"0": 17}
    with safe_open(str(ckpt.model_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("w").tolist() == [2.0] * 16
    saver.close()
    publisher.close()


def test_with_checkpoint_on_publish_a_version_is_announced_only_after_its_checkpoint(
        tmp_path: Path, kafka_cfg: KafkaConfig, new_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    saver, publisher, _ = _saver(tmp_path, kafka_cfg, new_topic, checkpoint_on_publish=True)
    gate, real_save = threading.Event(), checkpoint.save

    def slow_save(*args: Any, **kwargs: Any) -> Path:
        assert gate.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", slow_save)
    weights = {"w": torch.ones(4)}
    saver.checkpoint(3, weights, _state(weights), {"offsets": {}})
    saver.publish(3, weights)
    time.sleep(0.5)  # the weights are written by now; the announcement must wait for the checkpoint
    assert not (tmp_path / "versions.jsonl").read_text()
    assert latest_announcement(kafka_cfg, publisher.weights_topic, publisher.run) is None
    gate.set()
    saver.drain()
    ann = latest_announcement(kafka_cfg, publisher.weights_topic, publisher.run)
    assert ann is not None and ann.version == 3
    saver.close()
    publisher.close()


def test_with_checkpoint_on_publish_the_resumed_state_is_announced_without_a_new_checkpoint(
        tmp_path: Path, kafka_cfg: KafkaConfig, new_topic: Callable[..., str]) -> None:
    """At start-up the learner re-publishes the checkpoint it resumed from (or the initial weights): restorable
    as they are, so announced at once."""
    saver, publisher, _ = _saver(tmp_path, kafka_cfg, new_topic, checkpoint_on_publish=True)
    saver.restorable(7)
    saver.publish(7, {"w": torch.ones(4)}, background=False)
    ann = latest_announcement(kafka_cfg, publisher.weights_topic, publisher.run)
    assert ann is not None and ann.version == 7
    saver.close()
    publisher.close()

