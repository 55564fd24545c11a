"""Group-relative advantages (GRPO), with the statistics of the group as generated.

Mroueh et al., arXiv 2505.22257, eq. 2: for the G completions y_1..y_G of prompt x sampled from the behaviour
policy alpha, with rewards r_i,

    mu        = (1/G) sum_i r_i
    sigma_eps = sqrt( (1/G) sum_i (r_i - mu)^2 + eps ),      0 < eps < 1
    A_i       = (r_i - mu) / sigma_eps

The variance is the population variance (divide by G) and eps sits inside the square root; TRL instead
divides by (unbiased std + 1e-4). Eq. 8 masks groups whose rewards are all equal (sigma = 0): they carry no
learning signal, only noise and KL. :func:`grpo_core.stats.group_stats` is the one definition of mu and
sigma_eps; the verifier publishes the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_core.stats import finite_floats, group_stats, is_zero_variance
from grpo_learner.advantages_config import AdvantageConfig, ZeroVariance

__all__ = ["AdvantageConfig", "ZeroVariance", "group_advantages", "group_stats", "is_zero_variance"]

Rewards = Sequence[float] | Tensor


def _as_floats(rewards: Rewards) -> list[float]:
    if isinstance(rewards, Tensor):
        return finite_floats(float(v) for v in rewards.detach().flatten().tolist())
    return finite_floats(rewards)


def group_advantages(rewards: Rewards, cfg: AdvantageConfig, eps: float) -> Tensor:
    """A_i = (r_i - mu) / sqrt(var_pop + eps) for one group (arXiv 2505.22257, eq. 2); float64 [G].

    ``eps`` is the pipeline contract's ``stats_eps`` (the verifiers publish their std with the same one).

    ``normalize_std=False`` gives Dr.GRPO's A_i = r_i - mu (arXiv 2503.20783). Zero-variance groups give
    exact zeros under ``mask`` and ``drop`` (eq. 8; under drop they should not reach here, and zeros make
    a forgotten one harmless), and the raw formula, i.e. zeros up to rounding, under ``keep``. A tensor
    input keeps its device.
    """
    values = _as_floats(rewards)
    device = rewards.device if isinstance(rewards, Tensor) else None
    if cfg.zero_variance != "keep" and is_zero_variance(values):
        return torch.zeros(len(values), dtype=torch.float64, device=device)
    mean, sigma = group_stats(values, eps)
    scale = sigma if cfg.normalize_std else 1.0
    return torch.tensor([(v - mean) / scale for v in values], dtype=torch.float64, device=device)
