"""Controlled completion lengths (``sampling.lengths``): for benchmarks that must not depend on what a model learned.

A random-weight model stops at an EOS by chance, a trained one when it has answered; neither gives a length
distribution that can be stated and repeated. With ``dist`` other than ``model`` every sample's length is drawn
before it is generated and the sample is exactly that long: EOS is ignored (vLLM's ``ignore_eos``; HF generates
past it) and the length is the sample's ``max_tokens``. ``lognormal`` is the long tail of reasoning rollouts: most
samples near the median, a few several times longer (``p99_ratio``), which is what makes a batch wait for its
longest member. Every sample gets its own length, also within a group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from grpo_core.config import opt, require

LengthDist = Literal["model", "fixed", "lognormal"]
Z99 = 2.3263478740408408  # the standard normal's 99th percentile: p99 = median * exp(sigma * Z99)


@dataclass
class LengthsConfig:
    """How long each completion is: as the model decides, or drawn from a stated distribution (EOS ignored)."""

    dist: LengthDist = opt(
        "model", "model: the sample ends at EOS, a stop string or max_tokens; fixed: every sample exactly `median` "
                 "tokens; lognormal: each sample's length drawn from a lognormal with `median` and p99 = median x "
                 "p99_ratio (EOS ignored, cut at max_tokens). For benchmarks: lengths no model decides.")
    median: int = opt(64, "fixed / lognormal: the median length in tokens. >= 1.")
    p99_ratio: float = opt(8.0, "lognormal: the 99th percentile over the median (the tail). >= 1.")
    seed: int = opt(0, "Seed of the length draws (each backend draws its own stream from it).")

    def validate(self) -> None:
        require(self.median >= 1, f"sampling.lengths.median: must be >= 1, got {self.median}")
        require(self.p99_ratio >= 1.0, f"sampling.lengths.p99_ratio: must be >= 1, got {self.p99_ratio}")

    @property
    def controlled(self) -> bool:
        """True when lengths are drawn, not decided by the model (EOS then never ends a sample)."""
        return self.dist != "model"

    @property
    def sigma(self) -> float:
        """The lognormal's sigma: ln(p99 / median) / z_0.99."""
        return math.log(self.p99_ratio) / Z99

    def draw(self, count: int, rng: np.random.Generator, cap: int) -> list[int]:
        """``count`` lengths, each in [1, ``cap``] (``cap``: the sampling's max_tokens)."""
        if self.dist == "fixed":
            raw = np.full(count, float(self.median))
        elif self.dist == "lognormal":
            raw = np.exp(rng.normal(math.log(self.median), self.sigma, count))
        else:
            raise ValueError("sampling.lengths.dist: model has no drawn lengths")
        return [int(x) for x in np.clip(np.rint(raw), 1, cap)]

    def mean(self) -> float:
        """The expected length before the cap (for sizing a benchmark: exp(mu + sigma^2 / 2))."""
        if self.dist == "lognormal":
            return self.median * math.exp(self.sigma ** 2 / 2)
        return float(self.median)


class LengthDraws:
    """One backend's stream of drawn lengths, seeded by the lengths' seed and the backend's own (two producers
    with different backend seeds draw different lengths)."""

    def __init__(self, backend_seed: int) -> None:
        self.backend_seed = backend_seed
        self.rng: np.random.Generator | None = None

    def __call__(self, lengths: LengthsConfig, count: int, cap: int) -> list[int]:
        if self.rng is None:
            self.rng = np.random.default_rng([lengths.seed, self.backend_seed])
        return lengths.draw(count, self.rng, cap)
