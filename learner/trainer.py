"""One learner step on a batch of scored groups: advantages -> collate -> i optimizer steps of the loss.

The math lives in ``grpo_learner.loss`` and ``grpo_learner.advantages``; this module only feeds it tensors, accumulates
gradients over token-budget micro-batches and applies the optimizer. A step whose loss or gradient is not
finite is skipped (gradients discarded) and reported, never applied.

Data-parallel (``parallel.strategy`` ddp/fsdp2, ``grpo_learner.parallel``): rank 0 prepares the batch and calls
:meth:`Trainer.train_step`, which scatters the ranks' shares; the other ranks call :meth:`Trainer.train_shard`
at the same time. Each micro-batch's weight in the loss follows ``grpo_learner.parallel.share`` in both modes.
"""

from __future__ import annotations

import copy
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from grpo_core import wire
from grpo_core.stats import population_std
from grpo_learner import parallel
from grpo_learner.advantages import group_advantages, is_zero_variance
from grpo_learner.batching import Batch, collate, microbatches
from grpo_learner.config import LearnerConfig, ModelConfig
from grpo_learner.loss import LossInputs, compute_loss, counted_tokens
from grpo_learner.parallel import Env, Shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(cfg: ModelConfig, path: str | Path | None = None, device: torch.device | str | None = None
               ) -> torch.nn.Module:
    """The policy from ``path`` (a checkpoint's model/) or ``cfg.path``, on ``device`` (a rank's) or cfg's."""
    model = AutoModelForCausalLM.from_pretrained(str(path or cfg.path), dtype=DTYPES[cfg.dtype],
                                                 trust_remote_code=cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return cast(torch.nn.Module, model).to(device or cfg.device)  # typed: transformers wraps its .to untyped


@dataclass
class StepStats:
    """What one learner step did, for metrics and the progress line."""

    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    skipped_updates: int = 0
    tokens: int = 0


def cpu_clock() -> tuple[float, float, float]:
    """(wall, user CPU, system CPU) seconds so far; the CPU times are the whole process's (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime, usage.ru_stime


def cpu_shares(before: tuple[float, float, float], after: tuple[float, float, float],
               threads: int) -> dict[str, float]:
    """What a step got from its CPUs, between two :func:`cpu_clock` readings.

    ``cpu_share``: CPU seconds over wall seconds x torch's threads. A CPU learner that computes the whole step
    is near 1; far below, its CPUs ran something else while it waited (another process on them, the host of a
    virtual machine: steal). A learner 25-60x slower per step for a whole run was seen in 3 bench repeats on a
    shared machine, never caught; this says whether such a learner is denied its CPU or slow on it. On a GPU the
    step waits on the device, so a low share is normal there. ``sys_share``: the kernel's part of that CPU time
    (page faults, memory compaction)."""
    wall, user, system = (a - b for a, b in zip(after, before, strict=True))
    cpu = user + system
    return {"cpu_share": cpu / (wall * max(threads, 1)) if wall > 0 else 0.0,
            "sys_share": system / cpu if cpu > 0 else 0.0}


class Trainer:
    """The policy, its optimizer and (when beta > 0) the reference policy; with ``env`` one rank's part of them."""

    def __init__(self, cfg: LearnerConfig, model: torch.nn.Module, env: Env | None = None) -> None:
        self.cfg = cfg
        self.loss_cfg = cfg.loss_config()
        self.model = model  # the HF model (under FSDP2 sharded in place: its state_dict() holds the shards)
        self.env = env
        self.device = env.device if env is not None else torch.device(cfg.model.device)
        self.ref_model = self._frozen_copy() if cfg.loss.requires_ref() else None  # before sharding: a full copy
        self.aliases = parallel.tied_aliases(model)
        self.policy = parallel.wrap(model, cfg.parallel, env)
        o = cfg.optim  # the optimizer takes the wrapped module's parameters: FSDP2 swaps in sharded ones
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.adam_eps, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.ref_policy = parallel.PolicyForward(self.ref_model).eval() if self.ref_model is not None else None
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(model.config, "eos_token_id", 0) or 0))

    def _frozen_copy(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta (the end of a stage in Alg. 1). Under FSDP2 every rank calls it (a gather)."""
        if self.ref_model is not None:  # the same on every rank (one config): all gather or none
            self.ref_model.load_state_dict(parallel.full_state_dict(self.model, self.env, leader_only=False))

    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's weights for publishing, tied copies once (rank 0; {} on the others). Every rank calls
        it under FSDP2 (a gather)."""
        full = parallel.full_state_dict(self.model, self.env, leader_only=True)
        return {k: v.detach() for k, v in full.items() if k not in self.aliases}

    # ---- one learner step --------------------------------------------------------------------------
    def train_step(self, groups: list[wire.ScoredGroup]) -> StepStats:
        """One learner step on ``groups`` (the only rank that has them: rank 0 or the single process)."""
        stats = StepStats()
        clock = cpu_clock()
        t0 = time.perf_counter()
        batch = self._prepare(groups)
        stats.tokens = int(batch.num_tokens)  # tokens processed (throughput), before eq. 8 masks any
        flat = torch.tensor([is_zero_variance(g.rewards) for g in groups], dtype=torch.bool)
        if self.cfg.advantages.zero_variance == "mask":
            # Eq. 8 masks the whole per-prompt term, the KL included: zero-variance groups lose their tokens.
            batch.completion_mask[flat[batch.group_index]] = 0.0
        if self.env is None:
            micro = microbatches(batch, self.cfg.micro_batch_tokens)
            shard = Shard(micro, [False] * len(micro), batch.num_rows, batch.num_tokens)
        else:
            shard = parallel.scatter(parallel.plan_shards(batch, self.env.world, self.cfg.micro_batch_tokens),
                                     self.env)
        stats.timings["collate"] = time.perf_counter() - t0
        self._train(shard, stats)
        stats.metrics["reward_mean"] = float(sum(sum(g.rewards) for g in groups) / sum(len(g.rewards) for g in groups))
        stats.metrics["reward_std"] = population_std([r for g in groups for r in g.rewards])
        # Groups whose G rewards are all equal teach nothing (zero advantages): a policy that has collapsed onto
        # one answer per prompt shows here before its reward stops rising.
        stats.metrics["zero_variance_fraction"] = float(flat.float().mean()) if groups else 0.0
        stats.metrics["lr"] = cast(float, self.scheduler.get_last_lr()[0])  # a float lr (the config's) stays one
        stats.metrics.update(cpu_shares(clock, cpu_clock(), torch.get_num_threads()))
        return stats

    def train_shard(self) -> StepStats:
        """A follower rank's side of :meth:`train_step`: receive this rank's share from rank 0 and train on it."""
        assert self.env is not None and not self.env.leader
        stats = StepStats()
        self._train(parallel.scatter(None, self.env), stats)
        return stats

    def _prepare(self, groups: list[wire.ScoredGroup]) -> Batch:
        eps = self.cfg.pipeline.stats_eps
        advantages = [group_advantages(g.rewards, self.cfg.advantages, eps).float() for g in groups]
        return collate(groups, advantages, self.pad_id)

    def _train(self, shard: Shard, stats: StepStats) -> None:
        t0 = time.perf_counter()
        micro = [mb.to(self.device) for mb in shard.micro]
        proximal = self._no_grad_logprobs(self.policy, micro) if self.cfg.loss.requires_proximal() else None
        ref = self._no_grad_logprobs(self.ref_policy, micro) if self.ref_policy is not None else None
        stats.timings["forward_old"] = time.perf_counter() - t0
        # The token mean's denominator: the whole batch's counted tokens (after a mis rejection), over all ranks.
        counted = [0 if pad else counted_tokens(mb.completion_mask, mb.behaviour_logprobs,
                                                proximal[k] if proximal is not None else None, self.loss_cfg)
                   for k, (mb, pad) in enumerate(zip(micro, shard.padding, strict=True))]
        total = parallel.sum_over_ranks({"counted": float(sum(counted))}, self.env).get("counted", 0.0)
        for _ in range(self.cfg.grad_steps_per_batch):
            self._grad_step(shard, micro, proximal, ref, counted, total, stats)

    @torch.no_grad()
    def _no_grad_logprobs(self, policy: torch.nn.Module, micro: list[Batch]) -> list[Tensor]:
        was_training = policy.training
        policy.eval()  # no dropout: pi_k and pi_ref are deterministic functions of the weights
        out = [policy(mb, False)[0].detach() for mb in micro]
        policy.train(was_training)
        return out

    def _grad_step(self, shard: Shard, micro: list[Batch], proximal: list[Tensor] | None,
                   ref: list[Tensor] | None, counted: list[int], total: float, stats: StepStats) -> None:
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        finite, t_fwd, t_bwd = True, 0.0, 0.0
        scale = parallel.grad_factor(self.env)
        for k, mb in enumerate(micro):
            with parallel.grad_sync(self.policy, last=k == len(micro) - 1):
                t0 = time.perf_counter()
                logp, entropy = self.policy(mb, True)
                out = compute_loss(LossInputs(
                    logprobs=logp, behaviour_logprobs=mb.behaviour_logprobs.to(logp.dtype),
                    proximal_logprobs=proximal[k] if proximal is not None else None,
                    ref_logprobs=ref[k] if ref is not None else None,
                    advantages=mb.advantages.to(logp.dtype), mask=mb.completion_mask), self.loss_cfg)
                weight = 0.0 if shard.padding[k] else parallel.share(self.cfg.loss.agg, mb.num_rows, counted[k],
                                                                     shard.rows, total)
                t1 = time.perf_counter()
                finite = finite and bool(torch.isfinite(out.loss))
                # Alone, a non-finite loss is not backpropagated; a rank backpropagates it all the same, since
                # every rank must run the same backward passes (the NaN then skips the update on all of them).
                if out.loss.requires_grad and (finite or self.env is not None):  # all-masked: nothing to learn
                    (out.loss * (weight * scale)).backward()
                t_fwd, t_bwd = t_fwd + (t1 - t0), t_bwd + (time.perf_counter() - t1)
            if not shard.padding[k]:
                for key, value in out.metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * weight
                sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach()) * weight
                mask = mb.completion_mask
                ent = float((entropy * mask).sum() / mask.sum().clamp(min=1.0))
                sums["entropy"] = sums.get("entropy", 0.0) + ent * float(mask.sum()) / max(float(shard.tokens), 1.0)
        sums = parallel.sum_over_ranks({**sums, "non_finite": float(not finite)}, self.env)
        finite = not sums.pop("non_finite")
        t0 = time.perf_counter()
        # Not backpropagated, a non-finite loss leaves no gradient: its norm is unknown, not 0.
        grad_norm = self._clip() if finite or self.env is not None else float("nan")
        if not (finite and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)  # never apply a non-finite update
            stats.skipped_updates += 1
        else:
            self.optimizer.step()
            self.scheduler.step()
        stats.timings["forward"] = stats.timings.get("forward", 0.0) + t_fwd
        stats.timings["backward"] = stats.timings.get("backward", 0.0) + t_bwd
        stats.timings["optimizer"] = stats.timings.get("optimizer", 0.0) + time.perf_counter() - t0
        stats.metrics.update(sums, grad_norm=grad_norm)

    def _clip(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        return parallel.total_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def state(self, optimizer: bool = True) -> dict[str, Any]:
        """Optimizer (unless a sharded checkpoint holds it), scheduler and reference model."""
        state = {"scheduler": self.scheduler.state_dict()}
        if optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None and "ref_model" in state:
            self.ref_model.load_state_dict(state["ref_model"])
