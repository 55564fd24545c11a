"""Rank 0 leads, the other ranks follow: how a data-parallel learner keeps its collectives in step.

Rank 0 runs the learner loop of ``grpo_learner.service`` (Kafka, admission, lineage, offsets: one place, as with one
process). Before each thing every rank must take part in -- a training step, a checkpoint, a weight publish (a
gather under FSDP2), a reference reset, a restore, the end -- it broadcasts a :class:`Command`; a follower does
nothing but wait for the next command and run its side of it (:func:`follow`). So the ranks' collectives always
come in the same order, and the followers need no Kafka client, metrics endpoint or signal handling of their own:
rank 0 decides when the job ends, and torchrun ends the whole group when any rank dies.

While rank 0 waits for groups it sends ``KEEPALIVE`` every ``min(60 s, parallel.timeout_s / 4)``, so a quiet
topic never times out the followers' wait.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_learner import dist_checkpoint
from grpo_learner.config import LearnerConfig
from grpo_learner.parallel import Env
from grpo_learner.trainer import Trainer, load_model

log = logging.getLogger(__name__)


class Command(enum.Enum):
    TRAIN = "train"  # rank 0 then scatters the ranks' shares (Trainer.train_step / train_shard)
    CHECKPOINT = "checkpoint"  # (root, step, keep): dist_checkpoint.save on every rank
    PUBLISH = "publish"  # every rank joins the full-state-dict gather; rank 0 publishes
    RESET_REF = "reset_ref"  # pi_ref <- pi_theta (a gather under FSDP2)
    RESTORE = "restore"  # checkpoint path: dist_checkpoint.load on every rank
    KEEPALIVE = "keepalive"  # nothing: rank 0 is waiting for groups
    STOP = "stop"  # the followers return


class Leader:
    """Rank 0's side: announce each collective action before taking it."""

    def __init__(self, env: Env, timeout_s: float) -> None:
        self.env = env
        self.keepalive_s = min(60.0, timeout_s / 4)
        self.told_at = time.monotonic()

    def tell(self, command: Command, arg: Any = None) -> None:
        dist.broadcast_object_list([command.value, arg], src=0)
        self.told_at = time.monotonic()

    def keepalive(self) -> None:
        if time.monotonic() - self.told_at >= self.keepalive_s:
            self.tell(Command.KEEPALIVE)


def receive() -> tuple[Command, Any]:
    message: list[Any] = [None, None]
    dist.broadcast_object_list(message, src=0)
    return Command(message[0]), message[1]


def follow(cfg: LearnerConfig, env: Env) -> int:
    """A follower rank: build the same model and trainer as rank 0, then run its side of each command."""
    torch.manual_seed(cfg.seed + env.rank)
    trainer = Trainer(cfg, load_model(cfg.model, device=env.device), env)
    sharded = dist_checkpoint.ShardedSaver(env, cfg.checkpoint_async)  # in the order rank 0 makes its own
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Rank 0 gets the same signal from torchrun (or k8s), finishes its step, checkpoints (with us) and says STOP.
        signal.signal(sig, lambda signum, _frame: log.info("rank %d: signal %d, waiting for rank 0", env.rank,
                                                           signum))
    steps = 0
    while True:
        command, arg = receive()
        if command is Command.TRAIN:
            trainer.train_shard()
            steps += 1
        elif command is Command.CHECKPOINT:
            root, step, keep = arg
            sharded.save(Path(root), step, trainer, None, None, keep)
        elif command is Command.PUBLISH:
            trainer.full_weights()
        elif command is Command.RESET_REF:
            trainer.reset_reference()
        elif command is Command.RESTORE:
            dist_checkpoint.load(Path(arg), trainer, env)
        elif command is Command.STOP:
            sharded.wait()
            log.info("rank %d: stopped by rank 0 after %d step(s)", env.rank, steps)
            return 0
