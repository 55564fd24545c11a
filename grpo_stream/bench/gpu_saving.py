"""The GPU check's saving section: what publishing the weights at every step (v = 1) costs the learner's step loop.

A publish is two parts (:mod:`grpo_learner.saving`): on the learner's thread, the *snapshot* -- the weights copied
device-to-host into pinned buffers kept from one publish to the next, cast to ``publish_dtype`` -- and on a
background thread the *write*: serialise, sha256, write and fsync to the weight store, then announce. On the check's
model (Qwen2.5-0.5B's shape; the tiny one in ``--smoke``), its paper learner config at i = 1 and its train batch,
this section measures:

- the snapshot alone: ``Buffers().copy`` of the model's unique tensors into bf16 buffers; the first call allocates
  them, the next ``SNAPSHOT_CALLS - 1`` are timed: seconds and GB/s;
- the step loop, per mode on one trainer, the i = 1 section's timed steps after its warm-up (1 + 3 on the GPU,
  1 + 1 in ``--smoke``): ``alone`` (the train step only),
  ``async`` (each step followed by a publish through the learner's real :class:`~grpo_learner.saving.Saver`:
  publish_async, overlap wait, bf16) and ``sync`` (publish_async off: the step loop writes). Per mode: the mean
  step time and its ratio to ``alone``, the step loop's seconds and wait per publish, the write's seconds (the
  learner's ``publish_seconds`` histogram) and the bytes per publish.

The weights go to an ``fs`` store in a temporary directory and are not announced (:class:`UnannouncedPublisher`).
No threshold: it is a measurement, and the section fails only on an error. In the JSON under ``saving``.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.weights import FsStoreConfig, WeightPublisher, WeightStoreConfig
from grpo_learner.background import Buffers
from grpo_learner.config import LearnerConfig
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.publish import metadata_payloads, unique_tensors
from grpo_learner.saving import SavePolicy, Saver
from grpo_learner.trainer import DTYPES, Trainer, load_model

if TYPE_CHECKING:
    from grpo_stream.bench.gpu_check import Plan, Report

SNAPSHOT_CALLS = 3
PUBLISH_DTYPE = "bfloat16"
MODES = {"async": True, "sync": False}  # mode -> publish_async
METRIC = "grpo_stream_learner_"


class UnannouncedPublisher(WeightPublisher):
    """The learner's publisher, writing to the store as it does, with the announcement left out."""

    def announce(self, ann: wire.WeightsAnnouncement) -> None:
        """Nothing: the GPU machine has no broker. What is measured is what a publish costs the learner there --
        the snapshot, then the store's write, sha256 and fsync; an announcement is one small record after them
        (``grpo-stream bench publish`` measures it with a broker)."""


def timed_steps(trainer: Trainer, groups: list[wire.ScoredGroup], sync: Callable[..., None], n: int,
                after: Callable[[], None]) -> list[float]:
    """``n`` steps, each the train step then ``after()`` (the publish), timed from an idle GPU to an idle GPU."""
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        trainer.train_step(groups)
        after()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def steps_for(timed: int, deadline: float, modes_left: int, warm_s: float) -> int:
    """``timed``, or fewer when the section's share of the budget would run out (a timed step costs about what its
    mode's warm-up did; the modes still to run share what is left)."""
    if warm_s <= 0:
        return timed
    return max(1, min(timed, int((deadline - time.monotonic()) / modes_left / warm_s)))


def snapshot(model: torch.nn.Module, sync: Callable[..., None]) -> dict[str, Any]:
    """The publish's snapshot alone, into buffers of its own (the Saver's are made per mode)."""
    tensors = unique_tensors(model)
    buffers, times = Buffers(), []
    for _ in range(SNAPSHOT_CALLS):
        sync()  # the training kernels still queued are not the copy's
        t0 = time.perf_counter()
        copies = buffers.copy(tensors, DTYPES[PUBLISH_DTYPE])
        buffers.sync()
        times.append(time.perf_counter() - t0)
    seconds = sum(times[1:]) / (SNAPSHOT_CALLS - 1)
    on_gpu = next(iter(tensors.values())).is_cuda
    return {"bytes": buffers.bytes, "tensors": len(tensors), "s": seconds, "first_s": times[0],
            "gb_per_s": buffers.bytes / seconds / 1e9, "pinned": on_gpu and all(c.is_pinned() for c in copies.values())}


def make_saver(name: str, publish_async: bool, cfg: LearnerConfig, model: torch.nn.Module,
               tmp: Path) -> tuple[Saver, UnannouncedPublisher, LearnerMetrics]:
    """The learner's Saver as ``learner/service.py`` builds it, on an fs store under ``tmp``; no checkpoints."""
    tmp.mkdir(parents=True)
    store = WeightStoreConfig(kind="fs", fs=FsStoreConfig(root=str(tmp / "store")))
    policy = SavePolicy(publish_async, "wait", PUBLISH_DTYPE, True, False, cfg.keep_checkpoints, store.fs.root,
                        store.fs.keep)
    publisher = UnannouncedPublisher(store, KafkaConfig(), "gpu-check.weights", "gpu-check.weight-data",
                                     f"gpu-check-{name}")
    metrics = LearnerMetrics()
    saver = Saver(policy, tmp / "checkpoints", publisher, metrics, metadata_payloads(model), 0,
                  tmp / "versions.jsonl", lambda _: None)
    return saver, publisher, metrics


def publish_mode(name: str, trainer: Trainer, cfg: LearnerConfig, groups: list[wire.ScoredGroup],
                 sync: Callable[..., None], steps: tuple[int, int], tmp: Path, deadline: float,
                 modes_left: int) -> dict[str, Any]:
    """One publishing mode: a publish after every step. The warm-up's write is not drained before the timed steps:
    at v = 1 each write overlaps the next step, the first timed one's included."""
    saver, publisher, metrics = make_saver(name, MODES[name], cfg, trainer.model, tmp / name)
    get = metrics.registry.get_sample_value
    versions = itertools.count(1)
    loop_s: list[float] = []  # the step loop's seconds per publish (wait + snapshot; + the write when sync)

    def publish() -> None:
        spent = saver.publish(next(versions), unique_tensors(trainer.model))
        saver.poll()
        loop_s.append(spent or 0.0)

    try:
        warm = timed_steps(trainer, groups, sync, steps[0], publish)
        n = steps_for(steps[1], deadline, modes_left, sum(warm) / len(warm))
        waited = get(METRIC + "save_wait_seconds_total", {"kind": "publish"}) or 0.0
        loop_s.clear()
        timed = timed_steps(trainer, groups, sync, n, publish)
        waited = (get(METRIC + "save_wait_seconds_total", {"kind": "publish"}) or 0.0) - waited
        saver.drain()  # the last writes, before the metrics are read
    finally:
        saver.publishes.join()
        saver.close()
        publisher.close()
    written = get(METRIC + "publish_seconds_count") or 0.0
    if written != steps[0] + n:
        raise RuntimeError(f"saving {name}: {written:.0f} versions written of {steps[0] + n} published")
    return {"step_s": sum(timed) / n, "steps": n, "publishes": int(written), "loop_s": sum(loop_s) / n,
            "wait_s": waited / n, "write_s": (get(METRIC + "publish_seconds_sum") or 0.0) / written,
            "bytes": (get(METRIC + "weights_published_bytes_total") or 0.0) / written}


def measure(plan: Plan, cfg: LearnerConfig, groups: list[wire.ScoredGroup], deadline: float) -> dict[str, Any]:
    """The step alone, the snapshot, then each publishing mode, on one trainer; a temporary directory for the stores."""
    from grpo_stream.bench import gpu_check as gc

    gc.free_memory()
    sync = gc.make_sync(plan.device)
    # The i = 1 section's counts; one warm-up step at least: it allocates the optimizer state and the buffers.
    steps = (max(1, plan.steps[cfg.grad_steps_per_batch][0]), plan.steps[cfg.grad_steps_per_batch][1])
    trainer = Trainer(cfg, load_model(cfg.model))
    try:
        warm = timed_steps(trainer, groups, sync, steps[0], lambda: None)
        n = steps_for(steps[1], deadline, 1 + len(MODES), sum(warm) / len(warm))
        alone = timed_steps(trainer, groups, sync, n, lambda: None)
        data: dict[str, Any] = {"publish_dtype": PUBLISH_DTYPE, "i": cfg.grad_steps_per_batch,
                                "warmup": steps[0], "alone": {"step_s": sum(alone) / n, "steps": n},
                                "snapshot": snapshot(trainer.model, sync)}
        with tempfile.TemporaryDirectory(prefix="gpu-check-saving-") as tmp:
            data["store"] = str(Path(tmp).parent)
            for left, name in zip(range(len(MODES), 0, -1), MODES, strict=True):
                data[name] = publish_mode(name, trainer, cfg, groups, sync, steps, Path(tmp), deadline, left)
                data[name]["ratio"] = data[name]["step_s"] / data["alone"]["step_s"]
        return data
    finally:
        del trainer
        gc.free_memory()


def saving_section(plan: Plan, cfg: LearnerConfig, groups: list[wire.ScoredGroup], deadline: float,
                   report: Report) -> None:
    """Measure (:func:`measure`), then the rows and ``report.data["saving"]``."""
    data = measure(plan, cfg, groups, deadline)
    snap, alone = data["snapshot"], data["alone"]
    into = "pinned buffers" if snap["pinned"] else "host buffers (a memcpy on cpu)"
    report.row("saving snapshot", f"{snap['bytes'] / 1e9:.3g} GB ({snap['tensors']} tensors, {PUBLISH_DTYPE}) "
                                  f"device-to-host into {into}: {snap['s']:.4f} s, {snap['gb_per_s']:.1f} GB/s (mean "
                                  f"of calls 2-{SNAPSHOT_CALLS}; the first, allocating, {snap['first_s']:.3f} s)")
    report.row("saving step alone", f"{alone['step_s']:.3f} s (mean of {alone['steps']} timed step(s) after "
                                    f"{data['warmup']} warm-up; i={data['i']}, no publish)")
    for name, where in (("async", "background write"), ("sync", "write on the step loop")):
        m = data[name]
        report.row(f"saving step {name} publish",
                   f"{m['step_s']:.3f} s = {m['ratio']:.2f}x alone ({m['steps']} timed step(s)); per publish: step "
                   f"loop {m['loop_s']:.3f} s (wait {m['wait_s']:.3f} s), {where} {m['write_s']:.3f} s, "
                   f"{m['bytes'] / 1e6:.4g} MB (fs store in {data['store']}: write, sha256, fsync; not announced)")
    numbers = [snap["s"], snap["gb_per_s"], alone["step_s"],
               *(data[n][k] for n in MODES for k in ("step_s", "write_s", "bytes"))]
    if not all(math.isfinite(x) and x > 0 for x in numbers):
        raise RuntimeError(f"saving: a measurement is not a positive number: {numbers}")
    report.data["saving"] = data
