"""``grpo-stream bench async``: the pipeline against the synchronous loop it replaces, one machine, one run.

Arms (``configs/bench-async.yaml`` for all of them; :data:`ARMS`):

* ``S``: the synchronous on-policy loop in one process, no Kafka (:mod:`grpo_stream.bench.async_sync`);
  generation on CPU 0, learning on CPU 1 -- the disaggregated setting of the paper (one serving GPU beside the
  training GPUs), where one device idles while the other works.
* ``S-hybrid``: the same loop with both CPUs for both phases (the "hybrid engine" setting).
* ``S-lag2`` (only when named in ``--arms``): S's loop training each step on the batch generated two versions
  earlier -- the pipeline's staleness without the pipeline, to tell what staleness alone does to learning per step.
* ``P v{1,4} {between,inflight}``: the real pipeline (broker, feeder, producer, verifier, learner as processes
  under the run supervisor), producer pinned to CPU 0 and learner to CPU 1, v = publish_every, weights swapped
  between batches or in flight.

Every arm runs for the same budget, counted from its first generated token (S: after one untimed warm-up batch,
as the first generation compiles kernels; P: the producer's first completion), so start-up costs (vLLM ~20 s on
CPU, the first batch's compilation ~25 s on a fresh machine) are left out of every arm alike. Weight versions are
saved with their wall-clock second and learner step and evaluated afterwards (greedy, held-out prompts of the task,
``copy_short`` by default, mean ``positions`` reward), so evaluation never competes with an arm for the CPUs. An
arm reaches the target at the first evaluated version from which two evaluations in a row are at or above it.
Printed per arm: time-to-target and its ratio to S, learner steps to the target, reward gain per second, generated
tokens/s, engine and learner busy fractions, mean staleness, the largest share of a CPU's time the host took
(steal) and the learner's share of its step time on a CPU (a repeat held up by either is named); the ideal
ratio max(gen, train) / (gen + train) from S's own phase times; and each pipeline arm's ratio at targets around
the chosen one, and the share of each pipeline arm's clock its producer left room in the engine unfilled, held
back by backpressure or with no prompt to take (the report: :mod:`.async_report`).
Written: ``async.json`` and ``async.png`` (held-out reward vs wall-clock, one line per arm).
"""

from __future__ import annotations

import re
import shutil
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import load_config
from grpo_stream.bench import cpu_use
from grpo_stream.bench.async_report import dynamics, report
from grpo_stream.configs import shipped_config

CACHE = Path(".cache") / "bench-models"
# The default task: copy 1-4 digits, which the tiny model learns within the budget (on `copy`, 1-8 digits, it
# barely moves, so no arm reaches a target there). Its answers are 2-5 tokens with EOS: a 2.5x spread, short of the
# 4x long tail that in-flight swaps pay off on; `bench engine` measures that effect on `copy` 1-8 instead.
TASK = "copy_short"
# Evaluated versions per arm, evenly spaced in time: the task rises within 15-30 s of a 75 s budget, so 12 points
# (~7 s apart) read time-to-target to about half of itself; 60 read it to ~1.3 s, at ~0.15 s per evaluation.
EVAL_POINTS = 60
GEN_CPU, TRAIN_CPU = 0, 1  # generation's and learning's CPU in every arm (S-hybrid: both for both)
PINNED = {GEN_CPU, TRAIN_CPU}
# The producer's seconds held back by backpressure, per reason: what keeps an in-flight engine idle on purpose
# (reported beside its seconds with room and no prompt to take, "no_prompts").
HELD = "grpo_stream_producer_paused_seconds_total"


@dataclass(frozen=True)
class Arm:
    name: str
    pipeline: bool
    v: int = 1
    swap: str = "inflight"
    hybrid: bool = False
    lag: int = 0  # S only: train on the batch generated this many versions earlier (async_sync.run_sync)

    @property
    def slug(self) -> str:
        """The arm's name as a path and run-name part: ``P v1 inflight`` -> ``P-v1-inflight``."""
        return re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")


ARMS = [Arm("S", False), Arm("S-hybrid", False, hybrid=True),
        Arm("P v1 between", True, 1, "between_batches"), Arm("P v1 inflight", True, 1, "inflight"),
        Arm("P v4 between", True, 4, "between_batches"), Arm("P v4 inflight", True, 4, "inflight")]
SHORT_ARMS = [ARMS[0], ARMS[3]]
# Run only when named (--arms): S's loop with the pipeline's staleness (P v1's is ~2) and none of its machinery.
EXTRA_ARMS = [Arm("S-lag2", False, lag=2)]


def prepare_model(task: str = TASK) -> Path:
    """The tiny model warm-started on the format of ``task``, a multi-token family (cached per task)."""
    from grpo_stream.demo_model import warm_start
    from grpo_stream.tiny_model import build_tiny_model

    base = build_tiny_model(CACHE / "async-base", seed=0)
    return warm_start(base, task, steps=300, out_dir=CACHE / f"async-warm-{task}", answers="shuffled")


def base_config(model: Path, out: Path, arm: Arm, budget_s: float, task: str = TASK) -> Any:
    from grpo_stream.run import RunConfig

    weights = out / "weights"
    overrides = [f"name=bench-{arm.slug}", f"out_dir={out}",
                 f"max_minutes={(budget_s + 120) / 60:.2f}", f"learner.model.path={model}",
                 f"learner.weights.fs.root={weights}", f"learner.publish_every={arm.v}",
                 f"producers.config.backend.model={model}", f"producers.config.weights.fs.root={weights}",
                 f"producers.config.weights.swap={arm.swap}",
                 f"cpus.producer=[{GEN_CPU}]", f"cpus.learner=[{TRAIN_CPU}]",
                 f"feeder.synthetic.tasks=[{task}]"]
    return load_config(RunConfig, shipped_config("bench-async.yaml"), overrides)


# ------------------------------------------------------------------------------------------ the arms


def run_sync_arm(model: Path, arm: Arm, budget_s: float, out: Path, task: str) -> dict[str, Any]:
    from grpo_stream.bench.async_sync import run_sync
    from grpo_stream.run import role_configs

    cfg = base_config(model, out, arm, budget_s, task)
    cpus = (PINNED, PINNED) if arm.hybrid else ({GEN_CPU}, {TRAIN_CPU})
    res = run_sync(role_configs(cfg, "unused:9092"), [task], budget_s, out, *cpus, lag=arm.lag)
    return {"wall_s": res.wall_s, "gen_s": res.gen_s, "train_s": res.train_s, "steps": res.steps,
            "tokens": res.tokens, "engine_busy": res.gen_s / res.wall_s, "learner_busy": res.train_s / res.wall_s,
            "mean_staleness": float(arm.lag), "warmup_s": res.warmup_s, "dynamics": dynamics(res.step_metrics),
            "cpu_steal": res.cpu_steal, "cpu_by_role": res.cpu_by_role,
            "points": [(t, step, str(p)) for t, step, p in res.snapshots]}


def producer_metrics(text: str) -> dict[str, float]:
    """The producer's unlabelled metrics from a Prometheus scrape, and its seconds held back as ``HELD:reason``."""
    found = {k: float(v) for k, v in re.findall(r"^(grpo_stream_producer_\w+) ([0-9.e+-]+)$", text, re.M)}
    found.update({f"{HELD}:{why}": float(v)
                  for why, v in re.findall(rf'^{HELD}\{{reason="(\w+)"\}} ([0-9.e+-]+)$', text, re.M)})
    return found


class _Watch:
    """The supervisor's tick for a pipeline arm: scrape the producer, stop ``budget_s`` after its first token."""

    def __init__(self, port: int, budget_s: float, run_dir: Path) -> None:
        self.url, self.budget_s, self.run_dir = f"http://127.0.0.1:{port}/metrics", budget_s, run_dir
        self.t0: float | None = None
        self.last: dict[str, float] = {}
        self.at_t0: dict[str, float] = {}  # counters when the budget started: only what follows counts
        self._at = 0.0
        self.cpu: list[cpu_use.Reading] = []  # the machine's and each role's CPU ticks at the budget's start, end

    def __call__(self) -> bool:
        if time.monotonic() - self._at >= 1.0 or self.t0 is not None and self._over():
            self._at = time.monotonic()
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                return False
            self.last = producer_metrics(text)
            if self.t0 is None and self.last.get("grpo_stream_producer_tokens_total", 0) > 0:
                self.t0, self.at_t0 = time.time(), dict(self.last)
                self.cpu = [cpu_use.read(cpu_use.role_pids(self.run_dir))]
        if self.t0 is not None and self._over():
            if len(self.cpu) == 1:
                self.cpu.append(cpu_use.read(cpu_use.role_pids(self.run_dir)))
            return True
        return False

    def _over(self) -> bool:
        return self.t0 is not None and time.time() - self.t0 >= self.budget_s


def run_pipeline_arm(model: Path, arm: Arm, budget_s: float, out: Path, task: str) -> dict[str, Any]:
    from grpo_core.jsonl import read_lines
    from grpo_stream.broker import free_port
    from grpo_stream.run import execute, read_metrics

    cfg = base_config(model, out, arm, budget_s, task)
    port = free_port()
    cfg.producers.config.setdefault("metrics", {})["port"] = port
    watch = _Watch(port, budget_s, out)
    execute(cfg, tty=False, on_tick=watch)
    t0 = watch.t0 or time.time()
    wall = max(1e-9, min(budget_s, time.time() - t0))
    versions = sorted((p.stat().st_mtime - t0, int(p.parent.name[1:]), p.parent)
                      for p in (out / "weights").glob("*/v*/model.safetensors"))
    # Only the steps inside the budget count: the learner goes on for a moment while the supervisor stops the run.
    inside = [m for m in read_metrics(out / "metrics.jsonl") if t0 <= m["time"] <= t0 + wall]
    busy = sum(v for m in inside for k, v in m.get("timings", {}).items() if k != "wait")
    trained = [e["staleness"] for line in read_lines(out / "lineage.jsonl") for e in line["trained"]]

    def since_t0(name: str) -> float:
        key = f"grpo_stream_producer_{name}"
        return watch.last.get(key, 0.0) - watch.at_t0.get(key, 0.0)

    gen = since_t0("engine_busy_seconds_total" if arm.swap == "inflight" else "batch_seconds_sum")
    return {"wall_s": wall, "steps": max((m["step"] for m in inside), default=0), "tokens": since_t0("tokens_total"),
            "engine_busy": min(1.0, gen / wall), "learner_busy": min(1.0, busy / wall),
            "mean_staleness": statistics.fmean(trained) if trained else 0.0,
            "aborted_stale": since_t0("aborted_stale_total"),
            "held_back": held_back(watch.last, watch.at_t0, wall, starved_counted=arm.swap == "inflight"),
            **_cpu_use(watch),
            "dynamics": dynamics(sorted(inside, key=lambda m: m["step"])),
            "points": [(max(0.0, t), step, str(d)) for t, step, d in versions if t <= wall]}


def held_back(last: dict[str, float], at_t0: dict[str, float], wall: float, starved_counted: bool
              ) -> dict[str, float]:
    """The share of the clock ``wall`` the producer was held back, per reason, from its counters at the clock's
    start and end; with ``starved_counted``, also its share with room and no prompt to take ("no_prompts"). Only
    the continuous loop counts that (``starved_seconds_total``): for a batch loop the key is left out rather than
    reported as a zero nobody measured."""
    def share(key: str) -> float:
        return round(min(1.0, (last.get(key, 0.0) - at_t0.get(key, 0.0)) / wall), 4)

    out = {k.split(":", 1)[1]: share(k) for k in last if k.startswith(HELD + ":")}
    if starved_counted:
        out["no_prompts"] = share("grpo_stream_producer_starved_seconds_total")
    return out


def _cpu_use(watch: _Watch) -> dict[str, Any]:
    """The arm's steal and CPUs by role over its budget. A run that ended before its budget did has no roles left
    to read: its steal is counted up to now, and no CPUs by role are reported."""
    if not watch.cpu:
        return {"cpu_steal": None, "cpu_by_role": {}}
    start, end = watch.cpu[0], watch.cpu[-1] if len(watch.cpu) == 2 else None
    return {"cpu_steal": cpu_use.stolen(start.machine, end.machine if end else cpu_use.read_ticks(), PINNED),
            "cpu_by_role": cpu_use.cpus_by_role(start, end) if end else {}}


# ------------------------------------------------------------------------------------------ evaluation


def evaluate_points(model: Path, points: list[tuple[float, int, str]], prompts: list[str],
                    answers: list[str]) -> list[tuple[float, float, int]]:
    """(second, held-out reward, learner step) of up to :data:`EVAL_POINTS` versions spread over the arm's time
    (the first and the last among them), from their ``model.safetensors`` on top of ``model``'s architecture."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_stream.demo_model import evaluate

    if not points:
        return []
    pick = sorted({round(i * (len(points) - 1) / (EVAL_POINTS - 1)) for i in range(EVAL_POINTS)})
    tok, out = AutoTokenizer.from_pretrained(model), []
    for i in pick:
        t, step, path = points[i]
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        net.load_state_dict(load_file(Path(path) / "model.safetensors"), strict=False)
        net.tie_weights()
        out.append((t, evaluate(net, prompts, answers, max_tokens=12, tokenizer=tok, reward="positions"), step))
    return out


def pick_arms(short: bool, names: str | None) -> list[Arm]:
    """The arms to run: ``--short``'s two, or those named (names or slugs, comma-separated), or all."""
    if not names:
        return SHORT_ARMS if short else ARMS
    by_key = {k.lower(): arm for arm in ARMS + EXTRA_ARMS for k in (arm.name, arm.slug)}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n.lower() not in by_key]
    if unknown:
        raise SystemExit(f"bench async --arms: unknown arm(s) {unknown}; "
                         f"known: {[a.slug for a in ARMS + EXTRA_ARMS]}")
    return [by_key[n.lower()] for n in wanted]


def main(budget_s: float = 90.0, repeats: int = 1, target: float = 0.6, short: bool = False,
         out: str = "runs/bench-async", arms: str | None = None, task: str = TASK) -> int:
    from grpo_producers.datasets import SYNTHETIC_REWARDS
    from grpo_stream.demo_model import multi_token, task_items

    if not multi_token(task):  # refused before the last run's results are cleared
        raise SystemExit(f"bench async --task {task}: pick a multi-token family (scored by positions): "
                         f"{sorted(f for f, r in SYNTHETIC_REWARDS.items() if r == 'positions')}")
    chosen = pick_arms(short, arms)
    root = Path(out)
    shutil.rmtree(root, ignore_errors=True)
    model = prepare_model(task)
    prompts, answers = task_items(task, "eval")
    results: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        for arm in chosen:
            arm_out = root / f"r{rep}" / arm.slug
            print(f"[bench async] repeat {rep + 1}/{repeats}: {arm.name} for {budget_s:.0f}s", flush=True)
            result = (run_pipeline_arm if arm.pipeline else run_sync_arm)(model, arm, budget_s, arm_out, task)
            result["curve"] = evaluate_points(model, result.pop("points"), prompts, answers)
            results.setdefault(arm.name, []).append(result)
    report(results, target, root)
    print(f"[bench async] wrote {root / 'async.json'} and {root / 'async.png'}")
    return 0
