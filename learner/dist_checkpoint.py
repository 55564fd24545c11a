"""Sharded learner checkpoints (``parallel.strategy`` ddp/fsdp2): model and optimizer with
``torch.distributed.checkpoint`` (DCP), rank 0's exactly-once state beside them, in one directory that is complete
or absent -- the commit of ``grpo_learner.checkpoint``, extended to N writers.

Layout: ``<dir>/step-00000042/{dcp/{.metadata, __R_0.distcp, ...}, rng/rank-R.pt, trainer.pt, meta.json}``
(trainer.pt: scheduler, reference model, rank 0's RNG; meta.json: the next ``groups`` offsets, the dedup log's
position (``grpo_learner.seen_log``), the step, ``layout: dcp``, the world size). Every rank calls
:meth:`ShardedSaver.save` with the same arguments: rank 0 empties the temporary directory; every rank writes its
RNG state and its shards (DCP's coordinator writes ``.metadata`` only after every rank's files are written and
fsynced; with ``checkpoint_async`` the shards are staged to host memory at the step and written by DCP's thread
while training goes on); once rank 0's save is complete it writes trainer.pt and meta.json and renames the
directory into place (``checkpoint.commit``), the instant the checkpoint exists. A rank killed at any point before
leaves the previous checkpoint the newest.
Multi-node: ``out_dir`` must be the same shared directory on every node.

``torch.distributed.checkpoint`` is imported inside :func:`save` and :func:`load`: it costs 0.5-0.9 s of CPU at
start-up, every learner imports this module, and only a multi-rank learner calls it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_learner import checkpoint
from grpo_learner.background import Buffers
from grpo_learner.parallel import Env
from grpo_learner.trainer import Trainer

log = logging.getLogger(__name__)


def save(root: Path, step: int, trainer: Trainer, env: Env, leader_state: dict[str, Any] | None,
         meta: dict[str, Any] | None, keep: int) -> Path | None:
    """Checkpoint ``step`` (collective) synchronously; rank 0 returns its path, the others None. ``leader_state``
    (extra trainer.pt entries) and ``meta`` are rank 0's."""
    return ShardedSaver(env, background=False).save(root, step, trainer, leader_state, meta, keep)()


class ShardedSaver:
    """Sharded checkpoints of one rank, synchronous or with DCP's ``async_save`` (``checkpoint_async``).

    Asynchronous: each rank stages its shards to host memory (``async_save`` copies them before it returns) and a
    thread of DCP's writes them, coordinating over a gloo group of its own (``new_group``: every rank makes it at
    start-up, in the same order) so that it never interleaves with the training's collectives. The future of rank
    0 resolves once every rank's files and ``.metadata`` are written; rank 0 then writes trainer.pt (its state taken
    at the step) and commits. One checkpoint in flight per rank: the next waits for the previous one's future."""

    def __init__(self, env: Env, background: bool) -> None:
        self.env, self.background = env, background
        self.group = dist.new_group(backend="gloo") if background else None
        self._future: Any = None
        self._buffers = Buffers()

    def save(self, root: Path, step: int, trainer: Trainer, leader_state: dict[str, Any] | None,
             meta: dict[str, Any] | None, keep: int) -> Callable[[], Path | None]:
        """Start checkpoint ``step`` on this rank (collective); returns what finishes it: on rank 0 the commit
        (call it from a background worker when asynchronous; returns the path), on the others a no-op."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        env, tmp = self.env, checkpoint.temp_dir(root, step)
        if env.leader:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written attempt at the same step
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        _save_synced(checkpoint.rng_state(), tmp / "rng" / f"rank-{env.rank}.pt")
        if self.background:
            self._future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "dcp",
                                          process_group=self.group)
        else:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "dcp")
            dist.barrier()  # every rank's RNG file is written
        if not env.leader:
            return lambda: None
        assert leader_state is not None and meta is not None
        state = {"trainer": trainer.state(optimizer=False), **leader_state}
        if self.background:
            state = self._buffers.copy(state)  # taken at this step; trainer.pt is written after the shards
        meta = {**meta, "layout": "dcp", "world_size": env.world, "strategy": env.strategy}

        def finish() -> Path:
            self.wait()  # rank 0's future: every rank's shards and .metadata are written
            torch.save(state, tmp / "trainer.pt")
            return checkpoint.commit(root, tmp, step, meta, keep)

        return finish

    def wait(self) -> None:
        """Until this rank's checkpoint in flight is written; raises its error."""
        future, self._future = self._future, None
        if future is not None:
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()


def load(path: Path, trainer: Trainer, env: Env) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, reference model and this rank's RNG from ``path`` (collective); returns
    trainer.pt (rank 0 takes its dedup set from it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path / "dcp")  # DCP reshards: another world size loads too
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    saved: dict[str, Any] = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    trainer.load_state(saved["trainer"])
    rng = path / "rng" / f"rank-{env.rank}.pt"
    if rng.exists():
        checkpoint.set_rng_state(torch.load(rng, weights_only=False))
    else:
        log.warning("%s has no RNG state for rank %d (written by fewer ranks): its RNG goes on from the seed",
                    path, env.rank)
    return saved


def _save_synced(obj: object, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
