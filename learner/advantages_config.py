"""The advantages' settings (``advantages:`` in the learner's config), apart from the math in
``grpo_learner.advantages`` so that a config loads and validates without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from grpo_core.config import opt, require

ZeroVariance = Literal["mask", "drop", "keep"]

@dataclass
class AdvantageConfig:
    """How rewards of one group become advantages."""

    normalize_std: bool = opt(
        True, "Divide by sqrt(var + eps) (verl, TRL: on). false: Dr.GRPO (arXiv 2503.20783), A = r - mean only.")
    zero_variance: ZeroVariance = opt(
        "mask",
        "Groups whose rewards are all equal (eq. 8). mask: zero advantages (to also drop their KL term, zero "
        "their loss mask); drop: the caller removes such groups before batching (DAPO dynamic sampling, "
        "arXiv 2503.14476), see is_zero_variance; keep: use the formula as is.")

    def validate(self) -> None:
        require(self.zero_variance in get_args(ZeroVariance),
                f"advantages.zero_variance: {self.zero_variance!r} is not one of {list(get_args(ZeroVariance))}")
