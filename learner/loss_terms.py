"""The loss's reductions: how per-token terms become a scalar (the aggregations), the importance-sampling
corrections for the generator/learner mismatch, and the KL estimator; pure functions of tensors, each in a
``Literal``-keyed table that ``grpo_learner.loss`` looks up."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_learner.loss_config import Aggregation, ISCorrection

# Log-ratios are clamped before exp() so that a broken logprob (e.g. a -inf placeholder from the serving
# engine) cannot become inf and then NaN via inf * 0 (zero advantage, padding). e^20 ~ 5e8 lies far outside
# every clip range: the clamp only changes tokens whose term is already clipped, or A<0 tokens with an
# absurd ratio (whose gradient it then cuts, like dual-clip PPO would).
MAX_LOG_RATIO = 20.0


def log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    # where() rather than * mask: padding positions may hold garbage (inf, NaN) that * 0 would propagate.
    return torch.where(mask, num - den, torch.zeros_like(num)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _seq_mean_token_mean(x: Tensor, mask: Tensor, max_len_norm: int) -> Tensor:
    """GRPO (arXiv 2402.03300, eq. 3): (1/B) sum_b (1/|y_b|) sum_t x_bt.

    A sequence with no counted token contributes 0 but still counts in B, so the weight of every other
    sequence does not depend on it.
    """
    per_seq = torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)
    return per_seq.mean()


def _token_mean(x: Tensor, mask: Tensor, max_len_norm: int) -> Tensor:
    """DAPO token-level loss (arXiv 2503.14476, sec. 3.3): sum_bt x_bt / sum_b |y_b|.

    Every token weighs the same, so long answers weigh more than under the per-sequence mean."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _seq_mean_token_sum_norm(x: Tensor, mask: Tensor, max_len_norm: int) -> Tensor:
    """Dr.GRPO (arXiv 2503.20783, sec. 3): (1/B) sum_b (1/L) sum_t x_bt with a constant L = max_len_norm,
    which removes GRPO's bias towards long wrong / short right answers."""
    return (torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1) / max_len_norm).mean()


AGGREGATIONS: dict[Aggregation, Callable[[Tensor, Tensor, int], Tensor]] = {
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_mean": _token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def _tis(w: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training", fengyao.notion.site/off-policy-rl): weight_t = min(w_t, C), mask unchanged."""
    return w.clamp_max(cap), mask


def _mis(w: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Masked IS (Liu, Li et al. 2025, "When speed kills stability"): weight_t = w_t 1[w_t <= C].

    Rejected tokens leave the mask altogether (as in verl's rollout_is mode=mask): they drop out of the
    surrogate, the KL term, the aggregation denominators and the metrics, as if never sampled.
    """
    return w, mask & (w <= cap)


CORRECTIONS: dict[ISCorrection, Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]] = {
    "tis": _tis,
    "mis": _mis,
}


def k3(logp: Tensor, ref: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman 2020, "Approximating KL divergence"; as in TRL
    and DeepSeekMath eq. 4): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased under samples of pi."""
    d = log_ratio(ref, logp, mask)
    return torch.exp(d) - d - 1.0
