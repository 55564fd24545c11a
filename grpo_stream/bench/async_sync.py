"""Arm S of ``bench async``: the synchronous on-policy loop the pipeline replaces, in one process, no Kafka.

generate a batch with the same vLLM engine -> score it with the same reward -> one learner step (the learner's
own :class:`~grpo_learner.trainer.Trainer`) -> reload the new weights into the engine -> repeat (v1-i1). Same
model, task, batch sizes, sampling and learner settings as the pipeline arms: all read from the one run config.

``gen_cpus`` / ``train_cpus`` pin the phases: the engine's processes inherit the CPUs the process has when the
engine starts, then the process itself moves to ``train_cpus`` for the learner steps. Disaggregated (one core
each), one core idles while the other works, as one serving GPU beside training GPUs would; with both sets the
whole machine (the "hybrid engine" setting), each phase has every core.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from grpo_core import wire
from grpo_core.config import build, validate_tree
from grpo_core.stats import group_stats
from grpo_learner.config import LearnerConfig
from grpo_learner.publish import unique_tensors
from grpo_learner.service import load_model
from grpo_learner.trainer import Trainer
from grpo_producers.config import ProducerConfig
from grpo_producers.datasets import SYNTHETIC_REWARDS
from grpo_stream.bench import cpu_use
from grpo_stream.demo_model import task_items
from grpo_verifiers.config import VerifierConfig
from grpo_verifiers.rewards.registry import Plan


@dataclass
class SyncRun:
    """What arm S measured: phase times, tokens, weight snapshots (wall-clock second, step, directory) and the
    learner's metrics of every step."""

    wall_s: float = 0.0
    warmup_s: float = 0.0  # the untimed first batch (kernels compiled on first use), before the clock starts
    gen_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    snapshots: list[tuple[float, int, Path]] = field(default_factory=list)
    step_metrics: list[dict[str, float]] = field(default_factory=list)  # each step's learner metrics, in order
    step_ends: list[float] = field(default_factory=list)  # seconds from the clock's start to each step's end
    completions: int = 0
    trained_tokens: int = 0
    cpu_steal: float | None = None  # the largest share of a CPU's time the host took while the clock ran
    cpu_by_role: dict[str, float] = field(default_factory=dict)  # CPUs used meanwhile: S's tree, the rest


def run_sync(roles: dict[str, dict[str, Any]], tasks: list[str], budget_s: float, out: Path,
             gen_cpus: set[int], train_cpus: set[int], snapshots: int = 80, lag: int = 0,
             max_steps: int = 0) -> SyncRun:
    """Run arm S for ``budget_s`` (or until ``max_steps`` > 0 steps) from the resolved role configs of the run
    (``run.role_configs``); ``snapshots`` 0: no weight snapshots (``bench throughput`` evaluates none).

    ``lag`` > 0 trains each step on the batch generated ``lag`` versions earlier (the first ``lag`` batches wait):
    the staleness a pipeline has, without the pipeline. Nothing overlaps, so it is no faster per step than S; it
    tells whether learning per step changes with staleness itself or with something else the pipeline does."""
    from grpo_producers.backends.base import make_backend

    pcfg = build(ProducerConfig, roles["producer"], "producer")
    lcfg = build(LearnerConfig, roles["learner"], "learner")
    vcfg = build(VerifierConfig, roles["verifier"], "verifier")
    for cfg in (pcfg, lcfg, vcfg):
        validate_tree(cfg)
    torch.manual_seed(lcfg.seed)
    os.sched_setaffinity(0, gen_cpus)  # the engine's processes start here and stay here
    engine = make_backend(pcfg.backend_config())
    os.sched_setaffinity(0, train_cpus)
    torch.set_num_threads(len(train_cpus))
    try:
        score = Scorer(Plan(vcfg.rewards), tasks)
        return _loop(engine, pcfg, lcfg, score, (budget_s, max_steps), out, snapshots, lag, (gen_cpus, train_cpus))
    finally:
        engine.close()


@dataclass
class Scorer:
    """The verifier's rewards for the synthetic families' task (one reward: the families share it), called in
    this process, as the pipeline's verifier calls its inline-trusted terms."""

    plan: Plan
    tasks: list[str]

    @property
    def task(self) -> str:
        rewards = {SYNTHETIC_REWARDS.get(t, "exact") for t in self.tasks}
        if len(rewards) != 1:
            raise ValueError(f"arm S scores one task; the families {self.tasks} are scored by {sorted(rewards)}")
        return rewards.pop()

    def __call__(self, text: str, answer: str) -> float:
        return self.plan.score_here(self.task, text, "", {"answer": answer})


def _loop(engine: Any, pcfg: ProducerConfig, lcfg: LearnerConfig, score: Scorer, limits: tuple[float, int],
          out: Path, snapshots: int, lag: int, pinned: tuple[set[int], set[int]]) -> SyncRun:
    from transformers import AutoTokenizer

    gen_cpus, cpus = pinned[0], pinned[0] | pinned[1]

    tok = AutoTokenizer.from_pretrained(pcfg.backend.tokenizer or pcfg.backend.model)
    prompts, answers = task_items(score.tasks, "train")
    ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    trainer = Trainer(lcfg, load_model(lcfg.model))
    sampling, g, b = pcfg.sampling_params(), pcfg.pipeline.group_size, lcfg.groups_per_batch
    order, rng, res = list(range(len(prompts))), random.Random(lcfg.seed), SyncRun()
    weights_dir = out / "weights"
    with _on(gen_cpus, pinned[1]):
        res.warmup_s = _warm_up(engine, [ids[i] for i in order[:b]], g, sampling, trainer.model, weights_dir)
    generated: deque[tuple[list[int], list[Any], int]] = deque()  # (prompts, samples, version), oldest first
    start, cpu = time.perf_counter(), cpu_use.read({"S": os.getpid()})  # S's tree: its engine's processes too
    budget_s, max_steps = limits
    if snapshots:
        res.snapshots.append((0.0, 0, _snapshot(trainer.model, out / "snapshots" / "s0000")))
    while time.perf_counter() - start < budget_s and not (max_steps and res.steps >= max_steps):
        if len(order) < b:
            order = list(range(len(prompts)))
        rng.shuffle(order)
        picks, order = order[:b], order[b:]
        t0 = time.perf_counter()
        with _on(gen_cpus, pinned[1]):
            generated.append((picks, engine.generate([ids[i] for i in picks], g, sampling), res.steps))
        res.gen_s += time.perf_counter() - t0
        res.tokens += sum(len(x.token_ids) for group in generated[-1][1] for x in group)
        res.completions += sum(len(group) for group in generated[-1][1])
        if len(generated) <= lag:  # lag > 0: the first batches wait until they are `lag` versions old
            continue
        picks, samples, version = generated.popleft()
        t0 = time.perf_counter()
        groups = [_group(f"s{res.steps}-{i}", ids[i], answers[i], s, tok, pcfg, version, score)
                  for i, s in zip(picks, samples, strict=True)]
        stats = trainer.train_step(groups)
        res.step_metrics.append(stats.metrics)
        res.trained_tokens += stats.tokens
        _save(trainer.model, weights_dir)
        with _on(gen_cpus, pinned[1]):
            engine.load_weights(weights_dir)
        res.train_s += time.perf_counter() - t0
        res.steps += 1
        now = time.perf_counter() - start
        res.step_ends.append(now)
        if snapshots and now >= len(res.snapshots) * budget_s / snapshots:
            res.snapshots.append((now, res.steps, _snapshot(trainer.model, out / "snapshots" / f"s{res.steps:04d}")))
    res.wall_s = time.perf_counter() - start
    end = cpu_use.read({"S": os.getpid()})
    res.cpu_steal, res.cpu_by_role = cpu_use.stolen(cpu.machine, end.machine, cpus), cpu_use.cpus_by_role(cpu, end)
    if snapshots:
        res.snapshots.append((res.wall_s, res.steps, _snapshot(trainer.model, out / "snapshots" / "final")))
    return res


@contextlib.contextmanager
def _on(cpus: set[int], back: set[int]) -> Iterator[None]:
    """Run the block's host side on ``cpus``: the calling thread submits the requests and processes the engine's
    outputs (vLLM's front end), which the pipeline's producer does on its own pinned core. Left on the learner's
    CPUs, S's generation had a second core that no pipeline arm has (docs/results/2026-12-06-bench-async.md)."""
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, back)


def _warm_up(engine: Any, prompts: list[list[int]], g: int, sampling: Any, model: torch.nn.Module,
             weights_dir: Path) -> float:
    """One batch generated and one weight reload, untimed and not trained on: the first generation on a fresh
    machine compiles kernels (~25 s on the 2-core machine), which the pipeline arms spend before their first
    token, outside their budget, too. Returns the seconds it took."""
    t0 = time.perf_counter()
    engine.generate(prompts, g, sampling)
    engine.load_weights(_save(model, weights_dir))
    return time.perf_counter() - t0


def _group(gid: str, prompt: list[int], answer: str, samples: list[Any], tok: Any, pcfg: ProducerConfig,
           version: int, score: Scorer) -> wire.ScoredGroup:
    g = pcfg.pipeline.group_size
    members = [wire.Completion(
        group_id=gid, index=k, group_size=g, prompt_id=gid, task=score.task,
        prompt_token_ids=np.asarray(prompt, np.int32), completion_token_ids=s.token_ids,
        behaviour_logprobs=s.logprobs, policy_version=version, producer_id="sync", finish_reason=s.finish_reason,
        logprob_temperature=pcfg.logprob_temperature()) for k, s in enumerate(samples)]
    rewards = [score(tok.decode(s.token_ids, skip_special_tokens=True), answer) for s in samples]
    mean, std = group_stats(rewards, pcfg.pipeline.stats_eps)
    return wire.ScoredGroup(group_id=gid, prompt_id=gid, task=score.task, policy_version=version,
                            completions=members, rewards=rewards, reward_mean=mean, reward_std=std,
                            verifier_id="sync", group_size=g)


def _save(model: torch.nn.Module, path: Path) -> Path:
    """``model.safetensors`` as the learner publishes it (tied head left out: the engine re-ties it)."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / ".model.safetensors.tmp"
    save_file({k: v.detach().contiguous() for k, v in unique_tensors(model).items()}, tmp,
              metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    return path


def _snapshot(model: torch.nn.Module, path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return _save(model, path)
