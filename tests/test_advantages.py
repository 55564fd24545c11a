"""grpo_learner.advantages: eq. 2 of arXiv 2505.22257 against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core.config import ConfigError, build
from grpo_learner.advantages import AdvantageConfig, group_advantages, group_stats, is_zero_variance

EPS = 1e-4  # the pipeline contract's default stats_eps


def as_list(t: torch.Tensor) -> list[float]:
    assert t.dtype == torch.float64
    return [float(v) for v in t.tolist()]


def test_balanced_group() -> None:
    # mu = 0.5; var = (4 * 0.25) / 4 = 0.25; sigma = sqrt(0.25 + 1e-4)
    a = 0.5 / math.sqrt(0.2501)
    got = as_list(group_advantages([1, 0, 0, 1], AdvantageConfig(), EPS))
    assert got == pytest.approx([a, -a, -a, a], abs=1e-15)


def test_one_correct_in_four() -> None:
    # mu = 0.25; var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875 (population: divide by G, not G - 1)
    sigma = math.sqrt(0.1875 + 1e-4)
    expected = [0.75 / sigma, -0.25 / sigma, -0.25 / sigma, -0.25 / sigma]
    got = as_list(group_advantages([1.0, 0.0, 0.0, 0.0], AdvantageConfig(), EPS))
    assert got == pytest.approx(expected, abs=1e-15)
    assert sum(expected) == pytest.approx(0.0, abs=1e-12)


def test_eps_sits_inside_the_sqrt() -> None:
    # eps = 0.5: sigma = sqrt(0.25 + 0.5) = sqrt(0.75), not std + eps = 1.0
    a = 0.5 / math.sqrt(0.75)
    got = as_list(group_advantages([1, 0, 0, 1], AdvantageConfig(), eps=0.5))
    assert got == pytest.approx([a, -a, -a, a], abs=1e-15)
    assert got[0] != pytest.approx(0.5 / (0.5 + 0.5))


def test_dr_grpo_subtracts_the_mean_only() -> None:
    got = as_list(group_advantages([1, 0, 0, 0], AdvantageConfig(normalize_std=False), EPS))
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-15)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0], [0.1, 0.1, 0.1], [0.7]])
def test_zero_variance_mask_gives_exact_zeros(rewards: list[float]) -> None:
    cfgs = (AdvantageConfig(), AdvantageConfig(zero_variance="drop"), AdvantageConfig(normalize_std=False))
    for cfg in cfgs:
        assert as_list(group_advantages(rewards, cfg, EPS)) == [0.0] * len(rewards)


def test_zero_variance_keep_uses_the_formula() -> None:
    # all equal: r - mu is zero up to rounding, so keep is ~0 but not forced to exact zeros
    got = as_list(group_advantages([0.1, 0.1, 0.1], AdvantageConfig(zero_variance="keep"), EPS))
    assert got == pytest.approx([0.0] * 3, abs=1e-12)
    got = as_list(group_advantages([1, 0, 0, 1], AdvantageConfig(zero_variance="keep"), EPS))
    assert got[0] == pytest.approx(0.5 / math.sqrt(0.2501), abs=1e-15)


def test_is_zero_variance() -> None:
    assert is_zero_variance([1.0, 1.0, 1.0])
    assert is_zero_variance([0.0])
    assert is_zero_variance([0.3, 0.1 + 0.2])  # 5.6e-17 apart: rounding, not signal
    assert is_zero_variance(torch.tensor([2.0, 2.0]))
    assert not is_zero_variance([1.0, 0.0, 0.0, 0.0])
    assert not is_zero_variance([0.5, 0.5 + 1e-6])


def test_group_stats() -> None:
    mean, sigma = group_stats([1, 0, 0, 1], 1e-4)
    assert mean == 0.5 and sigma == pytest.approx(math.sqrt(0.2501), abs=1e-15)
    mean, sigma = group_stats([1.0, 0.0, 0.0, 0.0], 0.5)
    assert mean == 0.25 and sigma == pytest.approx(math.sqrt(0.1875 + 0.5), abs=1e-15)
    mean, sigma = group_stats([1.0, 1.0], 1e-4)
    assert mean == 1.0 and sigma == pytest.approx(0.01, abs=1e-15)


def test_tensor_input_matches_list_input() -> None:
    rewards = [1.0, 0.0, 0.5, 0.0]  # all exact in float32
    expected = as_list(group_advantages(rewards, AdvantageConfig(), EPS))
    for dtype in (torch.float32, torch.float64):
        got = group_advantages(torch.tensor(rewards, dtype=dtype), AdvantageConfig(), EPS)
        assert as_list(got) == pytest.approx(expected, abs=1e-15)
    got = group_advantages(torch.tensor([1, 0, 0, 1]), AdvantageConfig(), EPS)
    assert as_list(got) == pytest.approx(as_list(group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageConfig(), EPS)))
    assert group_stats(torch.tensor([1.0, 0.0, 0.0, 1.0]), 1e-4) == pytest.approx((0.5, math.sqrt(0.2501)))


@pytest.mark.parametrize("rewards", [[], [1.0, math.nan], [math.inf, 0.0]])
def test_bad_rewards_raise(rewards: list[float]) -> None:
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards, AdvantageConfig(), EPS)
    with pytest.raises(ValueError, match="rewards"):
        group_stats(rewards, 1e-4)


@pytest.mark.parametrize("change", [{"zero_variance": "skip"}])
def test_validate_rejects(change: dict[str, object]) -> None:
    key = next(iter(change))
    with pytest.raises(ValueError, match=f"advantages.{key}"):
        AdvantageConfig(**change).validate()  # type: ignore[arg-type]


def test_defaults_validate_and_load_from_config_mappings() -> None:
    AdvantageConfig().validate()
    cfg = build(AdvantageConfig, {"normalize_std": False, "zero_variance": "drop"}, "advantages.")
    assert cfg == AdvantageConfig(normalize_std=False, zero_variance="drop")
    with pytest.raises(ConfigError, match="advantages.zero_variance"):
        build(AdvantageConfig, {"zero_variance": "skip"}, "advantages.")
