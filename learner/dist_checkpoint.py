"""Sharded learner checkpoints (``parallel.strategy`` ddp/fsdp2): model and optimizer with
``torch.distributed.checkpoint`` (DCP), rank 0's exactly-once state beside them, in one directory that is complete
or absent -- the commit of ``grpo_learner.checkpoint``, extended to N writers.

Layout: ``<dir>/step-00000042/{dcp/{.metadata, __R_0.distcp, ...}, rng/rank-R.pt, trainer.pt, meta.json}``
(trainer.pt: scheduler, reference model, rank 0's RNG; meta.json: the next ``groups`` offsets, the dedup log's
position (``grpo_learner.seen_log``), the step, ``layout: dcp``, the world size). Every rank calls :func:`save`
with the same arguments: rank 0 empties the temporary directory; every rank writes its shards (DCP's ``save``
returns on all ranks only after the coordinator has written ``.metadata``, which it does after every rank's files
are written and fsynced) and its RNG state; after a barrier rank 0 writes trainer.pt and meta.json and renames the
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_learner import checkpoint
from grpo_learner.parallel import Env
from grpo_learner.trainer import Trainer

log = logging.getLogger(__name__)


def save(root: Path, step: int, trainer: Trainer, env: Env, leader_state: dict[str, Any] | None,
         meta: dict[str, Any] | None, keep: int) -> Path | None:
    """Checkpoint ``step`` (collective); rank 0 returns its path, the others None. ``leader_state`` (extra
    trainer.pt entries) and ``meta`` are rank 0's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = checkpoint.temp_dir(root, step)
    if env.leader:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written attempt at the same step
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "dcp")
    _save_synced(checkpoint.rng_state(), tmp / "rng" / f"rank-{env.rank}.pt")
    dist.barrier()
    if not env.leader:
        return None
    assert leader_state is not None and meta is not None
    torch.save({"trainer": trainer.state(optimizer=False), **leader_state}, tmp / "trainer.pt")
    meta = {**meta, "layout": "dcp", "world_size": env.world, "strategy": env.strategy}
    return checkpoint.commit(root, tmp, step, meta, keep)


def load(path: Path, trainer: Trainer, env: Env) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, reference model and this rank's RNG from ``path`` (collective); returns
    trainer.pt (rank 0 takes its dedup set from it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path / "dcp")  # DCP reshards: another world size loads too
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    saved = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
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
