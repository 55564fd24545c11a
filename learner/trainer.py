"""One learner step on a batch of scored groups: advantages -> collate -> i optimizer steps of the loss.

The math lives in ``grpo_learner.loss`` and ``grpo_learner.advantages``; this module only feeds it tensors, accumulates
gradients over token-budget micro-batches and applies the optimizer. A step whose loss or gradient is not
finite is skipped (gradients discarded) and reported, never applied.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo_core import wire
from grpo_core.stats import population_std
from grpo_learner.advantages import group_advantages, is_zero_variance
from grpo_learner.batching import Batch, collate, microbatches
from grpo_learner.config import LearnerConfig
from grpo_learner.logprobs import completion_logprobs, completion_logprobs_with_entropy
from grpo_learner.loss import LossInputs, compute_loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepStats:
    """What one learner step did, for metrics and the progress line."""

    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    skipped_updates: int = 0
    tokens: int = 0


class Trainer:
    """The policy, its optimizer and (when beta > 0) the reference policy."""

    def __init__(self, cfg: LearnerConfig, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.loss_cfg = cfg.loss_config()
        self.model = model
        self.device = torch.device(cfg.model.device)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.ref_model = self._frozen_copy() if cfg.loss.requires_ref() else None
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(model.config, "eos_token_id", 0) or 0))

    def _frozen_copy(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta (the end of a stage in Alg. 1)."""
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())

    # ---- one learner step --------------------------------------------------------------------------
    def train_step(self, groups: list[wire.ScoredGroup]) -> StepStats:
        stats = StepStats()
        t0 = time.perf_counter()
        eps = self.cfg.pipeline.stats_eps
        advantages = [group_advantages(g.rewards, self.cfg.advantages, eps).float() for g in groups]
        batch = collate(groups, advantages, self.pad_id)
        stats.tokens = int(batch.num_tokens)  # tokens processed (throughput), before eq. 8 masks any
        if self.cfg.advantages.zero_variance == "mask":
            # Eq. 8 masks the whole per-prompt term, the KL included: zero-variance groups lose their tokens.
            flat = torch.tensor([is_zero_variance(g.rewards) for g in groups], dtype=torch.bool)
            batch.completion_mask[flat[batch.group_index]] = 0.0
        micro = [mb.to(self.device) for mb in microbatches(batch, self.cfg.micro_batch_tokens)]
        stats.timings["collate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        proximal = self._no_grad_logprobs(self.model, micro) if self.cfg.loss.requires_proximal() else None
        ref = self._no_grad_logprobs(self.ref_model, micro) if self.ref_model is not None else None
        stats.timings["forward_old"] = time.perf_counter() - t0
        for _ in range(self.cfg.grad_steps_per_batch):
            self._grad_step(batch, micro, proximal, ref, stats)
        stats.metrics["reward_mean"] = float(sum(sum(g.rewards) for g in groups) / sum(len(g.rewards) for g in groups))
        stats.metrics["reward_std"] = population_std([r for g in groups for r in g.rewards])
        stats.metrics["lr"] = self.scheduler.get_last_lr()[0]
        return stats

    @torch.no_grad()
    def _no_grad_logprobs(self, model: torch.nn.Module, micro: list[Batch]) -> list[Tensor]:
        was_training = model.training
        model.eval()  # no dropout: pi_k and pi_ref are deterministic functions of the weights
        out = [completion_logprobs(model, mb).detach() for mb in micro]
        model.train(was_training)
        return out

    def _grad_step(self, batch: Batch, micro: list[Batch], proximal: list[Tensor] | None,
                   ref: list[Tensor] | None, stats: StepStats) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        finite, t_fwd, t_bwd = True, 0.0, 0.0
        for k, mb in enumerate(micro):
            t0 = time.perf_counter()
            logp, entropy = completion_logprobs_with_entropy(self.model, mb)
            out = compute_loss(LossInputs(
                logprobs=logp, behaviour_logprobs=mb.behaviour_logprobs.to(logp.dtype),
                proximal_logprobs=proximal[k] if proximal is not None else None,
                ref_logprobs=ref[k] if ref is not None else None,
                advantages=mb.advantages.to(logp.dtype), mask=mb.completion_mask), self.loss_cfg)
            weight = self._micro_weight(mb, batch)
            t1 = time.perf_counter()
            finite = finite and bool(torch.isfinite(out.loss))
            if finite and out.loss.requires_grad:  # a micro-batch of only masked rows has nothing to learn
                (out.loss * weight).backward()
            t_fwd, t_bwd = t_fwd + (t1 - t0), t_bwd + (time.perf_counter() - t1)
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + value * weight
            sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach()) * weight
            mask = mb.completion_mask
            ent = float((entropy * mask).sum() / mask.sum().clamp(min=1.0))
            sums["entropy"] = sums.get("entropy", 0.0) + ent * float(mask.sum()) / max(float(batch.num_tokens), 1.0)
        t0 = time.perf_counter()
        grad_norm = self._clip()
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
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _micro_weight(self, mb: Batch, batch: Batch) -> float:
        """Each micro-batch's share of the batch mean, matching the loss's aggregation (so accumulation equals
        one big batch): rows for the per-sequence means, tokens for DAPO's token mean."""
        if self.cfg.loss.agg == "token_mean":
            return float(mb.num_tokens) / max(float(batch.num_tokens), 1.0)
        return mb.input_ids.shape[0] / batch.input_ids.shape[0]

    def state(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None and "ref_model" in state:
            self.ref_model.load_state_dict(state["ref_model"])


