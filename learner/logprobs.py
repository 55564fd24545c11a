"""Per-token log-probabilities of sampled tokens under the learner's model (and, optionally, the entropy).

``logprob[t] = log_softmax(logits(prefix ..t))[token t+1]`` in float32. This is the learner's recomputation of
pi (with gradient), pi_k (the proximal policy) and pi_ref (no gradient); the HF producer backend must report the
same numbers for the same weights, so both use :func:`token_logprobs` / the same float32 log-softmax.

Memory: the [tokens, vocab] float32 logits are the largest tensor of a training step (16k tokens x 152k vocab
x 4 B = 10 GB for a Qwen-sized vocab). So the vocabulary projection is applied only where a logprob is needed
(completion tokens, not prompt or padding), in chunks of ``chunk_tokens`` positions; with gradient, each chunk
is checkpointed (its lm_head matmul + log-softmax are recomputed in backward), so only the hidden states are
kept for backward instead of a [tokens, vocab] tensor. Peak extra memory: one chunk's logits.

This needs ``logits = lm_head(base_model(...).last_hidden_state)``, true for Qwen2/Llama/Mistral-style HF models.
Models that transform the logits further (soft-capping, scaling) fall back to a full forward that materialises
all logits. Pass the unwrapped HF model (the path calls ``model.base_model`` and ``get_output_embeddings()``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_learner.batching import Batch

DEFAULT_CHUNK_TOKENS = 1024
# Config attributes of HF models whose logits are not just lm_head(hidden): these take the full-forward path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class TokenLogprobs(NamedTuple):
    """Per-position results; ``entropy`` is None unless asked for, and never carries gradient."""

    logprobs: Tensor
    entropy: Tensor | None


def position_ids_for(attention_mask: Tensor) -> Tensor:
    """0, 1, 2, ... over each row's real tokens, as HF ``generate`` assigns them (right or left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, with_entropy: bool = False,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> TokenLogprobs:
    """Logprobs [B, L-1] of ``input_ids[:, t+1]`` given ``input_ids[:, :t+1]`` (0 where t+1 is padding).

    ``entropy`` (with ``with_entropy``): [B, L-1] entropy of the next-token distribution at each position.
    """
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    rows, cols = valid.nonzero(as_tuple=True)
    lp, ent = _selected_stats(model, input_ids, attention_mask, rows, cols, with_entropy, chunk_tokens)
    shape = (input_ids.shape[0], max(input_ids.shape[1] - 1, 0))
    return TokenLogprobs(_scatter(lp, rows, cols, shape), None if ent is None else _scatter(ent, rows, cols, shape))


def completion_logprobs(model: nn.Module, batch: Batch, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """Logprobs [n, T] of the completion tokens of ``batch`` (aligned with ``batch.completion_mask``, 0 where
    masked). Works on any (micro)batch: T is that batch's own width."""
    return _completion_stats(model, batch, False, chunk_tokens).logprobs


def completion_logprobs_with_entropy(model: nn.Module, batch: Batch, *,
                                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[Tensor, Tensor]:
    """``(logprobs, entropy)``, both [n, T] aligned with ``batch.completion_mask``; entropy is detached."""
    out = _completion_stats(model, batch, True, chunk_tokens)
    assert out.entropy is not None
    return out.logprobs, out.entropy


def _completion_stats(model: nn.Module, batch: Batch, with_entropy: bool, chunk_tokens: int) -> TokenLogprobs:
    # Completion token j of row i sits at input position completion_start[i] + j and is predicted from the
    # hidden state one position earlier.
    # Each row's logits are divided by the temperature its behaviour logprobs are at (1 for raw ones), so both
    # sides of the ratio are of the same distribution.
    rows, j = batch.completion_mask.bool().nonzero(as_tuple=True)
    cols = batch.completion_start[rows] + j - 1
    lp, ent = _selected_stats(model, batch.input_ids, batch.attention_mask, rows, cols, with_entropy, chunk_tokens,
                              batch.temperature.to(batch.input_ids.device)[rows])
    shape = tuple(batch.completion_mask.shape)
    return TokenLogprobs(_scatter(lp, rows, j, shape), None if ent is None else _scatter(ent, rows, j, shape))


def _scatter(values: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, ...]) -> Tensor:
    out = torch.zeros(shape, dtype=torch.float32, device=values.device)
    return out.index_put((rows, cols), values)  # out-of-place: differentiable w.r.t. values


def _selected_stats(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, rows: Tensor, cols: Tensor,
                    with_entropy: bool, chunk_tokens: int,
                    temperature: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprob (and entropy) of ``input_ids[rows, cols + 1]`` from the prefix ending at ``(rows, cols)``; [M]."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens: must be > 0, got {chunk_tokens}")
    hidden, head = _hidden_and_head(model, input_ids, attention_mask)
    selected = hidden[rows, cols]  # [M, H] (or [M, V] logits on the fallback path)
    targets = input_ids[rows, cols + 1]
    recompute = torch.is_grad_enabled() and selected.requires_grad
    lps, ents = [], []
    for start in range(0, selected.shape[0], chunk_tokens):
        h, t = selected[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        temp = None if temperature is None else temperature[start:start + chunk_tokens]
        if recompute:
            lp, ent = checkpoint(_chunk_stats, head, h, t, with_entropy, temp, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(head, h, t, with_entropy, temp)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _chunk_stats(head: nn.Module, hidden: Tensor, targets: Tensor, with_entropy: bool,
                 temperature: Tensor | None = None) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    logp = (logits if temperature is None else logits / temperature.unsqueeze(-1)).log_softmax(-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp, lp.new_zeros(0)
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _hidden_and_head(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, nn.Module]:
    """Final hidden states [B, L, H] and the vocabulary projection; or all logits and identity (fallback)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                              "position_ids": position_ids_for(attention_mask), "use_cache": False}
    config = getattr(model, "config", None)
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    transformed = any(getattr(config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS)
    if head is None or base is None or base is model or transformed:
        return model(**kwargs).logits, nn.Identity()
    return base(**kwargs).last_hidden_state, head
