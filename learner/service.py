"""The learner process: read scored groups, train, checkpoint, publish weights (``grpo-stream learner``).

Checkpoints and publishes are snapshotted on the step loop and written in the background; when each happens, and
what a crash does to the versions announced after the last checkpoint, is in ``grpo_learner.saving``. At start-up
the checkpoint's weights are (re-)published when the run's newest announcement is missing, older than the
checkpoint implies, or past it (weights lost with the previous incarnation).

Under ``torchrun`` (``parallel.strategy`` ddp/fsdp2) this process is rank 0 and everything here stays its own; each
step, checkpoint, publish and reference reset is first announced to the other ranks (``grpo_learner.ranks``), which
take their part in it. Checkpoints are then sharded (``grpo_learner.dist_checkpoint``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, cast

import torch

from grpo_core import wire
from grpo_core.config import ConfigError, load_config, to_dict
from grpo_core.kafka_io import DeadLetters, assigned_lag, make_consumer, make_producer
from grpo_core.metrics import Liveness
from grpo_core.process import serve
from grpo_core.staleness import staleness
from grpo_core.trackers import Trackers
from grpo_core.weights import WeightPublisher, read_announcements
from grpo_learner import checkpoint, dist_checkpoint, parallel
from grpo_learner.config import LearnerConfig
from grpo_learner.lineage import Lineage
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.parallel import Env
from grpo_learner.publish import metadata_payloads, unique_tensors
from grpo_learner.ranks import Command, Leader, follow
from grpo_learner.saving import SavePolicy, Saver, next_incarnation
from grpo_learner.seen_log import SeenLog
from grpo_learner.source import GroupSource, Pick, SourceRules, lineage_entries
from grpo_learner.trainer import StepStats, Trainer, load_model

__all__ = ["Learner", "load_model", "main"]

log = logging.getLogger("learner")


def announcement_is_behind(latest: wire.WeightsAnnouncement | None, step: int, publish_every: int,
                           contract: str) -> bool:
    """Whether a (re)starting learner must publish its weights now: nothing announced yet, the last announcement
    older than the last publish step the checkpoint implies, past the checkpoint (weights of steps that died with
    the previous incarnation: producers must leave them for weights this learner has), or from a learner with
    another contract (a run name reused with other settings: the producers refuse those weights, and would wait
    for the next publication)."""
    if latest is None:
        return True
    return latest.version < step - step % publish_every or latest.version > step or latest.contract != contract


def check_layout(ckpt: checkpoint.Checkpoint | None, env: Env | None) -> None:
    """A one-process checkpoint resumes one process, a sharded one a ddp/fsdp2 learner (any world size)."""
    if ckpt is None or (ckpt.layout == "dcp") == (env is not None):
        return
    if env is None:
        raise ConfigError(f"checkpoint {ckpt.path} is sharded (written by parallel.strategy="
                          f"{ckpt.meta.get('strategy')} on {ckpt.meta.get('world_size')} rank(s)): resume it with the "
                          "same parallel.strategy (under torchrun), or use another out_dir for a one-process run")
    raise ConfigError(f"checkpoint {ckpt.path} was written by a one-process learner (parallel.strategy=none): "
                      f"resume it with parallel.strategy=none, or use another out_dir for a {env.strategy} run")


class Learner:
    def __init__(self, cfg: LearnerConfig, env: Env | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.out = Path(cfg.out_dir or f"runs/{cfg.pipeline.run}")
        self.out.mkdir(parents=True, exist_ok=True)
        self.incarnation = next_incarnation(self.out)
        torch.manual_seed(cfg.seed)
        self.rejected: list[str] = []  # checkpoints found damaged at start-up (counted once metrics exist)
        self.ckpt, model = self._newest_good_state()
        self.trainer = Trainer(cfg, model, env)
        # Right after the trainer, as on the other ranks (follow()): its gloo group is made by every rank in order.
        self.sharded = dist_checkpoint.ShardedSaver(env, cfg.checkpoint_async) if env is not None else None
        self.model_files = metadata_payloads(model)  # config.json & co., rendered once for every save/publish
        self.leader = Leader(env, cfg.parallel.timeout_s) if env is not None else None
        self.step = 0
        trackers = Trackers(cfg.report_to, self.out, cfg.pipeline.run, "learner", to_dict(cfg)) if cfg.report_to \
            else None
        self.metrics = LearnerMetrics(self.out / "metrics.jsonl", trackers)
        self.metrics.checkpoints_rejected.inc(len(self.rejected))
        self.sender = make_producer(cfg.kafka, "learner")
        self.dead = DeadLetters(self.sender, cfg.pipeline.topic("dlq"), "learner",
                                on_dead=lambda reason: self.metrics.dead.labels(reason=reason).inc(),
                                max_record_bytes=cfg.pipeline.record_limit("dlq", cfg.kafka))
        max_len = cfg.max_seq_len or int(getattr(model.config, "max_position_embeddings", 0) or 0)
        rules = SourceRules(cfg.pipeline.group_size, cfg.accept_partial, cfg.pipeline.max_staleness, max_len,
                            cfg.advantages.zero_variance == "drop", cfg.min_valid_rewards)
        consumer = make_consumer(cfg.kafka, "learner", cfg.pipeline.group("learner"))
        self.source = GroupSource(consumer, cfg.pipeline.topic("groups"), self.dead, rules, cfg.dedup_window)
        # Its own uncompressed producer: weight chunks do not compress, lz4 would only burn CPU.
        if cfg.weights.kind == "kafka":
            cfg.weights.kafka.check_fits(cfg.kafka, cfg.pipeline.topic_spec("weight_data"))
        self.publisher = WeightPublisher(cfg.weights, cfg.kafka, cfg.pipeline.topic("weights"),
                                         cfg.pipeline.topic("weight_data"), cfg.pipeline.run,
                                         contract=cfg.pipeline.digest())
        self.lineage = Lineage(self.out / "lineage.jsonl", self.incarnation)
        self.seen_log = SeenLog(self.out / "checkpoints", cfg.dedup_window)
        policy = SavePolicy(cfg.publish_async, cfg.publish_overlap, cfg.publish_dtype, cfg.checkpoint_async,
                            cfg.checkpoint_on_publish, cfg.keep_checkpoints, cfg.weights.fs.root, cfg.weights.fs.keep)
        self.saver = Saver(policy, self.out / "checkpoints", self.publisher, self.metrics, self.model_files,
                           self.incarnation, self.out / "versions.jsonl", self._committed)
        self.stopping = False
        self.liveness, self._lag_at, self._last_lag = Liveness(cfg.metrics.stall_s), 0.0, 0
        self.last_group_at = time.monotonic()

    # ---- start-up ----------------------------------------------------------------------------------
    def _newest_good_state(self) -> tuple[checkpoint.Checkpoint | None, torch.nn.Module]:
        """The newest checkpoint that passes its integrity check and holds finite weights, and the model loaded
        from it (or from ``model.path`` for a fresh run); each one rejected on the way is moved aside."""
        cfg, env, root = self.cfg, self.env, self.out / "checkpoints"
        while True:
            ckpt = checkpoint.load_latest(root, repair=True, on_reject=lambda path, why: self.rejected.append(why))
            check_layout(ckpt, env)
            if env is not None:  # the sharded checkpoint is loaded into the wrapped model by restore()
                return ckpt, load_model(cfg.model, device=env.device)
            model = load_model(cfg.model, ckpt.model_dir if ckpt else None)
            bad = checkpoint.non_finite(model.state_dict().items()) if ckpt is not None else ""
            if not bad:
                return ckpt, model
            assert ckpt is not None
            self.rejected.append(f"non-finite weights ({bad})")
            log.warning("checkpoint %s is not used: its weights hold non-finite values (%s)", ckpt.path, bad)
            checkpoint.quarantine(ckpt.path)

    def restore(self) -> None:
        """Resume from the newest checkpoint (model, optimizer, RNG, offsets, dedup set) or start fresh."""
        offsets = None
        if self.ckpt is not None:
            if self.env is None:
                state = self.ckpt.trainer_state()
                self.trainer.load_state(state["trainer"])
                checkpoint.set_rng_state(state["rng"])
            else:
                self._tell(Command.RESTORE, str(self.ckpt.path))
                state = dist_checkpoint.load(self.ckpt.path, self.trainer, self.env)
            self.step = self.ckpt.step
            ref = self.ckpt.meta.get("seen_log")
            if ref is not None:
                seen = self.seen_log.restore(ref)
            else:  # a checkpoint from before the dedup log: trainer.pt holds the set
                seen = state["seen"]
                self.seen_log.start(seen)
            self.source.restore_seen(seen)
            offsets = {int(p): int(o) for p, o in self.ckpt.meta["offsets"].items()}
            log.info("resumed from %s (step %d, offsets %s)", self.ckpt.path, self.step, offsets)
        else:
            self.seen_log.start([])
        # Lineage lines past the checkpoint describe updates that died with the previous process.
        dropped = self.lineage.truncate_after(self.step, offsets or {})
        if dropped:
            log.info("lineage: dropped %d line(s) past step %d (not in the restored model)", dropped, self.step)
        self.source.start(offsets, self.cfg.start_from)
        self.saver.restorable(self.step)
        self._operator_skip()
        latest, highest = read_announcements(self.cfg.kafka, self.cfg.pipeline.topic("weights"),
                                             self.cfg.pipeline.run)
        self.source.newest_announced = highest
        if self.cfg.publish_initial and announcement_is_behind(latest, self.step, self.cfg.publish_every,
                                                               self.cfg.pipeline.digest()):
            if latest is not None and latest.version > self.step:
                log.warning("the run announced v%d (incarnation %d) past this checkpoint (step %d): those weights "
                            "were lost with the previous incarnation; announcing the checkpoint's as v%d, "
                            "incarnation %d", latest.version, latest.incarnation, self.step, self.step,
                            self.incarnation)
            self.publish(background=False)

    def _operator_skip(self) -> None:
        """Apply ``skip_to``: record the skipped ranges, then checkpoint the new position, so the skip is durable
        and audited before anything is trained past it (after a crash in between, the same skip is applied again
        and recorded once). A target at or behind the position does nothing: restarting with it is harmless."""
        targets = {int(p): o for p, o in self.cfg.skip_to.items()}
        skipped = self.source.skip_to(targets)
        if not skipped:
            return
        new = [r for r in skipped if r not in self.lineage.skips()]
        if new:
            self.lineage.record(self.step, [], [], operator_skip=new)
        log.warning("operator skip at step %d: %s", self.step, skipped)
        self.save_checkpoint(background=False)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        while not self._done():
            pick = self.source.next_batch(self.step, cfg.groups_per_batch, self._should_stop, cfg.poll_timeout_ms,
                                          cfg.flush_after_s)
            if pick is None:
                break
            self.last_group_at = time.monotonic()
            if not pick.trained:
                self._account_drops(pick)
                continue
            self._tell(Command.TRAIN)
            # A trained item has its group (GroupSource._take trains only items without a reason to drop).
            stats = self.trainer.train_step(cast(list[wire.ScoredGroup], [i.group for i in pick.trained]))
            stats.timings["wait"] = pick.wait_s
            self._after_step(pick, stats)
        self.saver.drain()
        if self.ckpt is None or self.ckpt.step != self.step:
            self.save_checkpoint(background=False)
        self._tell(Command.STOP)
        return self.step

    def _tell(self, command: Command, arg: object = None) -> None:
        """Announce a collective action to the other ranks (nothing to do alone)."""
        if self.leader is not None:
            self.leader.tell(command, arg)

    def _after_step(self, pick: Pick, stats: StepStats) -> None:
        self.saver.poll()  # a background save that failed fails this step
        trained_at = self.step
        self.step += 1
        self.liveness.progressed()
        trained, dropped = lineage_entries(pick, trained_at)
        self.lineage.record(self.step, trained, dropped, skipped_updates=stats.skipped_updates)
        self.source.commit()
        cfg = self.cfg
        if cfg.stage_steps and self.step % cfg.stage_steps == 0:
            self._tell(Command.RESET_REF)
            self.trainer.reset_reference()
        publish = self.step % cfg.publish_every == 0
        if (publish and cfg.checkpoint_on_publish) or self.step % cfg.checkpoint_every == 0:
            stats.timings["checkpoint"] = self.save_checkpoint()
        if publish:
            stats.timings["publish"] = self.publish() or 0.0
        self.metrics.observe_step(
            self.step, stats.metrics, stats.timings,
            staleness=[staleness(trained_at, cast(wire.ScoredGroup, i.group).policy_version) for i in pick.trained],
            spans=[cast(wire.ScoredGroup, i.group).newest_version - cast(wire.ScoredGroup, i.group).policy_version
                   for i in pick.trained],
            dropped=[i.reason for i in pick.dropped], tokens=stats.tokens, skipped=stats.skipped_updates,
            lag=self._lag())
        log.info("step %d: reward %.3f loss %.4f kl %.4f groups %d dropped %d wait %.2fs", self.step,
                 stats.metrics.get("reward_mean", 0.0), stats.metrics.get("loss", 0.0),
                 stats.metrics.get("kl", 0.0), len(pick.trained), len(pick.dropped), pick.wait_s)

    def _account_drops(self, pick: Pick) -> None:
        """Groups that can never be trained, with nothing trainable behind them (the tail of a finite feed):
        accounted for without a step, on a ``no_update`` line at the current step, and checkpointed at once so
        the lineage and the checkpoint cover the whole topic. A crash between the two: restore removes the line
        (its offsets lie past the checkpoint's position) and the groups are read and dropped again, once."""
        _, dropped = lineage_entries(pick, self.step)
        self.lineage.record(self.step, [], dropped, no_update=True)
        self.source.commit()
        self.save_checkpoint(background=False)
        self.liveness.progressed()
        self.metrics.observe_drops([i.reason for i in pick.dropped])
        log.info("step %d: %d group(s) dropped with nothing to train (%s)", self.step, len(pick.dropped),
                 ", ".join(sorted({i.reason.split(":", 1)[0] for i in pick.dropped})))

    def stop(self) -> None:
        self.stopping = True

    def _done(self) -> bool:
        return self.stopping or (self.cfg.max_steps > 0 and self.step >= self.cfg.max_steps)

    def _should_stop(self) -> bool:
        """Asked on every poll while waiting for a batch (the main thread: Kafka clients may be used here)."""
        if self.leader is not None:
            self.leader.keepalive()
        if time.monotonic() - self._lag_at >= 5.0:  # work waits when a batch's worth is there and not trained
            self._lag_at = time.monotonic()
            self.liveness.waiting = self._lag() >= self.cfg.groups_per_batch
        idle = self.cfg.idle_timeout_s > 0 and time.monotonic() - self.last_group_at > self.cfg.idle_timeout_s
        return self.stopping or idle

    def _lag(self) -> int:
        """Groups received or waiting in the topic that this learner may still train (what its group shows); the
        last known figure while the broker does not answer."""
        lag = assigned_lag(self.source.consumer, self.source.visible or self.source.position)
        if lag is not None:
            self._last_lag = lag
        return self._last_lag

    # ---- durable effects ---------------------------------------------------------------------------
    def save_checkpoint(self, background: bool | None = None) -> float:
        """Checkpoint this step: its offsets and dedup position are made durable beside the state now, the state
        is written in the background (``grpo_learner.saving``) unless ``background`` is False. Returns the seconds
        the step loop spent."""
        t0 = time.perf_counter()
        self.lineage.sync()
        seen = self.seen_log.append(self.source.take_unsaved(), self.source.seen)  # durable before the commit
        meta = {"offsets": {str(p): o for p, o in self.source.position.items()}, "run": self.cfg.pipeline.run,
                "topic": self.cfg.pipeline.topic("groups"), "saved_at": time.time(), "seen_log": seen,
                "incarnation": self.incarnation}
        root, keep = self.out / "checkpoints", self.cfg.keep_checkpoints
        if self.env is None:
            state = {"trainer": self.trainer.state(), "rng": checkpoint.rng_state()}
            return self.saver.checkpoint(self.step, unique_tensors(self.trainer.model), state, meta, background)
        assert self.sharded is not None
        self.metrics.observe_wait("checkpoint", self.saver.checkpoints.wait())
        self.saver.poll()
        self._tell(Command.CHECKPOINT, (str(root), self.step, keep))
        finish = self.sharded.save(root, self.step, self.trainer, {}, meta, keep)
        self.saver.finish_sharded(self.step, finish, meta, background)
        return time.perf_counter() - t0

    def _committed(self, ckpt: checkpoint.Checkpoint) -> None:
        """A checkpoint is on disk: the dedup log's files no checkpoint names any more can go."""
        self.seen_log.gc((self.out / "checkpoints").glob("step-*"))
        self.ckpt = ckpt

    def publish(self, background: bool | None = None) -> float | None:
        """Publish the current weights as version = the current step (written and announced in the background
        unless ``background`` is False); None when skipped. Returns the seconds the step loop spent."""
        if self.env is None:
            tensors = unique_tensors(self.trainer.model)
        else:  # the other ranks join the gather (FSDP2) and wait for the next command
            self._tell(Command.PUBLISH)
            tensors = self.trainer.full_weights()
        spent = self.saver.publish(self.step, tensors, background)
        if spent is not None:
            self.source.newest_announced = max(self.source.newest_announced, self.step)
        return spent

    def close(self) -> None:
        self.saver.close()
        self.source.consumer.close()
        self.publisher.close()
        self.sender.close()
        self.lineage.close()
        self.seen_log.close()
        self.metrics.close()


def main(config: str | None, overrides: list[str], pipeline: str | None = None) -> int:
    cfg = load_config(LearnerConfig, config, overrides, pipeline_file=pipeline)
    env = parallel.setup(cfg.parallel, cfg.model.device)
    if env is not None and not env.leader:
        code = follow(cfg, env)
        parallel.teardown()
        return code
    learner = Learner(cfg, env)
    (learner.out / "learner-config.yaml").write_text(_yaml(to_dict(cfg)))

    def run() -> None:
        learner.restore()
        log.info("learner stopped at step %d", learner.run())

    def health() -> tuple[bool, dict[str, object]]:
        live, detail = learner.liveness.check()
        return not learner.stopping and live, {"step": learner.step, **detail}

    code = serve(learner.metrics.registry, cfg.metrics, health, run, learner.stop, learner.close,
                 "finishing the current step, then checkpointing")
    parallel.teardown()
    return code


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
