"""Collation, microbatching and the learner's logprob recomputation (including HF producer equivalence)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core import wire
from grpo_learner.batching import Batch, collate, microbatches
from grpo_learner.logprobs import completion_logprobs, completion_logprobs_with_entropy, token_logprobs
from grpo_stream.tiny_model import build_tiny_model

PAD = 99


def completion(group: str, index: int, size: int, prompt: list[int], tokens: list[int], logprobs: list[float],
               version: int = 3) -> wire.Completion:
    return wire.Completion(
        group_id=group, index=index, group_size=size, prompt_id=group.split("@")[0], task="t",
        prompt_token_ids=np.array(prompt, dtype=np.int32), completion_token_ids=np.array(tokens, dtype=np.int32),
        behaviour_logprobs=np.array(logprobs, dtype=np.float32), policy_version=version, producer_id="p",
        finish_reason="stop")


def group(gid: str, members: list[wire.Completion], version: int = 3) -> wire.ScoredGroup:
    rewards = [float(i) for i in range(len(members))]
    return wire.ScoredGroup(group_id=gid, prompt_id=gid.split("@")[0], task="t", policy_version=version,
                            completions=members, rewards=rewards, reward_mean=0.0, reward_std=1.0,
                            verifier_id="v", group_size=len(members))


def two_groups() -> list[wire.ScoredGroup]:
    a = [completion("a@e0r0", 0, 2, [5, 6, 7], [8, 9], [-0.1, -0.2]),
         completion("a@e0r0", 1, 2, [5, 6, 7], [10], [-0.3])]
    b = [completion("b@e0r0", 0, 2, [1, 2], [3, 4, 11], [-0.4, -0.5, -0.6], version=4),
         completion("b@e0r0", 1, 2, [1, 2], [], [], version=4)]
    return [group("a@e0r0", a), group("b@e0r0", b, version=4)]


def test_collate_hand_checked() -> None:
    batch = collate(two_groups(), [torch.tensor([1.0, -1.0]), [0.5, -0.5]], pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, PAD], [1, 2, 3, 4, 11],
                                        [1, 2, PAD, PAD, PAD]]
    assert batch.input_ids.dtype == torch.long
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert batch.completion_mask.dtype == batch.behaviour_logprobs.dtype == torch.float32
    assert batch.completion_start.tolist() == [3, 3, 2, 2]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor(
        [[-0.1, -0.2, 0], [-0.3, 0, 0], [-0.4, -0.5, -0.6], [0, 0, 0]]))
    assert batch.advantages.tolist() == [1.0, -1.0, 0.5, -0.5] and batch.advantages.dtype == torch.float32
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.policy_version.tolist() == [3, 3, 4, 4]
    assert batch.source_rows.tolist() == [0, 1, 2, 3]
    assert batch.num_tokens == 6 and batch.num_rows == 4
    # Completion token j of row i is input_ids[i, completion_start[i] + j].
    for i in range(4):
        for j in range(int(batch.completion_lengths[i])):
            assert batch.input_ids[i, batch.completion_start[i] + j] != PAD
    sub = batch.rows([1, 3])
    assert sub.input_ids.tolist() == [[5, 6, 7, 10], [1, 2, PAD, PAD]]  # trimmed to the rows' own length
    assert sub.completion_mask.tolist() == [[1], [0]] and sub.source_rows.tolist() == [1, 3]
    assert batch.to("cpu").input_ids.tolist() == batch.input_ids.tolist()


def test_collate_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="advantages"):
        collate(two_groups(), [[1.0, -1.0]], pad_id=PAD)
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        collate(two_groups(), [[1.0, -1.0], [1.0]], pad_id=PAD)
    empty_prompt = group("c@e0r0", [completion("c@e0r0", 0, 1, [], [1], [-1.0])])
    with pytest.raises(ValueError, match="empty prompt"):
        collate([empty_prompt], [[0.0]], pad_id=PAD)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    torch.manual_seed(0)
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


def random_groups(n_groups: int, size: int, seed: int, vocab: int = 300) -> list[wire.ScoredGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(1, vocab, rng.integers(1, 12)).tolist()
        members = []
        for i in range(size):
            n = int(rng.integers(0, 15))
            members.append(completion(f"g{g}@e0r0", i, size, prompt, rng.integers(1, vocab, n).tolist(),
                                      (-rng.exponential(1.0, n)).tolist()))
        groups.append(group(f"g{g}@e0r0", members))
    return groups


def reference_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """One sequence at a time, unpadded, full forward, float32 log_softmax: the obviously right answer."""
    out = torch.zeros_like(batch.behaviour_logprobs)
    for i in range(batch.num_rows):
        n, p = int(batch.seq_lengths[i]), int(batch.completion_start[i])
        ids = batch.input_ids[i, :n].unsqueeze(0)
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        for j in range(n - p):
            out[i, j] = logp[p + j - 1, ids[0, p + j]]
    return out


def test_completion_logprobs_equal_unpadded_recomputation(tiny: tuple[Path, torch.nn.Module]) -> None:
    model = tiny[1]
    prompts, comps = [[4, 5, 6], [7], [8, 9, 10, 11, 12, 13]], [[20, 21, 22, 23, 24], [30, 31], [40]]
    members = [completion("x@e0r0", i, 3, p, c, [-1.0] * len(c))
               for i, (p, c) in enumerate(zip(prompts, comps, strict=True))]
    batch = collate([group("x@e0r0", members)], [[0.0, 0.0, 0.0]], pad_id=0)
    with torch.no_grad():
        got, entropy = completion_logprobs_with_entropy(model, batch, chunk_tokens=3)
        want = reference_logprobs(model, batch)
    assert got.shape == batch.completion_mask.shape and got.dtype == torch.float32
    assert (got[batch.completion_mask == 0] == 0).all()
    assert (got - want).abs().max().item() < 1e-5
    assert ((entropy > 0) == batch.completion_mask.bool()).all() and (entropy <= np.log(320) + 1e-4).all()
    full = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs  # [B, L-1] view of the same
    for i in range(3):
        p, n = int(batch.completion_start[i]), len(comps[i])
        torch.testing.assert_close(full[i, p - 1:p - 1 + n], got[i, :n], atol=1e-6, rtol=0)


def test_gradient_matches_plain_log_softmax(tiny: tuple[Path, torch.nn.Module]) -> None:
    """The chunked, checkpointed head gives the same gradient as the naive full-logits computation."""
    model = tiny[1]
    batch = collate(random_groups(2, 3, seed=1), [[1.0, -0.5, 0.2]] * 2, pad_id=0)
    weights = batch.completion_mask * batch.advantages[:, None]
    model.zero_grad()
    (completion_logprobs(model, batch, chunk_tokens=4) * weights).sum().backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = logits.log_softmax(-1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    aligned = torch.stack([logp[i].roll(-(int(batch.completion_start[i]) - 1))[:weights.shape[1]]
                           for i in range(batch.num_rows)])
    (aligned * weights).sum().backward()
    for a, p in zip(fast, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()


@pytest.mark.parametrize("sort_by_length", [False, True])
def test_microbatches_respect_budget_and_reassemble(tiny: tuple[Path, torch.nn.Module], sort_by_length: bool) -> None:
    model = tiny[1]
    groups = random_groups(4, 4, seed=2)
    batch = collate(groups, [torch.linspace(-1, 1, 4)] * 4, pad_id=0)
    budget = 48
    longest = int(batch.seq_lengths.max())
    assert longest <= budget
    mbs = microbatches(batch, budget, sort_by_length=sort_by_length)
    assert len(mbs) > 1
    assert sorted(torch.cat([mb.source_rows for mb in mbs]).tolist()) == list(range(batch.num_rows))
    with torch.no_grad():
        whole = completion_logprobs(model, batch)
        parts = torch.zeros_like(whole)
        for mb in mbs:
            assert mb.input_ids.numel() <= budget
            assert mb.input_ids.shape[1] == int(mb.seq_lengths.max())  # trimmed to its own longest row
            assert mb.completion_mask.shape[1] == int(mb.completion_lengths.max())
            lp = completion_logprobs(model, mb)
            assert lp.shape == mb.completion_mask.shape
            parts[mb.source_rows, :lp.shape[1]] = lp
            torch.testing.assert_close(mb.advantages, batch.advantages[mb.source_rows])
            torch.testing.assert_close(mb.behaviour_logprobs, batch.behaviour_logprobs[mb.source_rows, :lp.shape[1]])
    assert sum(mb.num_tokens for mb in mbs) == batch.num_tokens
    assert (parts - whole).abs().max().item() < 1e-5


def test_row_longer_than_budget_is_its_own_microbatch() -> None:
    batch = collate(two_groups(), [[1.0, -1.0], [0.5, -0.5]], pad_id=PAD)  # row lengths 5, 4, 5, 2
    mbs = microbatches(batch, max_tokens=4, sort_by_length=False)
    assert [mb.source_rows.tolist() for mb in mbs] == [[0], [1], [2], [3]]
    assert mbs[0].input_ids.numel() == 5  # over budget: one row cannot be split
    # In order: rows 0 and 1 fit 10 tokens; row 3 (2 tokens) would fill less than half of row 2's 5.
    assert [mb.source_rows.tolist() for mb in microbatches(batch, 10, sort_by_length=False)] == [[0, 1], [2], [3]]
    assert [mb.source_rows.tolist() for mb in microbatches(batch, 1000, sort_by_length=False)] == [[0, 1, 2], [3]]
    # Longest first by default; the row of 2 tokens would fill less than half of a microbatch 5 long.
    assert [mb.source_rows.tolist() for mb in microbatches(batch, 1000)] == [[0, 2, 1], [3]]
    with pytest.raises(ValueError):
        microbatches(batch, 0)


def test_long_tailed_rows_are_not_padded_to_the_longest() -> None:
    """Completions of 1-200 tokens: one batch-wide microbatch pads every row to 200; longest-first microbatches
    that close below half their length pad each row at most to twice its own length."""
    rng = np.random.default_rng(0)
    lengths = [200, 150, *rng.integers(1, 60, 30).tolist()]
    members = [completion("t@e0r0", i, len(lengths), [1, 2], rng.integers(3, 300, n).tolist(), [-1.0] * n)
               for i, n in enumerate(lengths)]
    batch = collate([group("t@e0r0", members)], [[0.5] * len(lengths)], pad_id=PAD)
    mbs = microbatches(batch, max_tokens=1 << 20)
    padded = sum(mb.input_ids.numel() for mb in mbs)
    assert padded < 0.3 * batch.input_ids.numel()  # 32 rows x 202 before
    for mb in mbs:
        lens = mb.seq_lengths
        assert int(lens.max()) <= 2 * int(lens.min())
    assert sorted(torch.cat([mb.source_rows for mb in mbs]).tolist()) == list(range(len(lengths)))


def test_hf_generate_logprobs_match_learner(tiny: tuple[Path, torch.nn.Module]) -> None:
    """What an HF producer reports as behaviour logprobs (log_softmax of generate()'s scores at the sampled
    tokens, sampling at temperature 1 without top-k/top-p) equals the learner's recomputation to < 1e-4."""
    path, model = tiny
    tok = AutoTokenizer.from_pretrained(path)
    prompts = ["12+7=", "max(3,8)=", "Q: What is 3*4?\nA:"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=2, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    scores, logits = torch.stack(out.scores, 1), torch.stack(out.logits, 1)  # [B, T, V]
    assert torch.equal(scores, logits)  # no logits processor touched them: scores are the raw logits
    new = out.sequences[:, enc.input_ids.shape[1]:]
    hf_logprobs = scores.float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    groups = []
    for p, text in enumerate(prompts):
        members = []
        for k in range(2):
            row = 2 * p + k
            ids = new[row].tolist()
            n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)  # EOS is a real token
            members.append(completion(f"p{p}@e0r0", k, 2, tok.encode(text), ids[:n], hf_logprobs[row, :n].tolist()))
        groups.append(group(f"p{p}@e0r0", members))
    batch = collate(groups, [[0.0, 0.0]] * 3, pad_id=tok.pad_token_id)
    with torch.no_grad():
        learner = completion_logprobs(model, batch)
    diff = ((learner - batch.behaviour_logprobs) * batch.completion_mask).abs().max().item()
    print(f"max |HF generate - learner| logprob diff: {diff:.3g} over {batch.num_tokens} tokens")
    assert diff < 1e-4
