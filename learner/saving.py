"""What the learner makes durable, and when: checkpoints and weight publishes, off its step loop.

**The rules, in one place.**

- ``checkpoint_every`` alone decides checkpoints. A checkpoint's model, optimizer, RNG, offsets and dedup position
  are all taken on the learner's thread at the same step (the snapshot), then written by a background worker with
  the atomic commit of :mod:`grpo_learner.checkpoint`: a crash before the rename leaves the previous checkpoint the
  newest, with its own offsets and dedup position, so exactly-once holds.
- A publish snapshots the weights (cast to ``publish_dtype``) and a background worker writes them to the store and
  then announces them. Producers never see a half-written version: the stores write atomically or verify the
  sha256, and the announcement follows the write.
- **Versions past the last checkpoint.** When the learner crashes, the versions it announced after its last
  checkpoint are not in any checkpoint. The restarted learner re-trains those steps from the checkpoint's offsets,
  so the same version numbers are announced again with other weights. Every learner start is a new *incarnation*
  (a counter in ``<out_dir>/incarnation``); every announcement, lineage line and ``versions.jsonl`` line carries
  it, producers treat (version, incarnation) as a version's identity, and a restarted learner whose run already
  announced a version past its checkpoint re-announces the checkpoint's weights at once, so producers leave the
  lost weights behind. ``checkpoint_on_publish: true`` checkpoints every publish step before it is announced
  instead: every announced version restorable, at the cost of one checkpoint per publish.

:mod:`grpo_learner.background` holds the workers and the snapshot buffers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_core import wire
from grpo_core.fsutil import fsync_dir
from grpo_core.weights import MODEL_FILE, Payload, WeightPublisher
from grpo_learner import checkpoint
from grpo_learner.background import Buffers, Worker
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.publish import tensors_payload
from grpo_learner.trainer import DTYPES

log = logging.getLogger("learner")



def next_incarnation(out: Path) -> int:
    """This start's incarnation: one more than the previous start's (0 for the first), made durable before anything
    is announced under it."""
    path = out / "incarnation"
    previous = int(path.read_text().strip()) if path.exists() else -1
    tmp = path.with_name("incarnation.tmp")
    with tmp.open("w") as f:
        f.write(f"{previous + 1}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(out)
    return previous + 1


@dataclass
class SavePolicy:
    """The learner config's saving fields (``grpo_learner.config.LearnerConfig``)."""

    publish_async: bool
    publish_overlap: str  # wait | skip
    publish_dtype: str  # auto | float32 | bfloat16 | float16
    checkpoint_async: bool
    checkpoint_on_publish: bool
    keep_checkpoints: int
    fs_root: str
    fs_keep: int


class Saver:
    """The learner's two background savers (one publish and one checkpoint in flight at most) and what they write
    besides the bytes: ``versions.jsonl`` and the metrics. Used from the learner's thread only; the jobs run on
    the workers'."""

    def __init__(self, policy: SavePolicy, root: Path, publisher: WeightPublisher, metrics: LearnerMetrics,
                 model_files: dict[str, Payload], incarnation: int, versions: Path,
                 on_committed: Callable[[checkpoint.Checkpoint], None]) -> None:
        self.policy, self.root, self.publisher, self.metrics = policy, root, publisher, metrics
        self.model_files, self.incarnation, self.on_committed = model_files, incarnation, on_committed
        self.publishes, self.checkpoints = Worker("publish"), Worker("checkpoint")
        self._publish_buffers, self._checkpoint_buffers = Buffers(), Buffers()
        self._committed: checkpoint.Checkpoint | None = None  # set by the checkpoint worker, taken by poll()
        self._committed_step = -1
        self._versions = versions.open("a", encoding="utf-8")

    # ---- on the learner's thread ------------------------------------------------------------------
    def checkpoint(self, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any], meta: dict[str, Any],
                   background: bool | None = None) -> float:
        """Snapshot checkpoint ``step`` and write it (in the background unless ``checkpoint_async`` is off or
        ``background`` is False); returns the seconds the learner's thread spent (wait + snapshot)."""
        t0 = time.perf_counter()
        waited = self.checkpoints.wait()
        self.poll()
        self.metrics.observe_wait("checkpoint", waited)
        if background is False or not self.policy.checkpoint_async:
            self._write_checkpoint(step, tensors, state, meta)
            self.poll()
            return time.perf_counter() - t0
        tensors = self._checkpoint_buffers.copy(tensors, prefix="model")
        state = self._checkpoint_buffers.copy(state, prefix="state")
        self._checkpoint_buffers.sync()
        self.checkpoints.submit(lambda: self._write_checkpoint(step, tensors, state, meta))
        return time.perf_counter() - t0

    def finish_sharded(self, step: int, finish: Callable[[], Path | None], meta: dict[str, Any],
                       background: bool | None = None) -> None:
        """Rank 0's end of a sharded checkpoint (``dist_checkpoint.ShardedSaver``): wait for the shards, write
        trainer.pt, commit; in the background unless ``checkpoint_async`` is off or ``background`` is False."""
        def job() -> None:
            path = finish()
            assert path is not None  # rank 0 commits
            self._commit(step, path, {**meta, "layout": "dcp"})

        if background is False or not self.policy.checkpoint_async:
            job()
            self.poll()
        else:
            self.checkpoints.submit(job)

    def publish(self, step: int, tensors: dict[str, torch.Tensor], background: bool | None = None) -> float | None:
        """Snapshot the weights of version ``step`` and publish them; None when skipped (``publish_overlap: skip``
        with a publish still in flight). Returns the seconds the learner's thread spent."""
        t0 = time.perf_counter()
        asynchronous = background is not False and self.policy.publish_async
        if asynchronous and self.publishes.busy() and self.policy.publish_overlap == "skip":
            self.metrics.publishes_skipped.inc()
            log.debug("v%d not published: the previous publish is still being written", step)
            return None
        self.metrics.observe_wait("publish", self.publishes.wait())
        dtype = DTYPES.get(self.policy.publish_dtype)
        if asynchronous or dtype is not None:
            tensors = self._publish_buffers.copy(tensors, dtype)
            self._publish_buffers.sync()
        if asynchronous:
            self.publishes.submit(lambda: self._write_publish(step, tensors))
        else:
            self._write_publish(step, tensors)
        return time.perf_counter() - t0

    def restorable(self, step: int) -> None:
        """The state of ``step`` can be restored without a new checkpoint (the one resumed from, or the initial
        weights of ``model.path``): with ``checkpoint_on_publish`` its version may be announced at once."""
        self._committed_step = max(self._committed_step, step)

    def poll(self) -> None:
        """After every step: raise a background error as this step's, and hand a committed checkpoint over."""
        self.publishes.check()
        self.checkpoints.check()
        committed, self._committed = self._committed, None
        if committed is not None:
            self.on_committed(committed)

    def drain(self) -> None:
        """Wait for both workers (stopping, or a save that must be durable now); raises their errors."""
        self.checkpoints.wait()
        self.publishes.wait()
        self.poll()

    def close(self) -> None:
        self._versions.close()

    # ---- on a worker's thread ---------------------------------------------------------------------
    def _write_checkpoint(self, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any],
                          meta: dict[str, Any]) -> None:
        refuse_non_finite(step, tensors.items(), "checkpoint")
        files = {MODEL_FILE: tensors_payload(tensors), **self.model_files}
        self._commit(step, checkpoint.save(self.root, step, {"model": files}, state, meta,
                                           keep=self.policy.keep_checkpoints), meta)

    def _commit(self, step: int, path: Path, meta: dict[str, Any]) -> None:
        self._committed_step = step
        self._committed = checkpoint.Checkpoint(path, {**meta, "step": step})

    def _write_publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        refuse_non_finite(version, tensors.items(), "publish")
        weights = tensors_payload(tensors)
        try:
            ann = self.publisher.publish(version, {MODEL_FILE: weights, "config.json": self.model_files["config.json"]})
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise checkpoint.no_space(f"publishing weights v{version}", Path(self.policy.fs_root), weights.size,
                                      f"free space there, or lower weights.fs.keep ({self.policy.fs_keep})"
                                      ) from None
        ann.incarnation = self.incarnation
        if self.policy.checkpoint_on_publish:
            # The checkpoint of this step was submitted before this publish: announce only once it is committed,
            # so every announced version can be restored (a failed checkpoint raises from its own worker).
            self.checkpoints.join()
            if self._committed_step < version:
                log.warning("v%d written but not announced: its checkpoint did not commit", version)
                return
        self.publisher.announce(ann)
        self._record(ann)
        self.metrics.observe_publish(version, ann.size_bytes, time.perf_counter() - t0)
        log.info("published weights v%d (incarnation %d, %d bytes, sha256 %s) in %.2fs", version, self.incarnation,
                 ann.size_bytes, ann.sha256[:12], time.perf_counter() - t0)

    def _record(self, ann: wire.WeightsAnnouncement) -> None:
        """One ``versions.jsonl`` line per announced version: which bytes a (version, incarnation) named."""
        line = {"version": ann.version, "incarnation": ann.incarnation, "sha256": ann.sha256,
                "size_bytes": ann.size_bytes, "store": ann.store, "published_at": ann.published_at}
        self._versions.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._versions.flush()


def refuse_non_finite(step: int, tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Weights with NaN/Inf are never checkpointed or published (updates that would make them are skipped, so
    they came from elsewhere): the learner exits, and the restart resumes from the newest good checkpoint."""
    bad = checkpoint.non_finite(tensors)
    if bad:
        raise checkpoint.CheckpointError(
            f"step {step}: the weights hold non-finite values ({bad}); refusing to {what} them. The learner "
            "exits: restarted, it resumes from its newest intact checkpoint")
