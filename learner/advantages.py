"""Group-relative advantages (GRPO), with the statistics of the group as generated.

Mroueh et al., arXiv 2505.22257, eq. 2: for the G completions y_1..y_G of prompt x sampled from the behaviour
policy alpha, with rewards r_i,

    mu        = (1/G) sum_i r_i
    sigma_eps = sqrt( (1/G) sum_i (r_i - mu)^2 + eps ),      0 < eps < 1
    A_i       = (r_i - mu) / sigma_eps

The variance is the population variance (divide by G) and eps sits inside the square root; TRL instead
divides by (unbiased std + 1e-4). Eq. 8 masks groups whose rewards are all equal (sigma = 0): they carry no
learning signal, only noise and KL. :func:`group_stats` is the one definition of mu and sigma_eps; the
verifier reuses it for its reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_stream.config import opt, require

ZeroVariance = Literal["mask", "drop", "keep"]

# Rewards that differ by less than this count as equal: a verifier's 0.1 + 0.2 should not look like signal.
ZERO_VARIANCE_TOL = 1e-12

Rewards = Sequence[float] | Tensor


@dataclass
class AdvantageConfig:
    """How rewards of one group become advantages."""

    eps: float = opt(1e-4, "eps inside sqrt(var + eps) (arXiv 2505.22257, eq. 2). In (0, 1).")
    normalize_std: bool = opt(
        True, "Divide by sqrt(var + eps). false: Dr.GRPO (arXiv 2503.20783), A = r - mean only.")
    zero_variance: ZeroVariance = opt(
        "mask",
        "Groups whose rewards are all equal (eq. 8). mask: zero advantages (to also drop their KL term, zero "
        "their loss mask); drop: the caller removes such groups before batching (DAPO dynamic sampling, "
        "arXiv 2503.14476), see is_zero_variance; keep: use the formula as is.")

    def validate(self) -> None:
        require(0.0 < self.eps < 1.0,
                f"advantages.eps: must be in (0, 1) as in eq. 2 of arXiv 2505.22257 (1e-4 is usual), "
                f"got {self.eps}")
        require(self.zero_variance in ("mask", "drop", "keep"),
                f"advantages.zero_variance: {self.zero_variance!r} is not one of ['mask', 'drop', 'keep']")


def _as_floats(rewards: Rewards) -> list[float]:
    if isinstance(rewards, Tensor):
        values = [float(v) for v in rewards.detach().flatten().tolist()]
    else:
        values = [float(r) for r in rewards]
    if not values:
        raise ValueError("rewards: a group needs at least one reward")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"rewards: must be finite, got {values} (check the verifier)")
    return values


def group_stats(rewards: Rewards, eps: float) -> tuple[float, float]:
    """``(mu, sqrt(var_pop + eps))`` of one group (arXiv 2505.22257, eq. 2).

    Population variance (divide by G), computed in float64 with compensated sums."""
    values = _as_floats(rewards)
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(var + eps)


def is_zero_variance(rewards: Rewards) -> bool:
    """Whether all rewards of the group are equal (up to ``ZERO_VARIANCE_TOL``), i.e. sigma = 0 in eq. 8."""
    values = _as_floats(rewards)
    return max(values) - min(values) <= ZERO_VARIANCE_TOL


def group_advantages(rewards: Rewards, cfg: AdvantageConfig) -> Tensor:
    """A_i = (r_i - mu) / sqrt(var_pop + eps) for one group (arXiv 2505.22257, eq. 2); float64 [G].

    ``normalize_std=False`` gives Dr.GRPO's A_i = r_i - mu (arXiv 2503.20783). Zero-variance groups give
    exact zeros under ``mask`` and ``drop`` (eq. 8; under drop they should not reach here, and zeros make
    a forgotten one harmless), and the raw formula, i.e. zeros up to rounding, under ``keep``. A tensor
    input keeps its device.
    """
    values = _as_floats(rewards)
    device = rewards.device if isinstance(rewards, Tensor) else None
    if cfg.zero_variance != "keep" and is_zero_variance(values):
        return torch.zeros(len(values), dtype=torch.float64, device=device)
    mean, sigma = group_stats(values, cfg.eps)
    scale = sigma if cfg.normalize_std else 1.0
    return torch.tensor([(v - mean) / scale for v in values], dtype=torch.float64, device=device)
