"""grpo_learner.loss: every variant and aggregation against values worked out by hand in plain Python.

The fixture is specified by its ratios: behaviour = logprobs - log(r), proximal = behaviour + log(r'), so the
expected per-token terms below follow from the equations in the docstrings with nothing but ``math``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import get_args

import pytest
import torch
from torch import Tensor

from grpo_core.config import ConfigError, build
from grpo_learner import loss as loss_mod
from grpo_learner import loss_terms
from grpo_learner.advantages import AdvantageConfig, group_advantages
from grpo_learner.loss import Aggregation, LossConfig, LossInputs, Variant, compute_loss

F64 = torch.float64
VARIANTS: tuple[Variant, ...] = get_args(Variant)
AGGS: tuple[Aggregation, ...] = get_args(Aggregation)

# Two sequences, T = 3; row 1 has one padding position whose logprobs are garbage on purpose.
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -7.0]]
R = [[1.1, 1.3, 0.7], [0.7, 1.3]]  # pi / alpha on the counted tokens
R_PROX = [[0.85, 1.15, 0.95], [0.85, 1.7]]  # pi_k / alpha
ADV = [1.5, -0.5]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
MAX_LEN = 4


# ------------------------------------------------------------------------------------------ hand math


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def ppo(r: float, a: float, lo: float, hi: float) -> float:
    return min(r * a, clip(r, lo, hi) * a)


def hand_agg(rows: list[list[float]], agg: str, max_len: int = MAX_LEN) -> float:
    """rows: the per-token values of the counted tokens of each sequence (empty list = empty row)."""
    if agg == "seq_mean_token_mean":
        return sum(sum(r) / max(len(r), 1) for r in rows) / len(rows)
    if agg == "token_mean":
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)
    return sum(sum(r) / max_len for r in rows) / len(rows)


def hand_terms(variant: str, eps_low: float = 0.2, eps_high: float = 0.2) -> list[list[float]]:
    lo, hi = 1 - eps_low, 1 + eps_high
    if variant == "grpo_offpolicy_approx":
        return [[ppo(r, a, lo, hi) for r in row] for row, a in zip(R, ADV, strict=True)]
    if variant == "grpo_offpolicy_exact":
        return [[ppo(r, a, max(rp - eps_low, 0.0), rp + eps_high) for r, rp in zip(row, prow, strict=True)]
                for row, prow, a in zip(R, R_PROX, ADV, strict=True)]
    if variant == "decoupled_ppo":
        return [[rp * ppo(r / rp, a, lo, hi) for r, rp in zip(row, prow, strict=True)]
                for row, prow, a in zip(R, R_PROX, ADV, strict=True)]
    if variant == "cispo":  # sg(clip(r)) * A * log pi
        return [[clip(r, lo, hi) * a * lp for r, lp in zip(row, lrow, strict=False)]
                for row, lrow, a in zip(R, LOGP, ADV, strict=True)]
    if variant == "sapo":  # (4 / tau) sigmoid(tau (r - 1)) A
        taus = [1.0 if a > 0 else 1.05 for a in ADV]
        return [[4 / t / (1 + math.exp(-t * (r - 1))) * a for r in row] for row, a, t in zip(R, ADV, taus, strict=True)]
    out = []
    for row, a in zip(R, ADV, strict=True):
        s = math.exp(sum(math.log(r) for r in row) / len(row))
        out.append([ppo(s, a, lo, hi)] * len(row))
    return out


# ------------------------------------------------------------------------------------------ tensors


def make_inputs(*, with_prox: bool = True, ref: Tensor | None = None, adv: list[float] | None = None,
                mask: list[list[float]] | None = None) -> LossInputs:
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    log_r = torch.tensor([[math.log(r) for r in row] + [0.0] * (3 - len(row)) for row in R], dtype=F64)
    log_rp = torch.tensor([[math.log(r) for r in row] + [0.0] * (3 - len(row)) for row in R_PROX], dtype=F64)
    behaviour = logp.detach() - log_r
    behaviour[1, 2] = -math.inf  # padding garbage must not leak into the loss
    return LossInputs(
        logprobs=logp,
        behaviour_logprobs=behaviour,
        proximal_logprobs=behaviour + log_rp if with_prox else None,
        ref_logprobs=ref,
        advantages=torch.tensor(adv if adv is not None else ADV, dtype=F64),
        mask=torch.tensor(mask if mask is not None else MASK, dtype=F64),
    )


def grad_of(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    out = compute_loss(inputs, cfg)
    (g,) = torch.autograd.grad(out.loss, inputs.logprobs)
    return out.loss.detach(), g


# ------------------------------------------------------------------------------------------ values


def test_approx_hand_values_seq_mean() -> None:
    # row 0: 1.1*1.5 = 1.65; clip(1.3) = 1.2 -> 1.8; 0.7*1.5 = 1.05 (A>0 below the band: unclipped side)
    # row 1: clip(0.7) = 0.8 -> -0.4; 1.3*-0.5 = -0.65 (A<0 above the band: unclipped side)
    expected = -((1.65 + 1.8 + 1.05) / 3 + (-0.4 - 0.65) / 2) / 2
    assert expected == pytest.approx(-0.4875)
    out = compute_loss(make_inputs(), LossConfig())
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.loss.dtype == F64
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 5)  # row 0 token 1
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 5)  # row 1 token 0
    assert out.metrics["tokens"] == 5.0
    assert out.metrics["ratio_mean"] == pytest.approx((1.1 + 1.3 + 0.7 + 0.7 + 1.3) / 5)
    assert out.metrics["ratio_max"] == pytest.approx(1.3)
    assert out.metrics["kl"] == 0.0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_and_aggregation_matches_hand_values(variant: Variant, agg: Aggregation) -> None:
    cfg = LossConfig(variant=variant, agg=agg, max_len_norm=MAX_LEN)
    out = compute_loss(make_inputs(), cfg)
    assert out.loss.item() == pytest.approx(-hand_agg(hand_terms(variant), agg), abs=1e-12)


def test_exact_clips_around_proximal_ratio() -> None:
    # bounds [r'-0.2, r'+0.2]: row 0 token 0 r=1.1 > 0.85+0.2 (A>0: clipped high), token 1 r=1.3 < 1.35
    # (not clipped although approx clips it); row 1 token 1 r=1.3 < 1.7-0.2 (A<0: clipped low).
    out = compute_loss(make_inputs(), LossConfig(variant="grpo_offpolicy_exact"))
    row0 = [1.05 * 1.5, 1.3 * 1.5, 0.7 * 1.5]
    row1 = [0.7 * -0.5, 1.5 * -0.5]
    assert out.loss.item() == pytest.approx(-(sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-12)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 5)


def test_gspo_clips_the_sequence_ratio_on_both_sides() -> None:
    s0 = (1.1 * 1.3 * 0.7) ** (1 / 3)  # 1.000333: above 1 + 1e-4 with A>0 -> clipped high
    s1 = (0.7 * 1.3) ** (1 / 2)  # 0.9539: below 1 - 0.01 with A<0 -> clipped low
    assert s0 > 1.0001 and s1 < 0.99
    cfg = LossConfig(variant="gspo", eps_low=0.01, eps_high=1e-4)
    out = compute_loss(make_inputs(), cfg)
    assert out.loss.item() == pytest.approx(-(1.0001 * 1.5 + 0.99 * -0.5) / 2, abs=1e-12)
    assert out.metrics["clip_frac_high"] == pytest.approx(3 / 5)  # every token of row 0
    assert out.metrics["clip_frac_low"] == pytest.approx(2 / 5)
    _, g = grad_of(make_inputs(), cfg)
    assert torch.count_nonzero(g) == 0


def test_decoupled_hand_values() -> None:
    # w = r', rp = r / r': row 0 token 0 rp = 1.294 > 1.2 (A>0, clipped): 0.85 * 1.2 * 1.5 = 1.53;
    # row 1 token 1 rp = 0.765 < 0.8 (A<0, clipped): 1.7 * 0.8 * -0.5 = -0.68
    out = compute_loss(make_inputs(), LossConfig(variant="decoupled_ppo"))
    row0 = [0.85 * 1.2 * 1.5, 1.3 * 1.5, 0.7 * 1.5]
    row1 = [0.7 * -0.5, 1.7 * 0.8 * -0.5]
    assert out.loss.item() == pytest.approx(-(sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-12)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert out.metrics["decoupled_weight_mean"] == pytest.approx((0.85 + 1.15 + 0.95 + 0.85 + 1.7) / 5)


# ------------------------------------------------------------------------------------------ gradients


def test_exact_equals_approx_when_proximal_is_behaviour() -> None:
    def inputs() -> LossInputs:
        x = make_inputs()
        x.proximal_logprobs = x.behaviour_logprobs.clone()
        return x

    for agg in AGGS:
        approx = LossConfig(variant="grpo_offpolicy_approx", agg=agg, eps_high=0.28, max_len_norm=MAX_LEN)
        la, ga = grad_of(inputs(), approx)
        le, ge = grad_of(inputs(), dataclasses.replace(approx, variant="grpo_offpolicy_exact"))
        torch.testing.assert_close(le, la, rtol=0, atol=1e-14)
        torch.testing.assert_close(ge, ga, rtol=0, atol=1e-14)


ON_POLICY: list[tuple[Variant, bool]] = [
    ("grpo_offpolicy_approx", False),
    ("grpo_offpolicy_exact", True),
    ("decoupled_ppo", True),
    ("gspo", False),
]


@pytest.mark.parametrize(("variant", "with_prox"), ON_POLICY)
def test_on_policy_gradient_is_reinforce(variant: Variant, with_prox: bool) -> None:
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=F64)
    adv = torch.tensor([0.7, -1.3], dtype=F64)
    inputs = LossInputs(logp, logp.detach(), logp.detach().clone() if with_prox else None, None, adv, mask)
    _, g = grad_of(inputs, LossConfig(variant=variant))
    n_tokens, batch = [3, 2], 2
    # -A_b * mask_bt / (n_b * B): the gradient of -(1/B) sum_b (1/n_b) sum_t A_b logp_bt
    expected = [[-a * m / (n * batch) for m in row]
                for a, row, n in zip([0.7, -1.3], MASK, n_tokens, strict=True)]
    torch.testing.assert_close(g, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)


def test_clip_higher_clips_only_the_intended_side() -> None:
    # eps_low 0.2, eps_high 0.28: A>0 band top 1.28, A<0 band bottom 0.8
    ratios = [[1.25, 1.3], [0.79, 0.81]]
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=F64, requires_grad=True)
    behaviour = logp.detach() - torch.tensor([[math.log(r) for r in row] for row in ratios], dtype=F64)
    inputs = LossInputs(logp, behaviour, None, None, torch.tensor([1.0, -1.0], dtype=F64),
                        torch.ones(2, 2, dtype=F64))
    out = compute_loss(inputs, LossConfig(eps_low=0.2, eps_high=0.28))
    (g,) = torch.autograd.grad(out.loss, logp)
    # d(-r A / (2 * 2)) / d logp = -r A / 4 on unclipped tokens; 0 where the clipped branch binds
    expected = [[-1.25 * 1.0 / 4, 0.0], [0.0, -0.81 * -1.0 / 4]]
    torch.testing.assert_close(g, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 4)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 4)
    assert out.loss.item() == pytest.approx(-((1.25 + 1.28) / 2 + (-0.8 - 0.81) / 2) / 2, abs=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_variance_groups_contribute_nothing(variant: Variant) -> None:
    adv = group_advantages([1.0, 1.0], AdvantageConfig(), 1e-4).tolist()
    assert adv == [0.0, 0.0]
    for agg in AGGS:
        loss, g = grad_of(make_inputs(adv=adv), LossConfig(variant=variant, agg=agg, max_len_norm=MAX_LEN))
        assert loss.item() == 0.0
        assert torch.count_nonzero(g) == 0


# ------------------------------------------------------------------------------------------ KL


def test_k3_kl_is_zero_with_zero_gradient_at_the_reference() -> None:
    x = make_inputs(adv=[0.0, 0.0])
    x.ref_logprobs = x.logprobs.detach().clone()
    out = compute_loss(x, LossConfig(beta=0.1))
    (g,) = torch.autograd.grad(out.loss, x.logprobs)
    assert out.metrics["kl"] == 0.0
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(g) == 0


def test_k3_kl_hand_value() -> None:
    d = [[0.5, -0.3, 0.0], [1.0, -1.0]]  # ref - logp on the counted tokens
    ref = torch.tensor(LOGP, dtype=F64) + torch.tensor([d[0], d[1] + [0.0]], dtype=F64)
    k3 = [[math.exp(v) - v - 1 for v in row] for row in d]
    assert all(v >= 0 for row in k3 for v in row) and k3[0][0] > 0
    for agg in AGGS:
        cfg = LossConfig(beta=0.1, agg=agg, max_len_norm=MAX_LEN)
        out = compute_loss(make_inputs(adv=[0.0, 0.0], ref=ref), cfg)
        assert out.metrics["kl"] == pytest.approx(hand_agg(k3, agg), abs=1e-12)
        assert out.loss.item() == pytest.approx(0.1 * hand_agg(k3, agg), abs=1e-12)
    # with advantages: loss = -objective + beta * KL
    out = compute_loss(make_inputs(ref=ref), LossConfig(beta=0.1))
    expected = -hand_agg(hand_terms("grpo_offpolicy_approx"), "seq_mean_token_mean") + 0.1 * hand_agg(
        k3, "seq_mean_token_mean")
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_beta_without_ref_raises() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(make_inputs(), LossConfig(beta=0.01))


def test_ref_ignored_when_beta_zero() -> None:
    ref = torch.tensor(LOGP, dtype=F64) + 1.0
    out = compute_loss(make_inputs(ref=ref), LossConfig(beta=0.0))
    assert out.metrics["kl"] == 0.0
    assert out.loss.item() == pytest.approx(-0.4875, abs=1e-12)


# ------------------------------------------------------------------------------------------ IS correction

W = [[1.0, 2.0, 0.5], [1.0, 1.2]]  # pi_k / alpha for the IS-correction tests; cap 1.5


def is_inputs() -> LossInputs:
    x = make_inputs()
    log_w = torch.tensor([[math.log(v) for v in row] + [0.0] * (3 - len(row)) for row in W], dtype=F64)
    x.proximal_logprobs = x.behaviour_logprobs + log_w
    return x


def test_tis_caps_the_weight() -> None:
    out = compute_loss(is_inputs(), LossConfig(is_correction="tis", is_cap=1.5))
    row0 = [1.65 * 1.0, 1.8 * 1.5, 1.05 * 0.5]  # w = 2 capped at 1.5
    row1 = [-0.4 * 1.0, -0.65 * 1.2]
    assert out.loss.item() == pytest.approx(-(sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-12)
    assert out.metrics["is_weight_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.0 + 1.2) / 5)
    assert out.metrics["tokens"] == 5.0


def test_mis_masks_the_token() -> None:
    out = compute_loss(is_inputs(), LossConfig(is_correction="mis", is_cap=1.5))
    row0 = [1.65 * 1.0, 1.05 * 0.5]  # the w = 2 token is rejected: out of the sum and the count
    row1 = [-0.4 * 1.0, -0.65 * 1.2]
    assert out.loss.item() == pytest.approx(-(sum(row0) / 2 + sum(row1) / 2) / 2, abs=1e-12)
    assert out.metrics["tokens"] == 4.0
    assert out.metrics["is_dropped_frac"] == pytest.approx(1 / 5)
    assert out.metrics["is_weight_mean"] == pytest.approx((1.0 + 0.5 + 1.0 + 1.2) / 4)
    assert out.metrics["clip_frac_high"] == 0.0  # the only clipped-high token was the rejected one
    _, g = grad_of(is_inputs(), LossConfig(is_correction="mis", is_cap=1.5))
    assert g[0, 1].item() == 0.0


def test_is_correction_replaces_decoupled_weight() -> None:
    # decoupled's own weight is w = pi_k / alpha; TIS swaps it for min(w, C) rather than multiplying again
    out = compute_loss(is_inputs(), LossConfig(variant="decoupled_ppo", is_correction="tis", is_cap=1.5))
    row0 = [1.0 * ppo(1.1 / 1.0, 1.5, 0.8, 1.2), 1.5 * ppo(1.3 / 2.0, 1.5, 0.8, 1.2),
            0.5 * ppo(0.7 / 0.5, 1.5, 0.8, 1.2)]
    row1 = [1.0 * ppo(0.7 / 1.0, -0.5, 0.8, 1.2), 1.2 * ppo(1.3 / 1.2, -0.5, 0.8, 1.2)]
    assert out.loss.item() == pytest.approx(-(sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-12)
    # a cap nothing reaches leaves decoupled_ppo as it is (w applied once)
    far_cap = LossConfig(variant="decoupled_ppo", is_correction="tis", is_cap=100.0)
    uncapped = compute_loss(is_inputs(), far_cap)
    plain = compute_loss(is_inputs(), LossConfig(variant="decoupled_ppo"))
    assert uncapped.loss.item() == pytest.approx(plain.loss.item(), abs=1e-12)


# pi / pi_k = (pi / alpha) / (pi_k / alpha) on the counted tokens of is_inputs(): [1.1, 0.65, 1.4], [0.7, 1.0833]
R_DEC = [[r / w for r, w in zip(row, wrow, strict=True)] for row, wrow in zip(R, W, strict=True)]


def sapo_gate(r: float, a: float) -> float:
    t = 1.0 if a > 0 else 1.05
    return 4 / t / (1 + math.exp(-t * (r - 1)))


def test_cispo_with_tis_clips_the_ratio_against_pi_k() -> None:
    """verl's decoupled mode: the weight is sg(clip(pi/pi_k)) * min(pi_k/alpha, C). Clipping pi/alpha instead and
    then multiplying by the IS weight would count the staleness pi_k/alpha twice (row 0 token 1: clip(1.3) * 1.5
    = 1.8 instead of clip(0.65) * 1.5 = 1.2)."""
    cfg = LossConfig(variant="cispo", is_correction="tis", is_cap=1.5)
    weights = [[clip(rd, 0.8, 1.2) * min(w, 1.5) for rd, w in zip(drow, wrow, strict=True)]
               for drow, wrow in zip(R_DEC, W, strict=True)]
    assert weights[0] == pytest.approx([1.1, 1.2, 0.6])
    terms = [[wt * a * lp for wt, lp in zip(wrow, lrow, strict=False)]
             for wrow, lrow, a in zip(weights, LOGP, ADV, strict=True)]
    out = compute_loss(is_inputs(), cfg)
    assert out.loss.item() == pytest.approx(-hand_agg(terms, "seq_mean_token_mean"), abs=1e-12)
    assert out.metrics["ratio_mean"] == pytest.approx(sum(sum(row) for row in R_DEC) / 5)
    _, g = grad_of(is_inputs(), cfg)  # d loss / d log pi_t = -(1/B)(1/|y|) weight_t A
    expected = [[-wt * a / len(wrow) / 2 for wt in wrow] for wrow, a in zip(weights, ADV, strict=True)]
    assert g[0].tolist() == pytest.approx(expected[0], abs=1e-12)
    assert g[1, :2].tolist() == pytest.approx(expected[1], abs=1e-12) and g[1, 2].item() == 0.0


def test_sapo_with_mis_gates_the_ratio_against_pi_k() -> None:
    """term = gate(pi/pi_k) * A * pi_k/alpha on the tokens MIS keeps (the w = 2 token is rejected)."""
    cfg = LossConfig(variant="sapo", is_correction="mis", is_cap=1.5, agg="token_mean")
    kept = [[(0, 1.0), (2, 0.5)], [(0, 1.0), (1, 1.2)]]  # (token, w) of the counted tokens
    terms = [[sapo_gate(R_DEC[b][t], ADV[b]) * ADV[b] * w for t, w in row] for b, row in enumerate(kept)]
    out = compute_loss(is_inputs(), cfg)
    assert out.loss.item() == pytest.approx(-hand_agg(terms, "token_mean"), abs=1e-12)
    assert out.metrics["tokens"] == 4.0


@pytest.mark.parametrize("variant", ["cispo", "sapo"])
def test_is_correction_leaves_cispo_and_sapo_alone_when_pi_k_is_alpha(variant: Variant) -> None:
    """pi_k = alpha: w = 1 and pi/pi_k = pi/alpha, so the decoupled form is the plain variant."""
    def inputs() -> LossInputs:
        x = make_inputs()
        x.proximal_logprobs = x.behaviour_logprobs.clone()
        return x

    plain_loss, plain_g = grad_of(inputs(), LossConfig(variant=variant))
    for corr in ("tis", "mis"):
        loss, g = grad_of(inputs(), LossConfig(variant=variant, is_correction=corr))  # type: ignore[arg-type]
        assert loss.item() == pytest.approx(plain_loss.item(), abs=1e-12)
        torch.testing.assert_close(g, plain_g, rtol=0, atol=1e-14)


@pytest.mark.parametrize("cfg", [
    LossConfig(variant="grpo_offpolicy_exact"), LossConfig(variant="decoupled_ppo"),
    LossConfig(is_correction="tis"), LossConfig(variant="gspo", is_correction="mis")])
def test_missing_proximal_raises(cfg: LossConfig) -> None:
    assert cfg.requires_proximal()
    with pytest.raises(ValueError, match="proximal_logprobs"):
        compute_loss(make_inputs(with_prox=False), cfg)


def test_requires_flags() -> None:
    assert not LossConfig().requires_proximal()
    assert not LossConfig(variant="gspo").requires_proximal()
    assert not LossConfig().requires_ref()
    assert LossConfig(beta=0.001).requires_ref()


# ------------------------------------------------------------------------------------------ robustness


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_mask_rows_are_finite_and_contribute_zero(variant: Variant, agg: Aggregation) -> None:
    mask = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    cfg = LossConfig(variant=variant, agg=agg, max_len_norm=MAX_LEN, beta=0.1, is_correction="tis")
    x = make_inputs(mask=mask, ref=torch.tensor(LOGP, dtype=F64) - 0.2)
    loss, g = grad_of(x, cfg)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.count_nonzero(g[1]) == 0
    # all-empty batch: loss 0, metrics finite
    out = compute_loss(make_inputs(mask=[[0.0] * 3, [0.0] * 3], ref=x.ref_logprobs), cfg)
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["tokens"] == 0.0


def test_empty_row_counts_in_the_sequence_mean() -> None:
    out = compute_loss(make_inputs(mask=[[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), LossConfig())
    assert out.loss.item() == pytest.approx(-((1.65 + 1.8 + 1.05) / 3 + 0.0) / 2, abs=1e-12)


def test_garbage_on_padding_does_not_leak() -> None:
    x = make_inputs()
    x.behaviour_logprobs[1, 2] = math.nan
    x.proximal_logprobs[1, 2] = math.inf  # type: ignore[index]
    for variant in VARIANTS:
        loss, g = grad_of(x, LossConfig(variant=variant))
        assert loss.item() == pytest.approx(-hand_agg(hand_terms(variant), "seq_mean_token_mean"), abs=1e-12)
        assert torch.isfinite(g).all() and g[1, 2].item() == 0.0


def test_huge_log_ratio_with_zero_advantage_stays_finite() -> None:
    x = make_inputs(adv=[0.0, 0.0])
    x.behaviour_logprobs[0, 0] = -1e4  # r = e^9999 would be inf, and inf * 0 = NaN
    loss, g = grad_of(x, LossConfig())
    assert loss.item() == 0.0 and torch.isfinite(g).all()


def test_bool_mask_equals_float_mask() -> None:
    x = make_inputs()
    x.mask = x.mask.bool()
    assert compute_loss(x, LossConfig()).loss.item() == pytest.approx(-0.4875, abs=1e-12)


def test_float32_inputs_keep_float32() -> None:
    x = make_inputs()
    x32 = LossInputs(x.logprobs.detach().float().requires_grad_(), x.behaviour_logprobs.float(), None, None,
                     x.advantages.float(), x.mask.float())
    out = compute_loss(x32, LossConfig())
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(-0.4875, abs=1e-5)


def test_shape_mismatch_raises() -> None:
    x = make_inputs()
    x.advantages = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match="advantages"):
        compute_loss(x, LossConfig())
    x = make_inputs()
    x.mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="mask"):
        compute_loss(x, LossConfig())


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(("change", "key"), [
    ({"eps_low": -0.1}, "eps_low"), ({"eps_low": 1.0}, "eps_low"), ({"eps_high": -0.01}, "eps_high"),
    ({"beta": -1.0}, "beta"), ({"is_cap": 0.0}, "is_cap"), ({"max_len_norm": 0}, "max_len_norm"),
    ({"variant": "ppo"}, "variant"), ({"agg": "sum"}, "agg"), ({"is_correction": "cis"}, "is_correction")])
def test_validate_rejects_with_the_key_named(change: dict[str, object], key: str) -> None:
    cfg = LossConfig(**change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"loss.{key}"):
        cfg.validate()
    with pytest.raises(ValueError, match=f"loss.{key}"):
        compute_loss(make_inputs(), cfg)


def test_defaults_validate_and_load_from_config_mappings() -> None:
    LossConfig().validate()
    cfg = build(LossConfig, {"variant": "decoupled_ppo", "eps_high": 0.28, "is_correction": "tis"}, "loss.")
    assert cfg == LossConfig(variant="decoupled_ppo", eps_high=0.28, is_correction="tis")
    with pytest.raises(ConfigError, match="loss.variant"):
        build(LossConfig, {"variant": "ppo"}, "loss.")


def test_tables_cover_the_literals() -> None:
    tables: list[tuple[dict[str, Callable[..., object]], tuple[str, ...]]] = [
        (loss_mod._VARIANTS, get_args(Variant)), (loss_terms.AGGREGATIONS, get_args(Aggregation)),
        (loss_terms.CORRECTIONS, get_args(loss_terms.ISCorrection))]
    for table, names in tables:
        assert set(table) == set(names)


# ------------------------------------------------------------------------------------------ the peers' variants


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    """d loss / d log pi_t = -(1/B)(1/|y|) clip(r_t) A: the clipped tokens (1.3 -> 1.2, 0.7 -> 0.8 on row 1)
    still get a gradient, with the capped weight (PPO's min() gives them none)."""
    _, g = grad_of(make_inputs(), LossConfig(variant="cispo"))
    expected = [[-clip(r, 0.8, 1.2) * a / len(row) / 2 for r in row] for row, a in zip(R, ADV, strict=True)]
    assert g[0].tolist() == pytest.approx(expected[0], abs=1e-12)
    assert g[1, :2].tolist() == pytest.approx(expected[1], abs=1e-12) and g[1, 2].item() == 0.0
    _, g_ppo = grad_of(make_inputs(), LossConfig())
    assert g_ppo[0, 1].item() == 0.0 and g[0, 1].item() != 0.0  # the same token: cut by PPO, kept by CISPO


def test_sapo_gate_gradient_is_one_on_policy_and_smooth_off_it() -> None:
    """d term / d log pi = 4 s (1 - s) r A with s = sigmoid(tau (r - 1)): A at r = 1, decaying smoothly."""
    _, g = grad_of(make_inputs(), LossConfig(variant="sapo", agg="token_mean"))
    expected = []
    for row, a in zip(R, ADV, strict=True):
        t = 1.0 if a > 0 else 1.05
        expected.append([-4 * (s := 1 / (1 + math.exp(-t * (r - 1)))) * (1 - s) * r * a / 5 for r in row])
    assert g[0].tolist() == pytest.approx(expected[0], abs=1e-12)
    assert g[1, :2].tolist() == pytest.approx(expected[1], abs=1e-12)
    on = make_inputs(mask=[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    on.behaviour_logprobs = on.logprobs.detach().clone()  # r = 1
    _, g_on = grad_of(on, LossConfig(variant="sapo", agg="token_mean"))
    assert g_on[0, 0].item() == pytest.approx(-ADV[0], abs=1e-12)


def test_dual_clip_bounds_negative_advantage_terms() -> None:
    """A<0 and a ratio past c: the term is c*A (no gradient) instead of r*A; A>0 terms are untouched."""
    inputs = make_inputs(adv=[-1.0, 2.0])
    with torch.no_grad():
        inputs.behaviour_logprobs[0, 0] = inputs.logprobs[0, 0] - math.log(5.0)  # r = 5 on an A<0 token
    cfg = LossConfig(dual_clip_c=3.0, agg="token_mean")
    loss, g = grad_of(inputs, cfg)
    plain, g_plain = grad_of(inputs, dataclasses.replace(cfg, dual_clip_c=None))
    # token (0, 0): plain term 5 * -1 = -5, dual-clipped max(-5, 3 * -1) = -3: the loss is 2/5 lower
    assert loss.item() == pytest.approx(plain.item() - 2.0 / 5, abs=1e-12)
    assert g[0, 0].item() == 0.0 and g_plain[0, 0].item() != 0.0
    assert torch.equal(g[1], g_plain[1])
    with pytest.raises(ConfigError, match="dual_clip_c"):
        LossConfig(variant="cispo", dual_clip_c=3.0).validate()
    with pytest.raises(ConfigError, match="dual_clip_c"):
        LossConfig(dual_clip_c=1.0).validate()


def test_the_config_names_and_the_loss_tables_agree() -> None:
    """The config (torch-free, so a typo is rejected before torch loads) names what the loss tables implement."""
    from typing import get_args

    from grpo_learner import loss, loss_terms
    from grpo_learner.loss_config import ISCorrection

    assert set(loss._VARIANTS) == set(get_args(Variant))
    assert set(loss_terms.AGGREGATIONS) == set(get_args(Aggregation))
    assert set(loss_terms.CORRECTIONS) == set(get_args(ISCorrection))
