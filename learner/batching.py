"""Scored groups -> padded tensors, and token-budget microbatches.

Layout of a :class:`Batch` with N rows (one per completion), L = longest prompt + completion, T = longest
completion::

    input_ids[i]       = prompt_i + completion_i, right-padded with pad_id to L
    completion_start[i] = len(prompt_i)   (index in input_ids of the first completion token)
    completion token j of row i  = input_ids[i, completion_start[i] + j]      (j < len(completion_i))
    its per-token tensors        = completion_mask / behaviour_logprobs / ...[i, j]

Per-token tensors are aligned to completion tokens (column 0 = first completion token), not to input
positions: that is the layout the loss functions and the producers' behaviour logprobs use, and it makes T, not L,
the width of everything the loss touches. Right padding keeps position ids 0..len-1 equal to the column index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from grpo_core.wire import ScoredGroup


@dataclass
class Batch:
    """Padded tensors for N completions (see the module docstring for the layout)."""

    input_ids: Tensor  # [N, L] long
    attention_mask: Tensor  # [N, L] long, 1 on prompt + completion tokens
    completion_mask: Tensor  # [N, T] float32, 1 on completion tokens
    completion_start: Tensor  # [N] long, = prompt length
    behaviour_logprobs: Tensor  # [N, T] float32, 0 where masked
    advantages: Tensor  # [N] float32, one per completion (sequence level)
    group_index: Tensor  # [N] long, index of the row's group in the collate() input
    policy_version: Tensor  # [N] long, the behaviour policy's version (for staleness metrics / corrections)
    source_rows: Tensor  # [N] long, row index in the batch collate() returned (maps microbatches back)
    temperature: Tensor  # [N] float32, the T the row's behaviour logprobs are at (1 for raw); logits are / T

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Completion tokens (the tokens the loss sees), not counting padding."""
        return int(self.completion_mask.sum().item())

    @property
    def completion_lengths(self) -> Tensor:
        """[N] long: completion tokens per row."""
        return self.completion_mask.sum(-1).long()

    @property
    def seq_lengths(self) -> Tensor:
        """[N] long: prompt + completion tokens per row."""
        return self.attention_mask.sum(-1).long()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``."""
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def rows(self, idx: Tensor | Sequence[int], trim: bool = True) -> Batch:
        """The sub-batch of rows ``idx`` (in that order); ``trim`` cuts L and T to the rows' own maxima.

        Trimming saves the forward pass the padding of rows that are not there; it never cuts a real token.
        """
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        sub = {f.name: getattr(self, f.name)[idx] for f in fields(self)}
        if trim and len(idx):
            seq_len = int(sub["attention_mask"].sum(-1).max().item())
            comp_len = int(sub["completion_mask"].sum(-1).max().item())
            sub["input_ids"], sub["attention_mask"] = sub["input_ids"][:, :seq_len], sub["attention_mask"][:, :seq_len]
            sub["completion_mask"] = sub["completion_mask"][:, :comp_len]
            sub["behaviour_logprobs"] = sub["behaviour_logprobs"][:, :comp_len]
        return Batch(**sub)


def collate(groups: Sequence[ScoredGroup], advantages: Sequence[Tensor | Sequence[float]], pad_id: int) -> Batch:
    """Stack the completions of ``groups`` (in order, completion order within a group) into one :class:`Batch`.

    ``advantages[g]`` holds one advantage per completion of ``groups[g]`` (computed by the caller, e.g.
    :mod:`grpo_learner.advantages`); it is repeated over the row's tokens by the loss, not here.
    Raises ValueError on a completion with an empty prompt (its first token would have no prefix to be
    predicted from) or advantages that do not match the group sizes.
    """
    if len(advantages) != len(groups):
        raise ValueError(f"advantages: {len(advantages)} entries for {len(groups)} groups")
    rows = [(g, c) for g, group in enumerate(groups) for c in group.completions]
    adv_rows: list[float] = []
    for g, (group, adv) in enumerate(zip(groups, advantages, strict=True)):
        values = adv.detach().float().flatten().tolist() if isinstance(adv, Tensor) else [float(a) for a in adv]
        if len(values) != len(group.completions):
            raise ValueError(f"advantages[{g}]: {len(values)} values for {len(group.completions)} completions "
                             f"of group {group.group_id!r}")
        adv_rows += values
    n = len(rows)
    prompt_lens = [len(c.prompt_token_ids) for _, c in rows]
    comp_lens = [len(c.completion_token_ids) for _, c in rows]
    for (_, c), p in zip(rows, prompt_lens, strict=True):
        if p == 0:
            raise ValueError(f"completion {c.group_id}/{c.index}: empty prompt (nothing to predict the first "
                             "completion token from)")
    seq_len = max((p + t for p, t in zip(prompt_lens, comp_lens, strict=True)), default=0)
    comp_width = max(comp_lens, default=0)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    attn = np.zeros((n, seq_len), dtype=np.int64)
    comp_mask = np.zeros((n, comp_width), dtype=np.float32)
    behaviour = np.zeros((n, comp_width), dtype=np.float32)
    for i, ((_, c), p, t) in enumerate(zip(rows, prompt_lens, comp_lens, strict=True)):
        ids[i, :p], ids[i, p:p + t] = c.prompt_token_ids, c.completion_token_ids
        attn[i, :p + t] = 1
        comp_mask[i, :t] = 1.0
        behaviour[i, :t] = c.behaviour_logprobs
    return Batch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn),
        completion_mask=torch.from_numpy(comp_mask), completion_start=torch.tensor(prompt_lens, dtype=torch.long),
        behaviour_logprobs=torch.from_numpy(behaviour), advantages=torch.tensor(adv_rows, dtype=torch.float32),
        group_index=torch.tensor([g for g, _ in rows], dtype=torch.long),
        policy_version=torch.tensor([c.policy_version for _, c in rows], dtype=torch.long),
        source_rows=torch.arange(n, dtype=torch.long),
        temperature=torch.tensor([c.logprob_temperature or 1.0 for _, c in rows], dtype=torch.float32))


def microbatches(batch: Batch, max_tokens: int, sort_by_length: bool = True) -> list[Batch]:
    """Split ``batch`` into microbatches of at most ``max_tokens`` padded tokens (rows x own trimmed L) each.

    Rows are taken longest first (``sort_by_length``; in batch order without it) and a microbatch is closed when
    the next row would push rows x max length past the budget, or would fill less than half of the microbatch's
    length: a row pads to its microbatch's longest, so with long-tailed completion lengths one batch-wide
    microbatch computes mostly padding (docs/results/2026-12-07-throughput.md). Each microbatch is trimmed to
    its own longest row. A single row longer than ``max_tokens`` cannot be split (its tokens attend to each other)
    and becomes a microbatch of its own, over budget. Every row lands in exactly one microbatch;
    ``Batch.source_rows`` says which row of the collated batch it is.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
    lengths = batch.seq_lengths.tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort_by_length else range(len(lengths))
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and (grown * (len(current) + 1) > max_tokens or 2 * lengths[i] < longest):
            chunks.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        chunks.append(current)
    return [batch.rows(chunk) for chunk in chunks]
