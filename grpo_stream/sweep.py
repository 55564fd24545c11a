"""``grpo-stream sweep SWEEP.yaml``: a grid of real runs (the paper's v/i arms, or any), seeds, one figure, one table.

Each arm x seed is a whole run of the base config through a broker of its own, every role its own process (the
demo's flow: the task's warm-started tiny model, held-out prompts), one after another (the machine has 2
cores), in ``<out_dir>/<arm>/seed<k>/``. A run directory with a ``summary.json`` is done: a restarted sweep
skips it (an unfinished one is run again from scratch). Every ``eval.every_s`` the newest published weights are
evaluated greedily and as Pass@1 over ``eval.pass_k`` samples at the sampling temperature; the report
(``grpo_stream.sweep_report``) then writes ``sweep.png`` and ``sweep.md`` beside the runs.

Arms: ``arms`` names them (``{v10-i1: {learner.publish_every: 10}}``: the paper's four can be listed as they
are), ``grid`` adds every combination of its values (named ``publish_every=10,grad_steps_per_batch=1``). The
budget of each run: ``budget.minutes`` (wall-clock, warm start and evaluations included) and optionally
``budget.max_steps`` or ``budget.max_samples`` (completions trained), whichever ends first.

Staleness under streaming: the paper's v pushes weights every v steps and trains fresh samples of the stale
weights in between, so its staleness is k mod v. The pipeline adds its own lag (producers run ahead of the
learner). ``lockstep: true`` is the paper-exact setting: producers at most one learner batch ahead, always on the
newest weights, groups older than v steps dropped. Every arm's measured staleness is in the table either way.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.config import ConfigError, load_config, opt, require


@dataclass
class SweepBudget:
    minutes: float = opt(3.0, "Wall-clock per arm x seed, warm start and evaluations included (the upper bound).")
    max_steps: int = opt(0, "Learner steps per arm x seed (0: no step limit).")
    max_samples: int = opt(0, "Completions trained per arm x seed (0: no limit); turned into learner steps.")

    def validate(self) -> None:
        require(self.minutes >= 1.0, "budget.minutes: must be >= 1 (start-up and evaluations need it)")
        require(self.max_steps >= 0 and self.max_samples >= 0, "budget.max_steps/max_samples: must be >= 0")


@dataclass
class SweepEval:
    every_s: float = opt(30.0, "Seconds between evaluations of the newest published weights.")
    pass_k: int = opt(8, "Samples per held-out prompt for Pass@1 (the paper uses 50); 0: greedy only.")

    def validate(self) -> None:
        require(self.every_s >= 5, "eval.every_s: must be >= 5")
        require(0 <= self.pass_k <= 64, "eval.pass_k: must be in [0, 64]")


@dataclass
class SweepConfig:
    base: str = opt("configs/demo.yaml", "The run config every arm starts from.")
    task: str = opt("last_digit", "The demo task family the runs learn and are evaluated on (held-out prompts).")
    overrides: list[str] = opt(factory=list, help="key=value overrides of the base config, for every arm.")
    lockstep: bool = opt(False, "The paper-exact staleness: producers at most one learner batch ahead, on the "
                         "newest weights (pipeline.max_staleness = the arm's publish_every).")
    arms: dict[str, dict[str, Any]] = opt(factory=dict, help="Named arms: name -> {dotted key: value}.")
    grid: dict[str, list[Any]] = opt(factory=dict, help="Dotted key -> values; every combination is one arm.")
    seeds: list[int] = opt(factory=lambda: [0, 1, 2], help="Seeds of every arm (model, data, sampling).")
    budget: SweepBudget = opt(factory=SweepBudget, help="Per arm x seed.")
    eval: SweepEval = opt(factory=SweepEval, help="Held-out evaluation during each run.")
    target: float = opt(0.9, "Held-out reward (greedy) for the steps / samples to target columns.")
    out_dir: str = opt("runs/sweep", "Where the runs, sweep.png and sweep.md go.")

    def validate(self) -> None:
        require(bool(self.arms or self.grid), "arms/grid: name at least one arm")
        require(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), "seeds: a non-empty list, no repeats")
        require(0 < self.target <= 1, "target: a held-out reward in (0, 1]")
        bad = [k for k, v in self.grid.items() if not v]
        require(not bad, f"grid: {bad} have no values")
        arm_names(self)


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def arm_names(cfg: SweepConfig) -> dict[str, dict[str, Any]]:
    """Every arm, named: the listed ones, then the grid's combinations (refuses a name used twice)."""
    arms = dict(cfg.arms)
    keys = list(cfg.grid)
    for values in itertools.product(*(cfg.grid[k] for k in keys)) if keys else ():
        name = ",".join(f"{_short(k)}={_text(v)}" for k, v in zip(keys, values, strict=True))
        if name in arms:
            raise ConfigError(f"arms: {name!r} is both a named arm and a grid combination")
        arms[name] = dict(zip(keys, values, strict=True))
    for name in arms:
        require(bool(name) and "/" not in name and not name.startswith("."), f"arms: {name!r} is not a directory name")
    return arms


def base_config(base: str) -> Path:
    """``base`` as a path, else the shipped config of that name (``configs/demo.yaml`` from an installed wheel)."""
    from grpo_stream.configs import shipped_config

    path = Path(base)
    if path.exists():
        return path
    shipped = shipped_config(base.removeprefix("configs/"))
    if not shipped.exists():
        raise ConfigError(f"base: {base} does not exist (neither as a path nor as a shipped config)")
    return shipped


def run_overrides(cfg: SweepConfig, arm: dict[str, Any]) -> list[str]:
    """The run's overrides: the sweep's, the arm's, the lockstep setting and the budget in steps."""
    from grpo_stream.run import RunConfig, role_configs

    items = [*cfg.overrides, *(f"{k}={_text(v)}" for k, v in arm.items())]
    run = load_config(RunConfig, base_config(cfg.base), items)
    role_configs(run, "127.0.0.1:9092")  # every role's config validated: a typo in an arm fails before any run
    batch, v = int(run.learner.get("groups_per_batch", 1)), int(run.learner.get("publish_every", 1))
    if cfg.lockstep:
        items += [f"producers.config.max_backlog_groups={batch}", "producers.config.max_version_lag=0",
                  f"pipeline.max_staleness={v}"]
    steps = [s for s in (cfg.budget.max_steps,
                         math.ceil(cfg.budget.max_samples / (batch * run.pipeline.group_size))) if s > 0]
    if steps:
        items.append(f"learner.max_steps={min(steps)}")
    return items


@dataclass
class Planned:
    arm: str
    seed: int
    out: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """The run's summary.json with its final evaluation (the run writes one before that: not done yet)."""
        path = self.out / "summary.json"
        return path.exists() and "final_eval_reward" in json.loads(path.read_text())


def plan(cfg: SweepConfig) -> list[Planned]:
    root = Path(cfg.out_dir)
    return [Planned(name, seed, root / name / f"seed{seed}", run_overrides(cfg, arm))
            for name, arm in arm_names(cfg).items() for seed in cfg.seeds]


def run_sweep(cfg: SweepConfig, emit: Any = print) -> list[Planned]:
    """Every planned run not done yet, one after another; then the report."""
    from grpo_stream import demo, sweep_report

    runs = plan(cfg)
    for i, r in enumerate(runs, 1):
        if r.done:
            emit(f"[sweep] {i}/{len(runs)} {r.arm} seed {r.seed}: done before, skipped")
            continue
        emit(f"[sweep] {i}/{len(runs)} {r.arm} seed {r.seed}: {' '.join(r.overrides) or '(base config)'}")
        summary = demo.run_demo(minutes=cfg.budget.minutes, seed=r.seed, out=str(r.out), task=cfg.task,
                                config=base_config(cfg.base), overrides=tuple(r.overrides), until=None,
                                pass_k=cfg.eval.pass_k, eval_every_s=cfg.eval.every_s)
        emit(f"[sweep] {r.arm} seed {r.seed}: held-out {summary['initial_eval_reward']:.3f} -> "
             f"{summary['final_eval_reward']:.3f} in {summary['learner_steps']} steps")
    sweep_report.write(cfg, runs)
    emit(f"[sweep] {Path(cfg.out_dir) / 'sweep.md'}, {Path(cfg.out_dir) / 'sweep.png'}")
    return runs


def main(config: str, overrides: list[str]) -> int:
    cfg = load_config(SweepConfig, config, overrides)
    runs = run_sweep(cfg)
    return 0 if all(r.done for r in runs) else 1
