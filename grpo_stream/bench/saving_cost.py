"""``grpo-stream bench publish``: what saving costs the learner's step loop at v = 1 (a publish every step), at
real sizes, on the CPU.

For each preset (random weights; default ``50m`` and ``qwen2.5-0.5b``) one real :class:`grpo_learner.trainer.Trainer`
trains on synthetic scored groups and the real :class:`grpo_learner.saving.Saver` saves it: weights to an ``fs``
store in a temporary directory, announced on Kafka (a throwaway local broker unless ``--bootstrap``), checkpoints
with the learner's atomic commit. The arms run one after the other on the same model, in every repeat:

- ``none``: no publish, no checkpoint (the floor);
- ``sync``: a publish every step and a checkpoint every ``--checkpoint-every`` steps on the step loop's thread
  (``publish_async=false checkpoint_async=false``: the learner before saving moved off it);
- ``async``: the same saves written in the background (``publish_overlap: wait``): the learner now;
- ``async+ckpt-on-publish`` (only when named in ``--arms``): a checkpoint before every publish as well.

Per arm: the mean step time over the timed steps (median/min/max over ``--repeats``) and its ratio to ``none``; the
step loop's seconds per publish and per checkpoint (wait + snapshot; the whole write when synchronous); the write's
seconds (``grpo_stream_learner_publish_seconds``; a checkpoint's timed around the worker's write); the bytes of a
publish and of a checkpoint. Target: async <= 1.10x none. The report extrapolates the measured rates (s/GB) to 7B
and 32B -- arithmetic, not measured. Writes ``<out>/publish.json`` (and ``publish.png`` with matplotlib).

    grpo-stream bench publish [--preset 50m --preset qwen2.5-0.5b] [--repeats 3] [--steps 10] [--warmup 2]
        [--checkpoint-every 10] [--group-size 4] [--prompts 1] [--completion-tokens 32] [--arms none,sync,async]
        [--publish-dtype auto] [--bootstrap host:port] [--out runs/bench-publish]
    grpo-stream bench publish --short   # tiny preset, 1+3 steps per arm, 1 repeat: the test's smoke run
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config
from grpo_core.contract import PipelineContract
from grpo_core.weights import FsStoreConfig, WeightPublisher, WeightStoreConfig, read_announcements
from grpo_learner import checkpoint
from grpo_learner.config import LearnerConfig
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.publish import metadata_payloads, unique_tensors
from grpo_learner.saving import SavePolicy, Saver
from grpo_learner.service import load_model
from grpo_learner.trainer import Trainer
from grpo_stream.bench import temporary_broker
from grpo_stream.bench.learner import synthetic_group
from grpo_stream.tiny_model import build_tiny_model

# arm -> (publish_async, checkpoint_async, checkpoint_on_publish); None: no saving at all
ARMS: dict[str, tuple[bool, bool, bool] | None] = {
    "none": None, "sync": (False, False, False), "async": (True, True, False),
    "async+ckpt-on-publish": (True, True, True)}
DEFAULT_ARMS = ("none", "sync", "async")
DEFAULT_PRESETS = ("50m", "qwen2.5-0.5b")
CACHE = Path(".cache") / "bench-models"
METRIC = "grpo_stream_learner_"
VOCAB = 300  # token ids drawn below the tokenizer's 320 (every preset)


@dataclass
class Plan:
    presets: list[str]
    arms: list[str]
    warmup: int = 2
    steps: int = 10
    repeats: int = 3
    checkpoint_every: int = 10
    group_size: int = 4
    groups: int = 1
    prompt_len: int = 16
    completion_len: int = 32
    publish_dtype: str = "auto"
    out: Path = Path("runs/bench-publish")


class TimedSaver(Saver):
    """The learner's :class:`Saver`, each checkpoint write timed and sized on the thread that writes it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_writes: list[tuple[float, int]] = []  # (seconds, bytes)

    def _write_checkpoint(self, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any],
                          meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        super()._write_checkpoint(step, tensors, state, meta)
        self.checkpoint_writes.append((time.perf_counter() - t0, tree_bytes(self.root / f"step-{step:08d}")))


@dataclass
class Rig:
    """What one arm saves with: its Saver, publisher, metrics and directories (a temporary directory)."""

    saver: TimedSaver
    publisher: WeightPublisher
    metrics: LearnerMetrics
    dir: Path
    run: str
    on_publish: bool
    learner_s: dict[str, list[float]] = field(default_factory=lambda: {"publish": [], "checkpoint": []})


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def batch(rng: np.random.Generator, plan: Plan, step: int) -> list[wire.ScoredGroup]:
    """``plan.groups`` synthetic groups, rewards alternating 0/1 so no group has zero variance."""
    out = []
    for k in range(plan.groups):
        group = synthetic_group(f"s{step}-g{k}-{uuid.uuid4().hex[:6]}", plan.group_size, plan.prompt_len,
                                plan.completion_len, VOCAB, rng)
        group.rewards = [float(i % 2) for i in range(plan.group_size)]
        group.reward_mean, group.reward_std = float(np.mean(group.rewards)), float(np.std(group.rewards))
        out.append(group)
    return out


def make_trainer(preset: str, plan: Plan) -> Trainer:
    model_dir = build_tiny_model(CACHE / f"publish-{preset}", preset=preset)
    cfg = load_config(LearnerConfig, None, [f"model.path={model_dir}", f"pipeline.group_size={plan.group_size}",
                                            f"groups_per_batch={plan.groups}", "pipeline.max_staleness=-1"])
    torch.manual_seed(0)
    return Trainer(cfg, load_model(cfg.model))


def make_rig(arm: str, plan: Plan, trainer: Trainer, kafka: KafkaConfig, topics: PipelineContract,
             tmp: Path) -> Rig:
    flags = ARMS[arm]
    assert flags is not None
    publish_async, checkpoint_async, on_publish = flags
    store = WeightStoreConfig(kind="fs", fs=FsStoreConfig(root=str(tmp / "store")))
    defaults = LearnerConfig()
    policy = SavePolicy(publish_async, "wait", plan.publish_dtype, checkpoint_async, on_publish,
                        defaults.keep_checkpoints, store.fs.root, store.fs.keep)
    run = f"{topics.run}-{arm.replace('+', '_')}-{uuid.uuid4().hex[:6]}"
    publisher = WeightPublisher(store, kafka, topics.topic("weights"), topics.topic("weight_data"), run)
    _ = publisher.producer  # connected before the clock: the learner's publisher is long-lived
    metrics = LearnerMetrics(None)
    saver = TimedSaver(policy, tmp / "checkpoints", publisher, metrics, metadata_payloads(trainer.model), 0,
                       tmp / "versions.jsonl", lambda ckpt: None)
    return Rig(saver, publisher, metrics, tmp, run, on_publish)


def save_after_step(rig: Rig, trainer: Trainer, step: int, checkpoint_due: bool) -> None:
    """What ``Learner._after_step`` saves at v = 1: a checkpoint when due (or before every publish with
    ``checkpoint_on_publish``), then the publish; the step loop's seconds of each kept in ``rig.learner_s``."""
    rig.saver.poll()
    if checkpoint_due or rig.on_publish:
        meta = {"offsets": {}, "run": rig.run, "saved_at": time.time(), "incarnation": 0}
        state = {"trainer": trainer.state(), "rng": checkpoint.rng_state()}
        rig.learner_s["checkpoint"].append(rig.saver.checkpoint(step, unique_tensors(trainer.model), state, meta))
    spent = rig.saver.publish(step, unique_tensors(trainer.model))
    rig.learner_s["publish"].append(spent or 0.0)


def counters(rig: Rig | None) -> dict[str, float]:
    if rig is None:
        return {}
    get = rig.metrics.registry.get_sample_value
    return {"publish_wait": get(METRIC + "save_wait_seconds_total", {"kind": "publish"}) or 0.0,
            "checkpoint_wait": get(METRIC + "save_wait_seconds_total", {"kind": "checkpoint"}) or 0.0,
            "publish_sum": get(METRIC + "publish_seconds_sum") or 0.0,
            "publishes": get(METRIC + "publish_seconds_count") or 0.0,
            "publish_bytes": get(METRIC + "weights_published_bytes_total") or 0.0}


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def arm_result(arm: str, rig: Rig | None, step_s: list[float], train_s: list[float], before: dict[str, float],
               kafka: KafkaConfig, topics: PipelineContract) -> dict[str, Any]:
    """One arm's figures over its timed steps (``before``: the metrics' counters when the clock started)."""
    out: dict[str, Any] = {"step_s": mean(step_s), "train_s": mean(train_s), "steps": len(step_s),
                           "save_s": mean([s - t for s, t in zip(step_s, train_s, strict=True)])}
    if rig is None:
        return out | {"publishes": 0, "checkpoints": 0}
    flags = ARMS[arm]
    assert flags is not None
    after = counters(rig)
    pub, ck = rig.learner_s["publish"], rig.learner_s["checkpoint"]
    written = max(after["publishes"] - before["publishes"], 1.0)
    out |= {"publishes": len(pub), "checkpoints": len(ck), "publish_learner_s": mean(pub),
            "publish_wait_s": (after["publish_wait"] - before["publish_wait"]) / max(len(pub), 1),
            "publish_write_s": (after["publish_sum"] - before["publish_sum"]) / written,
            "publish_bytes": (after["publish_bytes"] - before["publish_bytes"]) / written,
            "checkpoint_learner_s": mean(ck),
            "checkpoint_wait_s": (after["checkpoint_wait"] - before["checkpoint_wait"]) / max(len(ck), 1),
            "checkpoint_write_s": mean([s for s, _ in rig.saver.checkpoint_writes]),
            "checkpoint_bytes": mean([float(b) for _, b in rig.saver.checkpoint_writes])}
    for kind, background in (("publish", flags[0]), ("checkpoint", flags[1])):
        learner, write = out[f"{kind}_learner_s"], out[f"{kind}_write_s"]
        if learner is not None and write is not None:  # the copy into the buffers (and the cast), on the step loop
            out[f"{kind}_snapshot_s"] = max(0.0, learner - out[f"{kind}_wait_s"] - (0.0 if background else write))
    versions = rig.dir / "versions.jsonl"
    out |= {"store_files": sum(1 for p in (rig.dir / "store").rglob("*") if p.is_file()),
            "checkpoint_dirs": sorted(p.name for p in (rig.dir / "checkpoints").glob("step-*")),
            "versions_recorded": len(versions.read_text().splitlines()) if versions.exists() else 0,
            "announced_highest": read_announcements(kafka, topics.topic("weights"), rig.run)[1]}
    return out


def run_arm(arm: str, plan: Plan, trainer: Trainer, kafka: KafkaConfig, topics: PipelineContract,
            rng: np.random.Generator) -> dict[str, Any]:
    """Warm-up steps (saving as timed, a checkpoint at the last), drain, then the timed steps and a final drain."""
    with tempfile.TemporaryDirectory(prefix="grpo-bench-publish-") as tmp:
        rig = make_rig(arm, plan, trainer, kafka, topics, Path(tmp)) if ARMS[arm] is not None else None
        try:
            step = 0
            for _ in range(plan.warmup):  # the buffers allocated, the store and the producer warm
                step += 1
                trainer.train_step(batch(rng, plan, step))
                if rig is not None:
                    save_after_step(rig, trainer, step, step == plan.warmup)
            if rig is not None:
                rig.saver.drain()
                rig.saver.checkpoint_writes.clear()
                for spent in rig.learner_s.values():
                    spent.clear()
            before, step_s, train_s = counters(rig), [], []
            for i in range(1, plan.steps + 1):
                step += 1
                groups = batch(rng, plan, step)
                t0 = time.perf_counter()
                trainer.train_step(groups)
                train_s.append(time.perf_counter() - t0)
                if rig is not None:
                    save_after_step(rig, trainer, step, i % plan.checkpoint_every == 0)
                step_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if rig is not None:
                rig.saver.drain()  # the last step's saves: their write overlaps no step; reported apart
            return arm_result(arm, rig, step_s, train_s, before, kafka, topics) | {
                "drain_s": time.perf_counter() - t0}
        finally:
            if rig is not None:
                rig.saver.close()
                rig.publisher.close()
            del rig
            gc.collect()  # the arm's snapshot buffers (the size of the checkpoint) go before the next arm's


def run_preset(preset: str, plan: Plan, kafka: KafkaConfig, topics: PipelineContract) -> dict[str, Any]:
    """Every arm, every repeat (arms interleaved within a repeat), on one model."""
    t0 = time.perf_counter()
    trainer = make_trainer(preset, plan)
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"[bench publish] {preset}: {params / 1e6:.1f}M params loaded in {time.perf_counter() - t0:.0f}s",
          flush=True)
    rng = np.random.default_rng(0)
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in plan.arms}
    for r in range(plan.repeats):
        for arm in plan.arms:
            t0 = time.perf_counter()
            res = run_arm(arm, plan, trainer, kafka, topics, rng)
            results[arm].append(res)
            print(f"[bench publish] {preset} repeat {r + 1}/{plan.repeats} {arm}: step {res['step_s']:.3f}s "
                  f"(train {res['train_s']:.3f}s), {res['publishes']} publish(es), {res['checkpoints']} "
                  f"checkpoint(s) [{time.perf_counter() - t0:.0f}s]", flush=True)
    return {"params": params, "results": results}


def main(presets: list[str] | None = None, arms: str | None = None, short: bool = False, warmup: int | None = None,
         steps: int | None = None, repeats: int = 3, checkpoint_every: int | None = None,
         group_size: int | None = None, groups: int | None = None, completion_len: int | None = None,
         publish_dtype: str = "auto", bootstrap: str | None = None, out: str = "runs/bench-publish") -> int:
    import logging

    from grpo_stream.bench.saving_report import report
    from grpo_stream.bench.swap import fresh_topics

    names = [a.strip() for a in arms.split(",")] if arms else None
    plan = Plan(list(presets or DEFAULT_PRESETS), names or list(DEFAULT_ARMS), warmup or 2, steps or 10, repeats,
                checkpoint_every or 10, group_size or 4, groups or 1, 16, completion_len or 32, publish_dtype,
                Path(out))
    if short:  # every arm on the tiny preset, a checkpoint inside the three timed steps
        plan = Plan(["tiny"], names or list(ARMS), 1, 3, 1, 2, 4, 1, 16, 16, publish_dtype, Path(out))
    unknown = [a for a in plan.arms if a not in ARMS]
    if unknown or plan.warmup < 1 or plan.group_size < 2:
        raise SystemExit(f"bench publish: arms are {', '.join(ARMS)} (got {unknown}); --warmup >= 1; --group-size"
                         " >= 2")
    for name in ("learner", "grpo_core.weights"):  # a line per publish otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    shutil.rmtree(plan.out, ignore_errors=True)
    data: dict[str, Any] = {}
    with temporary_broker(bootstrap) as addr:
        kafka = KafkaConfig(bootstrap=addr)
        topics = fresh_topics(kafka)
        for preset in plan.presets:
            data[preset] = run_preset(preset, plan, kafka, topics)
    report(plan, data)
    return 0
