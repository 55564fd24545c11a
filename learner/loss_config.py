"""The loss's settings (``loss:`` in the learner's config), apart from the math in ``grpo_learner.loss`` so that a
config can be loaded and validated without importing torch (a mistyped key is rejected in well under a second).
The names of variants, aggregations and corrections are ``Literal`` types here; ``grpo_learner.loss`` and
``grpo_learner.loss_terms`` map each to its function (a test checks that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from grpo_core.config import opt, require

Variant = Literal["grpo_offpolicy_approx", "grpo_offpolicy_exact", "gspo", "decoupled_ppo", "cispo", "sapo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
ISCorrection = Literal["tis", "mis"]

_NEEDS_PROXIMAL: frozenset[Variant] = frozenset({"grpo_offpolicy_exact", "decoupled_ppo"})


@dataclass
class LossConfig:
    """Which surrogate objective, how it is clipped, regularised, corrected and aggregated."""

    variant: Variant = opt(
        "grpo_offpolicy_approx",
        "grpo_offpolicy_approx: eq. 6 of arXiv 2505.22257 with pi_k/alpha ~ 1 (clip pi/alpha around 1); "
        "grpo_offpolicy_exact: eq. 6 (clip pi/alpha around pi_k/alpha; needs proximal logprobs); "
        "gspo: sequence-level ratio (arXiv 2507.18071); decoupled_ppo: AReaL (arXiv 2505.24298; needs "
        "proximal logprobs); cispo: clipped, detached IS weight times log pi (MiniMax-M1, arXiv 2506.13585); "
        "sapo: a sigmoid gate instead of a clip (arXiv 2511.20347; sapo_tau_pos/neg). The default differs from verl "
        "and TRL, whose ratio is against a recomputed pi_old (here: decoupled_ppo, or cispo/sapo + is_correction).")
    eps_low: float = opt(
        0.2, "Lower clip range: ratios below 1 - eps_low stop pushing A<0 tokens down. In [0, 1); verl, TRL: 0.2.")
    eps_high: float = opt(
        0.2, "Upper clip range (DAPO clip-higher: eps_high > eps_low, e.g. 0.28). >= 0; verl, TRL: 0.2.")
    dual_clip_c: float | None = opt(
        None, "Dual-clip (arXiv 1912.09729): for A<0 the term is bounded below by c*A, so a huge ratio cannot push "
              "a bad token without limit. > 1; null: off, as TRL's delta. Differs from verl: always on, c = 3.")
    sapo_tau_pos: float = opt(1.0, "sapo: gate temperature for A>0 (verl's and TRL's default 1.0). > 0.")
    sapo_tau_neg: float = opt(1.05, "sapo: gate temperature for A<0 (verl's and TRL's 1.05: a tighter gate). > 0.")
    beta: float = opt(0.0, "KL(pi || pi_ref) coefficient (k3 estimator); > 0 needs reference logprobs. verl, TRL: 0.")
    agg: Aggregation = opt(
        "seq_mean_token_mean",
        "seq_mean_token_mean: GRPO (token mean per sequence, then mean over sequences); token_mean: DAPO "
        "(arXiv 2503.14476; mean over all tokens of the batch); seq_mean_token_sum_norm: Dr.GRPO "
        "(arXiv 2503.20783; per-sequence sum / max_len_norm, then mean over sequences). Differs from verl "
        "(loss_agg_mode token-mean) and TRL (loss_type dapo): both default to token_mean.")
    max_len_norm: int | None = opt(
        None, "The Dr.GRPO constant dividing each sequence's token sum. null: the pipeline contract's "
              "max_new_tokens (the learner fills it in).")
    is_correction: ISCorrection | None = opt(
        None,
        "Generator/learner mismatch correction with w = pi_k/alpha per token (needs proximal logprobs): "
        "tis multiplies each term by min(w, is_cap); mis drops tokens with w > is_cap and weights the rest "
        "by w. With decoupled_ppo it replaces (not multiplies) the variant's own weight w; cispo and sapo "
        "then take their ratio against pi_k, not alpha (verl's decoupled mode). null: off, as in verl; TRL "
        "turns one on with vLLM (sequence_mask).")
    is_cap: float = opt(2.0, "The TIS cap / MIS threshold C on w = pi_k/alpha. > 0. verl: 2.0; TRL (vLLM): 3.0.")

    def validate(self) -> None:
        require(self.variant in get_args(Variant),
                f"loss.variant: {self.variant!r} is not one of {list(get_args(Variant))}")
        require(self.agg in get_args(Aggregation),
                f"loss.agg: {self.agg!r} is not one of {list(get_args(Aggregation))}")
        require(self.is_correction is None or self.is_correction in get_args(ISCorrection),
                f"loss.is_correction: {self.is_correction!r} is not one of {list(get_args(ISCorrection))} or null")
        require(0.0 <= self.eps_low < 1.0,
                f"loss.eps_low: must be in [0, 1) so that the lower clip bound 1 - eps_low stays positive, "
                f"got {self.eps_low}")
        require(self.eps_high >= 0.0,
                f"loss.eps_high: must be >= 0 (0.2 is usual, 0.28 for DAPO clip-higher), got {self.eps_high}")
        require(self.beta >= 0.0,
                f"loss.beta: the KL coefficient must be >= 0 (0 disables the KL term), got {self.beta}")
        require(self.is_cap > 0.0, f"loss.is_cap: must be > 0 (2.0 is usual), got {self.is_cap}")
        require(self.dual_clip_c is None or self.dual_clip_c > 1.0,
                f"loss.dual_clip_c: must be > 1 (3.0 is usual) or null, got {self.dual_clip_c}")
        require(self.dual_clip_c is None or self.variant not in ("cispo", "sapo"),
                f"loss.dual_clip_c: bounds PPO's clipped surrogate; variant={self.variant} has none (set it null)")
        require(self.sapo_tau_pos > 0.0 and self.sapo_tau_neg > 0.0,
                f"loss.sapo_tau_pos/neg: must be > 0, got {self.sapo_tau_pos}/{self.sapo_tau_neg}")
        require(self.max_len_norm is None or self.max_len_norm >= 1,
                f"loss.max_len_norm: must be >= 1 (set it to the generation's max new tokens), "
                f"got {self.max_len_norm}")

    def variant_needs_proximal(self) -> bool:
        """Whether the variant itself (not an IS correction) needs the learner's pre-step logprobs."""
        return self.variant in _NEEDS_PROXIMAL

    def requires_proximal(self) -> bool:
        """Whether ``compute_loss`` needs ``proximal_logprobs`` (the learner's pre-step logprobs)."""
        return self.variant_needs_proximal() or self.is_correction is not None

    def requires_ref(self) -> bool:
        """Whether ``compute_loss`` needs ``ref_logprobs``."""
        return self.beta > 0.0
