"""The demo's policy before RL and its yardstick: a format-only warm start and greedy held-out accuracy.

Why a warm start at all: a randomly initialised tiny model never emits "<digit><EOS>", so an exact-match reward
is 0 for every sample, every group has zero variance and GRPO has no signal. Supervised training on the task's
prompts with *random* answers (a fresh uniform draw from the family's answer set each time a prompt is seen)
teaches only the format: the model learns "one digit, then EOS" with a near-uniform digit, which is right by
chance ~10% of the time -- enough for G=8 groups to contain a correct sample about half the time (measured on
these 2-core machines: a task whose answers a format-only start hits less often than ~10% never learned within
3,000 steps). Everything the model then knows about the *answer* it learned from reward.

Why greedy decoding for evaluation: it is deterministic (same weights -> same accuracy, no sampling noise in
the demo's before/after comparison) and it measures the policy's mode, which is what RL sharpens.

The warm start is a fixed number of seeded steps (not a time budget), so the same inputs give the same weights
on every run; ``max_seconds`` exists only as a safety cap for much slower machines.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpo_core.fsutil import move_into
from grpo_producers.datasets import SYNTHETIC_REWARDS, SyntheticConfig, load_synthetic
from grpo_stream.tiny_model import _check_no_lm_head, _quietly

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WARM_START_FILE = "warm_start.json"
WARM_START_FORMAT = 1  # bump when warm_start's training changes, so cached warm starts are redone
# Measured on the 2-core CPU (tiny preset): 100 steps x 32 sequences, ~2-4 s unloaded (up to ~30 s when the
# cores are shared); held-out greedy format rate 1.0, digit entropy ~0.99 of uniform, accuracy at chance.
WARM_START_STEPS = 100
WARM_START_BATCH = 32
WARM_START_LR = 3e-3

TaskFamilies = str | Sequence[str]
WarmAnswers = Literal["random", "prompt_digit", "shuffled"]


def family_list(task_family: TaskFamilies) -> list[str]:
    """``"max"``, ``"max,last_digit"`` or ``["max", "last_digit"]`` -> a list of family names (order kept)."""
    names = task_family.split(",") if isinstance(task_family, str) else list(task_family)
    return [n.strip() for n in names if n.strip()]


def multi_token(task_family: TaskFamilies) -> bool:
    """Whether the families' answers are digit strings (``copy``, ``reverse``: scored by ``positions``)."""
    return all(SYNTHETIC_REWARDS.get(f) == "positions" for f in family_list(task_family))


def task_reward(task_family: TaskFamilies) -> str:
    """How the held-out evaluation scores the families: the verifier's reward for them (``positions``:
    partial credit per digit for multi-token answers; ``exact`` otherwise)."""
    return "positions" if multi_token(task_family) else "exact"


def warm_recipe(task_family: TaskFamilies) -> tuple[WarmAnswers, int]:
    """The format-only warm start of the families, (answers, steps): the prompt's digits in a random order then
    EOS for multi-token answers (300 steps: the length and the digits take longer to learn than one digit),
    one of the prompt's digits otherwise; neither says which answer is right."""
    return ("shuffled", 300) if multi_token(task_family) else ("prompt_digit", WARM_START_STEPS)


def task_items(task_family: TaskFamilies, split: str = "train", seed: int = 0) -> tuple[list[str], list[str]]:
    """``(prompts, answers)`` of the synthetic families on one side of the feeder's held-out partition.

    Uses the feeder's own loader, so the demo evaluates on exactly the prompts the train feeder never sends
    (same ``seed`` and default ``eval_fraction`` as ``SyntheticConfig``).
    """
    cfg = SyntheticConfig(tasks=family_list(task_family), split=split, seed=seed)  # type: ignore[arg-type]
    cfg.validate()
    items = list(load_synthetic(cfg, "demo", lambda _reason, _where: None))
    return [it.prompt for it in items], [str(it.metadata["answer"]) for it in items]


# ------------------------------------------------------------------------------------------ warm start


def _format_batch(rows: Sequence[tuple[list[int], list[int]]], eos_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer + EOS rows with labels only on answer + EOS (the prompt is not a target:
    the model should learn what to *say*, not to predict the prompt's digits). ``rows``: (prompt ids, answer
    ids) pairs, tokenized once up front."""
    width = max(len(p) + len(a) + 1 for p, a in rows)
    ids = torch.full((len(rows), width), eos_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        target = torch.tensor([*a, eos_id])
        ids[i, :len(p)], ids[i, len(p):len(p) + len(target)] = torch.tensor(p), target
        labels[i, len(p):len(p) + len(target)] = target
        mask[i, :len(p) + len(target)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train_format(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str], targets: list[str],
                  steps: int, seed: int, max_seconds: float | None, answers: WarmAnswers = "random") -> int:
    """AdamW on random-answer batches; returns the steps taken (fewer only if ``max_seconds`` ran out).

    ``answers``: ``random`` draws each target from the family's answer set; ``prompt_digit`` draws it from the
    digits that appear in the prompt (the format "copy one of the prompt's digits", still not *which* one);
    ``shuffled`` is the prompt's own answer with its characters in a random order (multi-token answers: the
    format "this many of these digits, then EOS", not their order)."""
    answer_set = sorted(set(targets))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    eos_id = int(tok.eos_token_id)
    prompt_ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    answer_ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answer_set]
    prompt_digits = [[c for c in p if c.isdigit()] or ["0"] for p in prompts]
    digit_ids = {str(d): tok(str(d), add_special_tokens=False)["input_ids"] for d in range(10)}
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            return step
        # a fresh random answer for every row: the format is learned, the answer stays at chance
        picks = [rng.randrange(len(prompt_ids)) for _ in range(WARM_START_BATCH)]
        if answers == "prompt_digit":
            rows = [(prompt_ids[i], digit_ids[rng.choice(prompt_digits[i])]) for i in picks]
        elif answers == "shuffled":
            rows = [(prompt_ids[i], tok("".join(rng.sample(targets[i], len(targets[i]))),
                                        add_special_tokens=False)["input_ids"]) for i in picks]
        else:
            rows = [(prompt_ids[i], rng.choice(answer_ids)) for i in picks]
        loss = model(**_format_batch(rows, eos_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return steps


def _record(model_dir: Path, families: list[str], steps: int, seed: int, answers: str = "random") -> dict:
    """What a warm start depends on, so an identical request can reuse an existing result."""
    try:
        source = json.loads((model_dir / "build.json").read_text())
    except (OSError, ValueError):
        source = None
    return {"format": WARM_START_FORMAT, "families": families, "steps": steps, "seed": seed, "answers": answers,
            "batch": WARM_START_BATCH, "lr": WARM_START_LR, "source_build": source}


def _cached(out: Path, record: dict) -> bool:
    try:
        found = json.loads((out / WARM_START_FILE).read_text())
    except (OSError, ValueError):
        return False
    found.pop("steps_taken", None)  # an outcome, not part of the request
    return found == record and (out / "model.safetensors").is_file()


def warm_start(model_dir: str | Path, task_family: TaskFamilies = "max", steps: int = WARM_START_STEPS,
               seed: int = 0, out_dir: str | Path | None = None, max_seconds: float | None = None,
               answers: WarmAnswers = "random") -> Path:
    """Teach ``model_dir``'s model the answer format of ``task_family`` and save it to ``out_dir`` (or in place).

    Trains on the family's *train* split with answers drawn uniformly from the family's answer set, so held-out
    greedy accuracy stays at chance. Deterministic for given inputs (seeded, fixed ``steps``). Returns the
    output directory (safetensors, tokenizer, generation config and ``warm_start.json``). With a separate
    ``out_dir`` built from a ``build_tiny_model`` directory, an identical earlier result is reused.

    Writing in place removes ``build.json``: the directory no longer holds the pristine random build, and
    ``build_tiny_model`` must not mistake it for one.
    """
    src = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else src
    families = family_list(task_family)
    record = _record(src, families, steps, seed, answers)
    if out.resolve() != src.resolve() and record["source_build"] is not None and _cached(out, record):
        return out
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompts, targets = task_items(families, "train")
    taken = _train_format(model, tok, prompts, targets, steps, seed, max_seconds, answers)
    record["steps_taken"] = taken
    _save(model, tok, src, out, record)
    return out


def _save(model: PreTrainedModel, tok: PreTrainedTokenizerBase, src: Path, out: Path, record: dict) -> None:
    """Write into a temporary sibling, then move files in with ``warm_start.json`` last (a crash never leaves a
    directory that looks finished)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.warm-", dir=out.parent))
    try:
        _quietly(model.save_pretrained, tmp, safe_serialization=True)
        if model.config.tie_word_embeddings:
            _check_no_lm_head(tmp / "model.safetensors")  # vLLM's in-place reload needs this (tiny_model.py)
        tok.save_pretrained(tmp)
        (tmp / WARM_START_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if out.resolve() == src.resolve():
            (out / "build.json").unlink(missing_ok=True)
        move_into(tmp, out, WARM_START_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ evaluation

def _load(model_or_dir: PreTrainedModel | str | Path,
          tokenizer: PreTrainedTokenizerBase | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if isinstance(model_or_dir, str | Path):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
        return model, tokenizer or AutoTokenizer.from_pretrained(model_or_dir)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_or_dir.config.name_or_path)
    return model_or_dir, tokenizer


@torch.inference_mode()
def greedy_generate(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str], max_tokens: int = 4,
                    batch_size: int = 256) -> list[list[int]]:
    """Greedy completions (token ids, cut after the first EOS, EOS kept) of ``prompts``.

    Left-padded batches in a fixed order, so the same weights and prompts give the same tokens every time.
    """
    from grpo_producers.backends.hf import left_pad  # the producer's padding: same positions as in generation

    eos_id = int(tok.eos_token_id)
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts[start:start + batch_size]]
        ids, mask = left_pad(chunk, eos_id, model.device)
        gen = cast(Any, model).generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                        eos_token_id=eos_id, pad_token_id=eos_id, top_k=None, top_p=None,
                                        temperature=None)
        for row in gen[:, ids.shape[1]:].tolist():
            out.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
    model.train(was_training)
    return out


def completion_answer(tok: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """The answer a completion gives: its text before the first EOS, stripped (the exact-match reward's view)."""
    eos_id = int(tok.eos_token_id)
    ids = list(token_ids)
    if eos_id in ids:
        ids = ids[:ids.index(eos_id)]
    return cast(str, tok.decode(ids, skip_special_tokens=True)).strip()


def is_digit_then_eos(tok: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> bool:
    """Whether a completion is exactly the warm start's format: one digit token, then EOS."""
    ids = list(token_ids)
    return len(ids) == 2 and ids[1] == tok.eos_token_id and cast(str, tok.decode(ids[:1])).isdigit()


def accuracy(predicted: Sequence[str], answers: Sequence[str]) -> float:
    """Exact-match accuracy of stripped strings."""
    if len(predicted) != len(answers):
        raise ValueError(f"{len(predicted)} predictions for {len(answers)} answers")
    if not answers:
        raise ValueError("accuracy of an empty set is undefined")
    return sum(p.strip() == a.strip() for p, a in zip(predicted, answers, strict=True)) / len(answers)


def evaluate(model_or_dir: PreTrainedModel | str | Path, prompts: list[str], answers: list[str],
             max_tokens: int = 4, tokenizer: PreTrainedTokenizerBase | None = None, reward: str = "exact") -> float:
    """Held-out accuracy: greedy completion (text before EOS, stripped) == answer, as a fraction of prompts;
    ``reward="positions"``: the mean partial credit of the ``positions`` reward instead (multi-token answers).

    ``model_or_dir``: a directory (loaded fresh) or a loaded model (its tokenizer from ``tokenizer`` or from
    the directory it was loaded from). Deterministic: greedy, fixed batching, float32.
    """
    model, tok = _load(model_or_dir, tokenizer)
    completions = greedy_generate(model, tok, prompts, max_tokens)
    said = [completion_answer(tok, c) for c in completions]
    if reward == "positions":
        from grpo_verifiers.rewards.builtins import positions

        return sum(positions(s, "", {"answer": a})[0] for s, a in zip(said, answers, strict=True)) / len(answers)
    return accuracy(said, answers)


@torch.inference_mode()
def sampled_pass_at_1(model_or_dir: PreTrainedModel | str | Path, prompts: list[str], answers: list[str], k: int,
                      temperature: float = 1.0, max_tokens: int = 4, seed: int = 0,
                      tokenizer: PreTrainedTokenizerBase | None = None) -> float:
    """Pass@1 estimated from ``k`` samples per prompt at ``temperature`` (the paper: 50 samples): the mean, over
    prompts and samples, of exact match. Seeded, so the same weights give the same estimate."""
    from grpo_producers.backends.hf import left_pad

    model, tok = _load(model_or_dir, tokenizer)
    eos_id = int(tok.eos_token_id)
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    right = 0
    for start in range(0, len(prompts), 64):
        chunk = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts[start:start + 64]]
        ids, mask = left_pad(chunk, eos_id, model.device)
        gen = cast(Any, model).generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                        top_k=None, top_p=None, num_return_sequences=k, max_new_tokens=max_tokens,
                                        eos_token_id=eos_id, pad_token_id=eos_id)
        said = [completion_answer(tok, row) for row in gen[:, ids.shape[1]:].tolist()]
        truth = [a for a in answers[start:start + 64] for _ in range(k)]
        right += sum(s.strip() == a.strip() for s, a in zip(said, truth, strict=True))
    model.train(was_training)
    return right / (len(prompts) * k)
