"""``grpo-stream bench throughput``: learner steps/s of every arm side by side, with no learning needed.

The systems effect alone: how many learner steps (and completions, generated and trained tokens) a second each way
of running GRPO gets out of the same machine, model, G, prompts per step, lengths and optimizer. How many steps a
run needs to reach a reward is the algorithmic effect (``grpo-stream sweep``); ``bench predict`` combines the two.

Scenarios: a model preset (``--preset tiny | 50m | qwen2.5-0.5b``: random weights, Qwen2.5-0.5B's real shape for
the last) with drawn, long-tailed completion lengths (``sampling.lengths``: lognormal, median 64, p99 8x the
median by default; EOS ignored), so the numbers do not depend on what a model learned; or ``--demo``, the demo's
own task, warm-started tiny model and ``configs/demo.yaml``.

Arms (:data:`ARMS`; the demo scenario: :data:`DEMO_ARMS`):

* ``S``: the synchronous loop in one process, no Kafka (``async_sync``): generate with the same engine, score,
  one learner step, reload the weights; generation on CPU 0, learning on CPU 1 (one idles while the other works).
* ``S-hybrid``: the same loop with both CPUs for both phases.
* ``P v{1,4} {between,inflight}``: the real pipeline (broker, feeder, producer, verifier, learner as processes
  under the run supervisor), producer pinned to CPU 0 and learner to CPU 1. ``P demo``: the demo's pipeline as
  ``grpo-stream demo`` runs it (two HF producers, v = 4, unpinned).
* ``TRL``: TRL's ``GRPOTrainer`` from PyPI on both CPUs (``trl_arm``; what cannot be matched is said there).

Each arm runs ``warmup + steps`` learner steps (or until ``--budget`` seconds); steps/s is measured between the end
of step ``warmup`` and the last, so start-up (vLLM's, the broker's, the pipeline filling) counts in none. The
report (``throughput_report``): each arm's median and spread over ``--repeats``, its ratio to S, S-hybrid and TRL,
the ideal ratio from S's own phase times ((gen + train) / max(gen, train)), busy fractions and CPUs by role.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from grpo_core.config import load_config
from grpo_producers.backends.lengths import LengthsConfig
from grpo_stream.bench import cpu_use
from grpo_stream.bench.async_bench import producer_metrics
from grpo_stream.configs import shipped_config

CACHE = Path(".cache") / "bench-models"
GEN_CPU, TRAIN_CPU = 0, 1
PINNED = {GEN_CPU, TRAIN_CPU}
PRODUCER_COUNTERS = ("tokens_total", "completions_total", "engine_busy_seconds_total", "batch_seconds_sum")


@dataclass(frozen=True)
class Scenario:
    """What every arm of one run shares."""

    name: str
    preset: str
    task: str
    reward: str  # the task name the verifier scores the prompts as (its rewards config decides how; TRL's too)
    lengths: LengthsConfig
    group_size: int
    prompts_per_step: int
    max_tokens: int
    lr: float
    dual_clip: float | None
    config: str  # the shipped run config the pipeline arms start from
    batch_backend: str = "vllm"  # the engine of the arms that generate in batches (in-flight arms need vllm)

    @property
    def demo(self) -> bool:
        return self.name == "demo"


def preset_scenario(preset: str, lengths: LengthsConfig, group_size: int = 8, prompts: int = 4,
                    max_tokens: int = 512, lr: float = 1e-5) -> Scenario:
    return Scenario(f"preset {preset}", preset, "copy", "positions", lengths, group_size, prompts, max_tokens, lr,
                    None, "bench-throughput.yaml")


# The demo's task and settings, as configs/demo.yaml runs them (the TRL arm is matched to them).
DEMO = Scenario("demo", "tiny", "last_digit", "exact", LengthsConfig(), 16, 16, 1, 2e-3, 3.0, "demo.yaml")


@dataclass(frozen=True)
class Arm:
    name: str
    kind: Literal["sync", "pipeline", "trl"]
    v: int = 1
    swap: str = "between_batches"
    hybrid: bool = False  # sync: both CPUs for both phases
    as_configured: bool = False  # pipeline: the scenario's config unchanged (no v, swap or CPUs set)

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")


ARMS = [Arm("S", "sync"), Arm("S-hybrid", "sync", hybrid=True),
        Arm("P v1 between", "pipeline", 1, "between_batches"), Arm("P v1 inflight", "pipeline", 1, "inflight"),
        Arm("P v4 between", "pipeline", 4, "between_batches"), Arm("P v4 inflight", "pipeline", 4, "inflight"),
        Arm("TRL", "trl")]
DEMO_ARMS = [Arm("S", "sync"), Arm("S-hybrid", "sync", hybrid=True), Arm("P demo", "pipeline", as_configured=True),
             Arm("TRL", "trl")]


def pick_arms(demo: bool, names: str | None) -> list[Arm]:
    known = DEMO_ARMS if demo else ARMS
    if not names:
        return known
    by_key = {k.lower(): arm for arm in known for k in (arm.name, arm.slug)}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n.lower() not in by_key]
    if unknown:
        raise SystemExit(f"bench throughput --arms: unknown arm(s) {unknown}; known: {[a.slug for a in known]}")
    return [by_key[n.lower()] for n in wanted]


def prepare_model(sc: Scenario) -> Path:
    """The scenario's model: the demo's warm start, or a preset with random weights (cached)."""
    if sc.demo:
        from grpo_stream.demo import prepare_model as demo_model

        return demo_model(0, sc.task)
    from grpo_stream.tiny_model import build_tiny_model

    return build_tiny_model(CACHE / f"throughput-{sc.preset}", preset=sc.preset)


def overlong_term(lengths: LengthsConfig) -> str:
    """The preset scenarios' reward (a YAML flow mapping): DAPO's overlong term, 1 up to half the median length
    and 0 from twice the median, in characters (about one per token of the tiny tokenizer's random text). A random
    model's completions then differ in reward within every group, so every step trains every token, as a
    learning run does; with the copy task's own reward every group of a random model scores 0, eq. 8 masks it,
    and steps without a backward pass made the arms' step times incomparable."""
    top = 2 * lengths.median
    return f"{{name: overlong, params: {{max_chars: {top}, buffer_chars: {top - max(1, lengths.median // 2)}}}}}"


def run_config(plan: Plan, model: Path, arm: Arm, out: Path, run: str, bootstrap: str | None = None) -> Any:
    """The run config of one arm (the S arms read their producer and learner sections from it too), named
    ``run`` (its topics' prefix: a name per arm and repeat, as they share one broker)."""
    from grpo_stream.run import RunConfig

    sc, weights = plan.scenario, out / "weights"
    o = [f"name={run}", f"out_dir={out}", f"max_minutes={(plan.budget_s + 180) / 60:.2f}",
         f"learner.model.path={model}", f"learner.weights.fs.root={weights}", f"producers.config.backend.model={model}",
         f"producers.config.weights.fs.root={weights}", f"feeder.synthetic.tasks=[{sc.task}]"]
    if not sc.demo:
        p, lengths = sc.prompts_per_step, sc.lengths
        o += [f"pipeline.group_size={sc.group_size}", f"pipeline.max_new_tokens={sc.max_tokens}",
              f"producers.config.prompts_per_batch={p}", f"producers.config.max_inflight_groups={p}",
              f"producers.config.max_backlog_groups={2 * p}", f"learner.groups_per_batch={p}",
              f"learner.optim.lr={sc.lr}", f"producers.config.sampling.lengths.dist={lengths.dist}",
              f"producers.config.sampling.lengths.median={lengths.median}",
              f"producers.config.sampling.lengths.p99_ratio={lengths.p99_ratio}",
              f"verifiers.config.rewards.by_task={{{sc.reward}: [{overlong_term(lengths)}]}}"]
        if arm.swap != "inflight":  # S and the between-batch arms
            o += [f"producers.config.backend.kind={sc.batch_backend}", "producers.config.weights.swap=between_batches"]
    if bootstrap:
        o.append(f"kafka.bootstrap={bootstrap}")
    if arm.kind == "pipeline" and not arm.as_configured:
        o += [f"learner.publish_every={arm.v}", f"producers.config.weights.swap={arm.swap}",
              f"cpus.producer=[{GEN_CPU}]", f"cpus.learner=[{TRAIN_CPU}]"]
    return load_config(RunConfig, shipped_config(sc.config), o)


# ------------------------------------------------------------------------------------------------ the arms


@dataclass
class Mark:
    """One moment of a pipeline arm: the clock, the CPUs by role, the producers' counters (summed)."""

    at: float
    cpu: cpu_use.Reading
    counters: dict[str, float]


def producer_ports(run_dir: Path) -> list[int]:
    """Each producer's metrics port, from the line its log starts with (port 0: the OS picked one)."""
    ports = []
    for log in sorted((run_dir / "logs").glob("producer-*.log")):
        found = re.findall(r"metrics on http://[^:]+:(\d+)/metrics", log.read_text(errors="replace"))
        if found:
            ports.append(int(found[-1]))
    return ports


def scrape(ports: list[int]) -> dict[str, float]:
    """The producers' counters of :data:`PRODUCER_COUNTERS`, summed (a producer that does not answer: left out)."""
    total = dict.fromkeys(PRODUCER_COUNTERS, 0.0)
    for port in ports:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            continue
        found = producer_metrics(text)
        for name in PRODUCER_COUNTERS:
            total[name] += found.get(f"grpo_stream_producer_{name}", 0.0)
    return total


class StepWatch:
    """The supervisor's tick for a pipeline arm: a :class:`Mark` when the learner has done ``warmup`` steps and
    one when it has done ``total`` (then the run is stopped), or when ``budget_s`` has passed."""

    def __init__(self, run_dir: Path, warmup: int, total: int, budget_s: float) -> None:
        self.run_dir, self.warmup, self.total = run_dir, warmup, total
        self.deadline = time.monotonic() + budget_s
        self.marks: list[Mark] = []
        self._ports: list[int] = []

    def _mark(self) -> None:
        if not self._ports:
            self._ports = producer_ports(self.run_dir)
        self.marks.append(Mark(time.time(), cpu_use.read(cpu_use.role_pids(self.run_dir)), scrape(self._ports)))

    def __call__(self) -> bool:
        from grpo_stream.run import read_metrics

        steps = len(read_metrics(self.run_dir / "metrics.jsonl"))
        if not self.marks and steps >= self.warmup:
            self._mark()
        if steps >= self.total or time.monotonic() > self.deadline:
            if self.marks:
                self._mark()
            return True
        return False


def window_rate(ends: list[float], warmup: int) -> tuple[float, int, float]:
    """(steps/s, steps measured, seconds) from the end of step ``warmup`` (>= 1) to the end of the last step;
    ``ends``: each step's end, in order."""
    if warmup < 1 or len(ends) <= warmup:
        return 0.0, 0, 0.0
    n, dt = len(ends) - warmup, ends[-1] - ends[warmup - 1]
    return (n / dt if dt > 0 else 0.0), n, dt


def learner_figures(window: list[dict[str, Any]], dt: float) -> dict[str, float]:
    """Trained tokens/s, the learner's busy share and the mean staleness of the steps in ``window`` (its
    metrics.jsonl lines), over the window's ``dt`` seconds."""
    busy = sum(v for m in window for k, v in m.get("timings", {}).items() if k != "wait")
    stale = [s for m in window for s in m.get("staleness", [])]
    return {"trained_tokens_per_s": sum(m["tokens"] for m in window) / dt if dt else 0.0,
            "learner_busy": min(1.0, busy / dt) if dt else 0.0,
            "staleness": statistics.fmean(stale) if stale else 0.0}


def run_pipeline(plan: Plan, model: Path, arm: Arm, out: Path, run: str, bootstrap: str) -> dict[str, Any]:
    from grpo_stream.run import execute, read_metrics

    cfg = run_config(plan, model, arm, out, run, bootstrap)
    warmup, steps = plan.warmup, plan.steps
    watch = StepWatch(out, warmup, warmup + steps, plan.budget_s)
    execute(cfg, tty=False, on_tick=watch, tick_s=0.1)
    metrics = sorted(read_metrics(out / "metrics.jsonl"), key=lambda m: m["step"])[:warmup + steps]
    rate, n, dt = window_rate([m["time"] for m in metrics], warmup)
    res: dict[str, Any] = {"steps_per_s": rate, "steps_measured": n, "seconds": dt,
                           **learner_figures(metrics[warmup:], dt)}
    if len(watch.marks) == 2:
        a, b = watch.marks
        span = max(b.at - a.at, 1e-9)
        delta = {k: b.counters[k] - a.counters[k] for k in PRODUCER_COUNTERS}
        engines = max(1, cfg.producers.count)
        gen = delta["engine_busy_seconds_total" if arm.swap == "inflight" and not arm.as_configured
                    else "batch_seconds_sum"]
        res |= {"generated_tokens_per_s": delta["tokens_total"] / span,
                "generated_completions_per_s": delta["completions_total"] / span,
                "engine_busy": min(1.0, gen / span / engines),
                "cpu_by_role": cpu_use.cpus_by_role(a.cpu, b.cpu),
                "cpu_steal": cpu_use.stolen(a.cpu.machine, b.cpu.machine)}
    return res


def run_sync_arm(plan: Plan, model: Path, arm: Arm, out: Path, run: str, bootstrap: str) -> dict[str, Any]:
    from grpo_stream.bench.async_sync import run_sync
    from grpo_stream.run import role_configs

    cfg = run_config(plan, model, arm, out, run)
    cpus = (PINNED, PINNED) if arm.hybrid else ({GEN_CPU}, {TRAIN_CPU})
    res = run_sync(role_configs(cfg, "unused:9092"), [plan.scenario.task], plan.budget_s, out, *cpus, snapshots=0,
                   max_steps=plan.warmup + plan.steps)
    rate, n, dt = window_rate(res.step_ends, plan.warmup)
    per_step = max(res.steps, 1)
    return {"steps_per_s": rate, "steps_measured": n, "seconds": dt,
            "gen_s_per_step": res.gen_s / per_step, "train_s_per_step": res.train_s / per_step,
            "generated_tokens_per_s": res.tokens / res.wall_s,
            "generated_completions_per_s": res.completions / res.wall_s,
            "trained_tokens_per_s": res.trained_tokens / res.wall_s,
            "engine_busy": res.gen_s / res.wall_s, "learner_busy": res.train_s / res.wall_s, "staleness": 0.0,
            "cpu_by_role": res.cpu_by_role, "cpu_steal": res.cpu_steal}


def run_trl(plan: Plan, model: Path, arm: Arm, out: Path, run: str, bootstrap: str) -> dict[str, Any]:
    from grpo_stream.bench.trl_arm import TrlSpec, run_trl_arm
    from grpo_stream.demo_model import task_items

    sc, warmup, steps, budget_s = plan.scenario, plan.warmup, plan.steps, plan.budget_s
    prompts, answers = task_items(sc.task, "train")
    rewards = run_config(plan, model, arm, out, run).verifiers.config.get("rewards", {})
    spec = TrlSpec(model=str(model), prompts=prompts, answers=answers, task=sc.reward, rewards=rewards,
                   group_size=sc.group_size,
                   prompts_per_step=sc.prompts_per_step, steps=warmup + steps, lr=sc.lr, max_tokens=sc.max_tokens,
                   lengths=asdict(sc.lengths), dual_clip=sc.dual_clip, threads=len(PINNED), budget_s=budget_s,
                   out_dir=str(out / "trl"))
    before = cpu_use.read_ticks()
    res, _ = run_trl_arm(spec, out, cpus=PINNED)
    ends = [t - res.start for t in res.step_ends]
    rate, n, dt = window_rate(ends, warmup)
    window_tokens = sum(res.completion_tokens[warmup:len(ends)]) * sc.prompts_per_step * sc.group_size
    gen = sum(res.gen_s[warmup:len(ends)])
    return {"steps_per_s": rate, "steps_measured": n, "seconds": dt, "trl_version": res.trl_version,
            "generated_tokens_per_s": window_tokens / dt if dt else 0.0,
            "generated_completions_per_s": rate * sc.prompts_per_step * sc.group_size,
            "trained_tokens_per_s": window_tokens / dt if dt else 0.0,
            "engine_busy": gen / dt if dt else 0.0, "learner_busy": 1.0 - gen / dt if dt else 0.0,
            "staleness": 0.0, "cpu_steal": cpu_use.stolen(before, cpu_use.read_ticks())}


RUNNERS = {"sync": run_sync_arm, "pipeline": run_pipeline, "trl": run_trl}


@dataclass
class Plan:
    scenario: Scenario
    arms: list[Arm]
    repeats: int = 3
    warmup: int = 2
    steps: int = 6
    budget_s: float = 900.0
    out: Path = field(default_factory=lambda: Path("runs/bench-throughput"))


def run_plan(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """Every arm ``repeats`` times, interleaved (repeat 1 of every arm, then repeat 2, ...). The pipeline arms
    share one broker (each under a run name of its own), so its start and stop count in none of them."""
    from grpo_stream.bench import temporary_broker

    model = prepare_model(plan.scenario)
    results: dict[str, list[dict[str, Any]]] = {}
    partial = plan.out / "arms.json"
    with temporary_broker(None) as bootstrap:
        for rep in range(plan.repeats):
            for arm in plan.arms:
                results.setdefault(arm.name, []).append(_run_arm(plan, model, arm, rep, bootstrap))
                # an hour-long run that dies near its end keeps every arm it finished
                partial.write_text(json.dumps(results, indent=1))
    return results


def _run_arm(plan: Plan, model: Path, arm: Arm, rep: int, bootstrap: str) -> dict[str, Any]:
    out = plan.out / f"r{rep}" / arm.slug
    print(f"[bench throughput] repeat {rep + 1}/{plan.repeats}: {arm.name}, {plan.warmup}+{plan.steps} steps",
          flush=True)
    t0 = time.monotonic()
    res = RUNNERS[arm.kind](plan, model, arm, out, f"tp-r{rep}-{arm.slug}", bootstrap)
    res["arm_seconds"] = time.monotonic() - t0
    print(f"[bench throughput]   {res['steps_per_s']:.3f} steps/s over {res['steps_measured']} steps "
          f"({res['arm_seconds']:.0f} s)", flush=True)
    return res


SHORT = LengthsConfig(dist="lognormal", median=8, p99_ratio=4.0)


def main(preset: str = "50m", demo: bool = False, dist: str = "lognormal", median: int = 64,
         p99_ratio: float = 8.0, group_size: int = 8, prompts: int = 2, max_tokens: int = 512, repeats: int = 3,
         warmup: int | None = None, steps: int | None = None, budget_s: float = 900.0, arms: str | None = None,
         short: bool = False, out: str = "runs/bench-throughput") -> int:
    from grpo_stream.bench.throughput_report import report

    lengths = LengthsConfig(dist=dist, median=median, p99_ratio=p99_ratio)  # type: ignore[arg-type]
    lengths.validate()
    # a 50m step takes seconds on a CPU, a demo step a fraction of one: the defaults give each a window of a minute
    warmup = warmup if warmup is not None else (20 if demo else 1)
    steps = steps if steps is not None else (150 if demo else 4)
    if warmup < 1:
        raise SystemExit("bench throughput --warmup: at least 1 (the measured window starts at a step's end)")
    if short:  # every arm for a few steps of the tiny preset: the suite's smoke run
        sc = replace(preset_scenario("tiny", SHORT, 4, 4, 48, 1e-5), batch_backend="hf")
        repeats, warmup, steps = 1, 1, 3
    elif demo:
        sc = DEMO
    else:
        sc = preset_scenario(preset, lengths, group_size, prompts, max_tokens)
    plan = Plan(sc, pick_arms(sc.demo, arms), repeats, warmup, steps, budget_s, Path(out))
    shutil.rmtree(plan.out, ignore_errors=True)
    results = run_plan(plan)
    report(plan, results)
    return 0
