"""The external arm of ``bench throughput``: TRL's ``GRPOTrainer`` (PyPI ``trl``, the ``bench`` extra) on the same
model, task, G, prompts per step, lengths and optimizer as the other arms, in a process of its own.

Run as ``python -m grpo_stream.bench.trl_arm SPEC.json RESULT.json`` (:func:`run_trl_arm` does that): TRL's own
code trains, on-policy (``num_iterations`` 1), with HF ``generate`` -- what a user gets from ``pip install trl``
on a machine without CUDA vLLM. What this module adds is measurement and the benchmark's lengths:

* **Timing**: the end of every optimizer step (a ``TrainerCallback``) and the seconds spent generating and scoring
  each batch (TRL's ``_generate_and_score_completions``, timed around the call).
* **Lengths** (``sampling.lengths`` other than ``model``): TRL cannot take one ``max_tokens`` per sample, so the
  model's ``generate`` gets a logits processor that bans EOS before each row's drawn length and forces it at the
  last position: every completion is exactly its drawn length, EOS included (the pipeline's samples end without
  one, ignore_eos; a token's difference). TRL's generation and loss code run unchanged.

What cannot be matched, said in the report: TRL generates with HF ``generate`` (its vLLM modes need CUDA vLLM),
whose batch pads every row to the longest completion and computes the padding; its dual clip is ``delta`` (the
ratio itself capped at c for every token, INTELLECT-2's two-sided clip) where the learner bounds only negative-
advantage terms (verl's ``clip_ratio_c``); it trains on both CPUs as one process (no pinning to split).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrlSpec:
    """Everything the TRL process needs (JSON between the processes)."""

    model: str
    prompts: list[str]
    answers: list[str]
    task: str  # the task the verifier scores the prompts as (the synthetic families': exact or positions)
    group_size: int
    prompts_per_step: int
    steps: int
    lr: float
    max_tokens: int
    temperature: float = 1.0
    lengths: dict[str, Any] = field(default_factory=lambda: {"dist": "model"})  # a LengthsConfig as a dict
    rewards: dict[str, Any] = field(default_factory=dict)  # the verifier's `rewards` section (a RewardConfig)
    dual_clip: float | None = None
    threads: int = 2
    seed: int = 0
    budget_s: float = 600.0
    out_dir: str = ""


@dataclass
class TrlResult:
    step_ends: list[float] = field(default_factory=list)  # perf_counter at the end of each optimizer step
    gen_s: list[float] = field(default_factory=list)  # generation + scoring, per batch
    completion_tokens: list[float] = field(default_factory=list)  # mean completion length per step (TRL's log)
    start: float = 0.0
    trl_version: str = ""


def run_trl_arm(spec: TrlSpec, out: Path, cpus: set[int] | None = None) -> tuple[TrlResult, int]:
    """Run TRL in a child process (pinned to ``cpus``); its result and pid-independent exit code."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = out / "trl-spec.json", out / "trl-result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "TOKENIZERS_PARALLELISM": "false"}
    with (out / "trl.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grpo_stream.bench.trl_arm", str(spec_path),
                                 str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        rc = proc.wait()
    if rc != 0 or not result_path.exists():
        tail = (out / "trl.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"the TRL arm failed (exit {rc}): " + " | ".join(tail))
    return TrlResult(**json.loads(result_path.read_text())), rc


# ---------------------------------------------------------------------------------------------- in the child


def _reward_fn(task: str, rewards: dict[str, Any]) -> Any:
    """A TRL reward function scoring as the pipeline's verifier does: ``task``'s terms of the ``rewards`` config."""
    from grpo_core.config import build, validate_tree
    from grpo_verifiers.rewards import RewardConfig
    from grpo_verifiers.rewards.registry import Plan

    cfg = build(RewardConfig, rewards, "rewards")
    validate_tree(cfg)
    plan = Plan(cfg)

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [plan.score_here(task, c, "", {"answer": a}) for c, a in zip(completions, answer, strict=True)]

    reward.__name__ = f"grpo_stream_{task}"
    return reward


def _drawn_lengths_processor(lengths: Any, eos: int, cap: int, seed: int) -> Any:
    """A logits processor that makes each row exactly its drawn length, EOS last (see the module docstring)."""
    import numpy as np
    import torch
    from transformers import LogitsProcessor

    from grpo_producers.backends.lengths import LengthDraws

    draws = LengthDraws(seed)

    class DrawnLengths(LogitsProcessor):
        def __init__(self) -> None:
            self.reset()

        def reset(self) -> None:
            """Called before every generate(): its first step draws the rows' lengths."""
            self.width, self.rows = -1, torch.zeros(0, dtype=torch.long)

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if self.width < 0:
                self.width = input_ids.shape[1]
                self.rows = torch.tensor(np.asarray(draws(lengths, input_ids.shape[0], cap)), dtype=torch.long)
            t = input_ids.shape[1] - self.width  # tokens generated so far
            last = self.rows - 1 == t
            scores[~last, eos] = float("-inf")
            scores[last] = float("-inf")
            scores[last, eos] = 0.0
            return scores

    return DrawnLengths()


def _child(spec: TrlSpec) -> TrlResult:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, TrainerCallback

    from grpo_producers.backends.lengths import LengthsConfig

    torch.set_num_threads(spec.threads)
    result = TrlResult(trl_version=trl.__version__)
    tok = AutoTokenizer.from_pretrained(spec.model)
    model: Any = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32)  # its generate is replaced
    lengths = LengthsConfig(**spec.lengths)
    if lengths.controlled:
        processor = _drawn_lengths_processor(lengths, int(tok.eos_token_id), spec.max_tokens, spec.seed)
        generate = model.generate

        def generate_drawn(*args: Any, **kwargs: Any) -> Any:
            processor.reset()
            kwargs["logits_processor"] = LogitsProcessorList([processor])
            return generate(*args, **kwargs)

        model.generate = generate_drawn
    batch = spec.prompts_per_step * spec.group_size
    args = trl.GRPOConfig(
        output_dir=spec.out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=spec.group_size, max_completion_length=spec.max_tokens, learning_rate=spec.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, delta=spec.dual_clip,
        loss_type="grpo", scale_rewards="group", temperature=spec.temperature, top_k=0, top_p=1.0,
        max_steps=spec.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        fp16=False, seed=spec.seed, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=True)
    data = datasets.Dataset.from_dict({"prompt": spec.prompts, "answer": spec.answers})
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward_fn(spec.task, spec.rewards), args=args,
                              train_dataset=data, processing_class=tok)
    budget_end = time.perf_counter() + spec.budget_s

    class Clock(TrainerCallback):
        # the ignore: its own parameter names (the Trainer passes args, state, control by position)
        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> Any:  # type: ignore[override]
            result.step_ends.append(time.perf_counter())
            if time.perf_counter() > budget_end:
                control.should_training_stop = True
            return control

    timed = trainer._generate_and_score_completions

    def generate_and_score(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return timed(*a, **k)
        finally:
            result.gen_s.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = generate_and_score  # type: ignore[method-assign]
    trainer.add_callback(Clock())
    result.start = time.perf_counter()
    trainer.train()
    result.completion_tokens = [float(h["completions/mean_length"]) for h in trainer.state.log_history
                                if "completions/mean_length" in h]
    return result


def main(argv: list[str]) -> int:
    spec = TrlSpec(**json.loads(Path(argv[0]).read_text()))
    result = _child(spec)
    Path(argv[1]).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
