"""The policy loss: pure functions of per-token log-probability tensors.

Three policies meet in an off-policy, streaming learner (notation of Mroueh et al., arXiv 2505.22257):

* ``pi``     -- the policy being optimised (``LossInputs.logprobs``, carries the gradient);
* ``alpha``  -- the behaviour policy, i.e. the (possibly stale) weights the generator sampled with
  (``behaviour_logprobs``, as reported by the serving engine);
* ``pi_k``   -- the "proximal" policy, the learner's own weights before this optimiser step
  (``proximal_logprobs``, one extra no-grad forward pass; only some variants need it, see
  :meth:`LossConfig.requires_proximal`).

Each variant turns these into a per-token objective term (broadcast to tokens for sequence-level variants);
an aggregation reduces the terms to a scalar, and ``loss = -objective + beta * KL`` (eq. 7). Variants,
aggregations and importance-sampling corrections are looked up in ``Literal``-keyed tables, so adding one
means writing one small function and one table entry (the aggregations, corrections and the KL estimator
are in ``grpo_learner.loss_terms``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

import torch
from torch import Tensor

from grpo_learner.loss_config import Aggregation, ISCorrection, LossConfig, Variant
from grpo_learner.loss_terms import AGGREGATIONS, CORRECTIONS, k3, log_ratio

__all__ = ["Aggregation", "ISCorrection", "LossConfig", "LossInputs", "LossOutputs", "Variant", "compute_loss",
           "counted_tokens"]

@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all [B, T] except ``advantages`` [B]."""

    logprobs: Tensor  # log pi(y_t | x, y_<t) under the current weights; requires grad
    behaviour_logprobs: Tensor  # log alpha(y_t | ...), reported by the generator that sampled y
    proximal_logprobs: Tensor | None  # log pi_k(y_t | ...), learner's weights before this step, no grad
    ref_logprobs: Tensor | None  # log pi_ref(y_t | ...) for the KL term; needed when beta > 0
    advantages: Tensor  # A_alpha(x, y), one per sequence (grpo_learner.advantages.group_advantages)
    mask: Tensor  # 1 / True on completion tokens that count, 0 / False on prompt and padding


@dataclass
class LossOutputs:
    """The scalar to minimise and detached diagnostics.

    ``metrics`` (over the counted tokens, i.e. after MIS rejection): clip_frac_low / clip_frac_high (the
    clipped branch binds: A<0 and ratio < lower bound / A>0 and ratio > upper bound), ratio_mean, ratio_max
    (of the ratio the variant clips: pi/alpha, the sequence ratio for gspo, pi/pi_k for decoupled_ppo and for
    cispo/sapo with is_correction), kl (aggregated k3, not times beta; 0.0 when beta == 0), tokens;
    decoupled_weight_mean (decoupled_ppo without is_correction); is_weight_mean and is_dropped_frac (with
    is_correction).
    """

    loss: Tensor  # -(aggregated objective) + beta * (aggregated KL); scalar
    metrics: dict[str, float]


class _Prepared(NamedTuple):
    """Inputs cast to one dtype, old-policy tensors detached, mask as bool (after any MIS rejection)."""

    logp: Tensor
    behaviour: Tensor
    proximal: Tensor | None
    adv: Tensor  # [B, 1], broadcasts over tokens
    mask: Tensor  # bool [B, T]


class _Surrogate(NamedTuple):
    """A variant's per-token objective before any importance weight, plus what the metrics need."""

    objective: Tensor  # [B, T]
    ratio: Tensor  # [B, T], the ratio that is clipped
    low: Tensor | float  # the clip bounds that ratio is compared with (broadcastable to [B, T])
    high: Tensor | float
    weight: Tensor | None  # the variant's own detached behaviour-correction weight, if any


Bound = TypeVar("Bound", Tensor, float)  # both clip bounds tensors, or both numbers (torch.clamp's two forms)


def _clipped_term(ratio: Tensor, low: Bound, high: Bound, adv: Tensor) -> Tensor:
    """The PPO surrogate min(r A, clip(r, low, high) A) (Schulman et al., arXiv 1707.06347, eq. 7)."""
    return torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def _grpo_offpolicy_approx(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """Off-policy GRPO, approximate clip (arXiv 2505.22257, eq. 6 with pi_k/alpha ~ 1, per token)::

        r_t = pi(y_t) / alpha(y_t);   term_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

    The paper found it more stable than the exact form. With alpha = pi_k it is standard clipped GRPO
    (Shao et al., arXiv 2402.03300).
    """
    ratio = torch.exp(log_ratio(p.logp, p.behaviour, p.mask))
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    return _Surrogate(_clipped_term(ratio, low, high, p.adv), ratio, low, high, None)


def _grpo_offpolicy_exact(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """Off-policy GRPO, exact clip (arXiv 2505.22257, eq. 6; after G-PPO / ToPPO)::

        r_t = pi / alpha,  r'_t = pi_k / alpha
        term_t = min(r_t A, clip(r_t, max(r'_t - eps_low, 0), r'_t + eps_high) A)

    Keeps pi/alpha within eps of pi_k/alpha, i.e. pi close to pi_k, whatever the staleness of alpha.
    """
    assert p.proximal is not None  # compute_loss checks this with a proper error
    ratio = torch.exp(log_ratio(p.logp, p.behaviour, p.mask))
    r_prox = torch.exp(log_ratio(p.proximal, p.behaviour, p.mask))
    low, high = (r_prox - cfg.eps_low).clamp_min(0.0), r_prox + cfg.eps_high
    return _Surrogate(_clipped_term(ratio, low, high, p.adv), ratio, low, high, None)


def _gspo(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """GSPO, sequence-level ratio (Zheng et al., arXiv 2507.18071, the GSPO objective)::

        s = exp( (1/|y|) sum_t log(pi(y_t) / alpha(y_t)) )      (geometric mean of the token ratios)
        term = min(s A, clip(s, 1 - eps_low, 1 + eps_high) A),  broadcast to every token of y

    so that seq_mean_token_mean yields exactly the sequence term. The GSPO paper clips far tighter than the
    token-level variants (eps ~ 3e-4 / 4e-4): the geometric mean moves much less than single token ratios.
    """
    log_r = log_ratio(p.logp, p.behaviour, p.mask)
    n = p.mask.sum(dim=-1, keepdim=True).clamp_min(1)
    seq_ratio = torch.exp(log_r.sum(dim=-1, keepdim=True) / n)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    term = _clipped_term(seq_ratio, low, high, p.adv).expand_as(log_r)
    return _Surrogate(term, seq_ratio.expand_as(log_r), low, high, None)


def _decoupled_ppo(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """Decoupled PPO (AReaL, Fu et al., arXiv 2505.24298; after Hilton et al., arXiv 2110.00641)::

        w_t = pi_k / alpha (no grad),  rp_t = pi / pi_k
        term_t = w_t * min(rp_t A, clip(rp_t, 1 - eps_low, 1 + eps_high) A)

    The trust region is centred on the recent proximal policy, and w corrects for sampling from alpha.
    w is returned as the surrogate's ``weight`` (applied by compute_loss) so that an ``is_correction``
    replaces it by its truncated / masked form instead of applying a second importance weight.
    """
    assert p.proximal is not None  # compute_loss checks this with a proper error
    ratio = torch.exp(log_ratio(p.logp, p.proximal, p.mask))
    weight = torch.exp(log_ratio(p.proximal, p.behaviour, p.mask))
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    return _Surrogate(_clipped_term(ratio, low, high, p.adv), ratio, low, high, weight)


def _policy_ratio(p: _Prepared, cfg: LossConfig) -> Tensor:
    """cispo's and sapo's ratio: pi/alpha, or pi/pi_k when is_correction brings the weight pi_k/alpha (once)."""
    den = p.behaviour if cfg.is_correction is None else p.proximal
    assert den is not None  # _prepare raised otherwise
    return torch.exp(log_ratio(p.logp, den, p.mask))


def _cispo(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, eq. 4; in verl and TRL)::

        r_t = pi / alpha  (is_correction null),  pi / pi_k  (tis|mis: compute_loss multiplies by w_t ~ pi_k/alpha)
        term_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi(y_t)

    The weight is clipped and detached and the gradient flows through log pi, so a clipped token still
    contributes (with the capped weight) instead of being cut off as in PPO's min(). MiniMax used no lower
    bound: eps_low close to 1 (e.g. 0.99) approximates that. The term's value is not a surrogate objective's
    value; its gradient is the point: sg(w) * A * grad log pi. With tis the weight is clip(pi/pi_k) *
    min(pi_k/alpha, C), verl's decoupled form (sampled from alpha, trust region around pi_k).
    """
    ratio = _policy_ratio(p, cfg)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = ratio.detach().clamp(low, high)
    logp = torch.where(p.mask, p.logp, torch.zeros_like(p.logp))  # padding logprobs may be garbage
    return _Surrogate(weight * p.adv * logp, ratio, low, high, None)


def _sapo(p: _Prepared, cfg: LossConfig) -> _Surrogate:
    """SAPO, soft adaptive policy optimisation (Gao et al., arXiv 2511.20347; in verl and TRL)::

        r_t = pi / alpha  (is_correction null),  pi / pi_k  (tis|mis: compute_loss multiplies by w_t)
        tau = tau_pos if A > 0 else tau_neg;   term_t = (4 / tau) * sigmoid(tau * (r_t - 1)) * A

    A smooth gate instead of a hard clip: the gradient weight 4 s (1 - s) r_t (s = the sigmoid) is exactly 1 on
    policy (r = 1) and decays smoothly as r leaves 1, instead of dropping to 0 at the clip bound. Nothing is
    clipped, so the clip fractions report the tokens outside [1 - eps_low, 1 + eps_high] for comparison.
    """
    ratio = _policy_ratio(p, cfg)
    tau = torch.full_like(p.adv, cfg.sapo_tau_neg).masked_fill(p.adv > 0, cfg.sapo_tau_pos)  # in ratio's dtype
    term = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * p.adv
    return _Surrogate(term, ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, None)


def _dual_clip(objective: Tensor, adv: Tensor, c: float) -> Tensor:
    """Dual-clip PPO (Ye et al., arXiv 1912.09729, eq. 5): for A < 0, term = max(term, c * A)."""
    return torch.where(adv < 0, torch.maximum(objective, c * adv), objective)


_VARIANTS: dict[Variant, Callable[[_Prepared, LossConfig], _Surrogate]] = {
    "grpo_offpolicy_approx": _grpo_offpolicy_approx,
    "grpo_offpolicy_exact": _grpo_offpolicy_exact,
    "gspo": _gspo,
    "decoupled_ppo": _decoupled_ppo,
    "cispo": _cispo,
    "sapo": _sapo,
}


def _prepare(inputs: LossInputs, cfg: LossConfig) -> _Prepared:
    """Check shapes and required tensors; cast to one float dtype (at least float32, since ratios of bf16
    logprobs are too coarse for a 0.2 clip range); detach everything but the current logprobs."""
    logp = inputs.logprobs
    if logp.dim() != 2:
        raise ValueError(f"logprobs: expected [B, T], got shape {tuple(logp.shape)}")
    named = {"behaviour_logprobs": inputs.behaviour_logprobs, "proximal_logprobs": inputs.proximal_logprobs,
             "ref_logprobs": inputs.ref_logprobs, "mask": inputs.mask}
    for name, t in named.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logprobs {tuple(logp.shape)}")
    if inputs.advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages: expected shape [B] = {tuple(logp.shape[:1])}, "
                         f"got {tuple(inputs.advantages.shape)}")
    if cfg.requires_proximal() and inputs.proximal_logprobs is None:
        needs = cfg.variant_needs_proximal()
        why = f"variant={cfg.variant}" if needs else f"is_correction={cfg.is_correction}"
        raise ValueError(f"loss.{why} needs proximal_logprobs (the learner's logprobs under its pre-step "
                         "weights, from a no-grad forward pass); pass them, or use "
                         "variant=grpo_offpolicy_approx with is_correction=null")
    if cfg.requires_ref() and inputs.ref_logprobs is None:
        raise ValueError(f"loss.beta={cfg.beta} needs ref_logprobs; pass them or set loss.beta=0")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = inputs.mask if inputs.mask.dtype == torch.bool else inputs.mask != 0
    prox = inputs.proximal_logprobs
    return _Prepared(
        logp=logp.to(dtype),
        behaviour=inputs.behaviour_logprobs.detach().to(dtype),
        proximal=None if prox is None else prox.detach().to(dtype),
        adv=inputs.advantages.detach().to(dtype).unsqueeze(-1),
        mask=mask,
    )


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _metrics(p: _Prepared, s: _Surrogate, kl: Tensor, is_w: Tensor | None,
             mask_in: Tensor) -> dict[str, float]:
    """Detached diagnostics over the counted tokens, gathered with a single device sync."""
    with torch.no_grad():
        m, ratio = p.mask, s.ratio.detach()
        low = s.low.detach() if isinstance(s.low, Tensor) else s.low
        high = s.high.detach() if isinstance(s.high, Tensor) else s.high
        # binding = the clipped branch wins the min(), which is when the gradient is cut off
        bind_low = m & (p.adv < 0) & (ratio < low)
        bind_high = m & (p.adv > 0) & (ratio > high)
        n = m.sum()
        # ratios are > 0, so filling uncounted tokens with 0 leaves the max alone (and gives 0 without tokens)
        ratio_max = torch.where(m, ratio, torch.zeros_like(ratio)).amax() if ratio.numel() else n * 0
        values = {
            "clip_frac_low": _masked_mean(bind_low.to(ratio.dtype), m),
            "clip_frac_high": _masked_mean(bind_high.to(ratio.dtype), m),
            "ratio_mean": _masked_mean(ratio, m),
            "ratio_max": ratio_max,
            "kl": kl.detach(),
            "tokens": n.to(ratio.dtype),
        }
        if s.weight is not None and is_w is None:
            values["decoupled_weight_mean"] = _masked_mean(s.weight, m)
        if is_w is not None:
            values["is_weight_mean"] = _masked_mean(is_w, m)
            values["is_dropped_frac"] = 1.0 - n / mask_in.sum().clamp_min(1)
        keys = list(values)
        flat = torch.stack([torch.as_tensor(values[k], dtype=ratio.dtype, device=ratio.device) for k in keys])
        return dict(zip(keys, flat.tolist(), strict=True))


def _correction(proximal: Tensor, behaviour: Tensor, mask: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The IS weight w = pi_k/alpha after ``cfg.is_correction`` and the mask of the tokens it keeps."""
    assert cfg.is_correction is not None
    w = torch.exp(log_ratio(proximal, behaviour, mask))
    return CORRECTIONS[cfg.is_correction](w, mask, cfg.is_cap)


def counted_tokens(mask: Tensor, behaviour_logprobs: Tensor, proximal_logprobs: Tensor | None,
                   cfg: LossConfig) -> int:
    """How many tokens ``compute_loss`` counts (the ``token_mean`` denominator, the ``tokens`` metric): those of
    ``mask`` that the IS correction keeps (``mis`` rejects some; the proximal logprobs are fixed for a batch, so
    the count is known before the first backward)."""
    keep = mask if mask.dtype == torch.bool else mask != 0
    if cfg.is_correction is None or proximal_logprobs is None:
        return int(keep.sum())
    dtype = torch.promote_types(proximal_logprobs.dtype, torch.float32)
    _, kept = _correction(proximal_logprobs.detach().to(dtype), behaviour_logprobs.detach().to(dtype), keep, cfg)
    return int(kept.sum())


def compute_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """``loss = -agg(w_t * term_t) + beta * agg(k3_t)`` over the counted tokens (arXiv 2505.22257, eq. 7).

    ``term_t`` comes from ``cfg.variant``, ``agg`` from ``cfg.agg``; ``w_t`` is the IS correction
    (``cfg.is_correction``) or else the variant's own weight (decoupled_ppo) or else 1. The setting of
    Yao et al. (ratio against the learner's pi_k, truncated weight pi_k/alpha) is decoupled_ppo + tis;
    cispo and sapo then also take their ratio against pi_k (verl's decoupled mode); on the variants that
    clip pi/alpha (approx, exact, gspo) the weight is an extra factor on top.

    For zero-variance groups (all advantages 0) the surrogate and its gradient vanish; to also drop their
    KL term as eq. 8 does, zero their rows of ``mask``. Every mean is over this call's tensors only: with
    gradient accumulation over micro-batches (and ranks) the caller rescales (``grpo_learner.parallel.share``:
    B_micro / B for the sequence means, counted tokens / the batch's for the token mean).
    """
    cfg.validate()
    p = _prepare(inputs, cfg)
    mask_in = p.mask
    is_w: Tensor | None = None
    if cfg.is_correction is not None:
        assert p.proximal is not None  # _prepare raised otherwise
        is_w, mask = _correction(p.proximal, p.behaviour, p.mask, cfg)
        p = p._replace(mask=mask)
    s = _VARIANTS[cfg.variant](p, cfg)
    if cfg.dual_clip_c is not None:
        s = s._replace(objective=_dual_clip(s.objective, p.adv, cfg.dual_clip_c))
    weight = is_w if is_w is not None else s.weight
    per_token = s.objective if weight is None else s.objective * weight
    aggregate = AGGREGATIONS[cfg.agg]
    if cfg.agg == "seq_mean_token_sum_norm" and cfg.max_len_norm is None:
        raise ValueError("loss.max_len_norm: seq_mean_token_sum_norm needs the constant (LearnerConfig.loss_config "
                         "fills in the pipeline's max_new_tokens)")
    objective = aggregate(per_token, p.mask, cfg.max_len_norm or 1)
    kl = objective.new_zeros(())
    if cfg.beta > 0.0:
        assert inputs.ref_logprobs is not None  # _prepare raised otherwise
        ref = inputs.ref_logprobs.detach().to(p.logp.dtype)
        # None only for the aggregations that ignore it (seq_mean_token_sum_norm raised above)
        kl = aggregate(k3(p.logp, ref, p.mask), p.mask, cast(int, cfg.max_len_norm))
    loss = -objective + cfg.beta * kl
    return LossOutputs(loss=loss, metrics=_metrics(p, s, kl, is_w, mask_in))
