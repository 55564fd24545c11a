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
tokens/s, engine and learner busy fractions, mean staleness; the ideal ratio max(gen, train) / (gen + train) from
S's own phase times; and each pipeline arm's ratio at targets around the chosen one.
Written: ``async.json`` and ``async.png`` (held-out reward vs wall-clock, one line per arm).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import load_config
from grpo_stream.configs import shipped_config

CACHE = Path(".cache") / "bench-models"
# The default task: copy 1-4 digits, which the tiny model learns within the budget (on `copy`, 1-8 digits, it
# barely moves, so no arm reaches a target there). Its answers are 2-5 tokens with EOS: a 2.5x spread, short of the
# 4x long tail that in-flight swaps pay off on; `bench engine` measures that effect on `copy` 1-8 instead.
TASK = "copy_short"
# Evaluated versions per arm, evenly spaced in time: the task rises within 15-30 s of a 75 s budget, so 12 points
# (~7 s apart) read time-to-target to about half of itself; 60 read it to ~1.3 s, at ~0.15 s per evaluation.
EVAL_POINTS = 60
# The learner metrics averaged per arm (`dynamics`), over its first EARLY_STEPS steps and over all: the pipeline
# arms gained more held-out reward per learner step than S; these say what differed in the batches and the policy.
DYNAMICS = ("entropy", "zero_variance_fraction", "clip_frac_low", "clip_frac_high", "reward_mean")
EARLY_STEPS = 30


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
                 f"producers.config.weights.swap={arm.swap}", "cpus.producer=[0]", "cpus.learner=[1]",
                 f"feeder.synthetic.tasks=[{task}]"]
    return load_config(RunConfig, shipped_config("bench-async.yaml"), overrides)


# ------------------------------------------------------------------------------------------ the arms


def run_sync_arm(model: Path, arm: Arm, budget_s: float, out: Path, task: str) -> dict[str, Any]:
    from grpo_stream.bench.async_sync import run_sync
    from grpo_stream.run import role_configs

    cfg = base_config(model, out, arm, budget_s, task)
    cpus = ({0, 1}, {0, 1}) if arm.hybrid else ({0}, {1})
    res = run_sync(role_configs(cfg, "unused:9092"), [task], budget_s, out, *cpus, lag=arm.lag)
    return {"wall_s": res.wall_s, "gen_s": res.gen_s, "train_s": res.train_s, "steps": res.steps,
            "tokens": res.tokens, "engine_busy": res.gen_s / res.wall_s, "learner_busy": res.train_s / res.wall_s,
            "mean_staleness": float(arm.lag), "warmup_s": res.warmup_s, "dynamics": dynamics(res.step_metrics),
            "points": [(t, step, str(p)) for t, step, p in res.snapshots]}


class _Watch:
    """The supervisor's tick for a pipeline arm: scrape the producer, stop ``budget_s`` after its first token."""

    def __init__(self, port: int, budget_s: float) -> None:
        self.url, self.budget_s = f"http://127.0.0.1:{port}/metrics", budget_s
        self.t0: float | None = None
        self.last: dict[str, float] = {}
        self.at_t0: dict[str, float] = {}  # counters when the budget started: only what follows counts
        self._at = 0.0

    def __call__(self) -> bool:
        if time.monotonic() - self._at >= 1.0 or self.t0 is not None and self._over():
            self._at = time.monotonic()
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                return False
            self.last = {k: float(v) for k, v in re.findall(r"^(grpo_stream_producer_\w+) ([0-9.e+-]+)$", text, re.M)}
            if self.t0 is None and self.last.get("grpo_stream_producer_tokens_total", 0) > 0:
                self.t0, self.at_t0 = time.time(), dict(self.last)
        return self.t0 is not None and self._over()

    def _over(self) -> bool:
        return self.t0 is not None and time.time() - self.t0 >= self.budget_s


def run_pipeline_arm(model: Path, arm: Arm, budget_s: float, out: Path, task: str) -> dict[str, Any]:
    from grpo_core.jsonl import read_lines
    from grpo_stream.broker import free_port
    from grpo_stream.run import execute, read_metrics

    cfg = base_config(model, out, arm, budget_s, task)
    port = free_port()
    cfg.producers.config.setdefault("metrics", {})["port"] = port
    watch = _Watch(port, budget_s)
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
            "dynamics": dynamics(sorted(inside, key=lambda m: m["step"])),
            "points": [(max(0.0, t), step, str(d)) for t, step, d in versions if t <= wall]}


def dynamics(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Means of the learner's per-step metrics (:data:`DYNAMICS`, ``steps`` in step order) over the first
    :data:`EARLY_STEPS` steps -- the rise, where the arms' rewards per step part -- and over all of them, keyed
    ``<metric>_early`` / ``<metric>_all``: what the policy and its batches looked like, step for step."""
    out: dict[str, float | None] = {}
    for window, rows in (("early", steps[:EARLY_STEPS]), ("all", steps)):
        for key in DYNAMICS:
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            out[f"{key}_{window}"] = statistics.fmean(values) if values else None
    return out


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


def reached(curve: list[Any], target: float) -> Any | None:
    """The first evaluated point from which the reward holds at ``target`` for two evaluations in a row (as the
    demo's stop rule): one lucky version on a noisy curve does not count, and a crossing at the very last point,
    unconfirmed, does not either."""
    return next((a for a, b in zip(curve, curve[1:], strict=False) if a[1] >= target and b[1] >= target), None)


def time_to(curve: list[Any], target: float) -> float | None:
    point = reached(curve, target)
    return None if point is None else point[0]


def steps_to(curve: list[Any], target: float) -> int | None:
    """Learner steps to the target: beside the seconds, it shows what staleness cost in updates."""
    point = reached(curve, target)
    return None if point is None or len(point) < 3 else point[2]


# ------------------------------------------------------------------------------------------ the report


FIELDS = ("time_to_target_s", "ratio_to_S", "steps_to_target", "reward_gain_per_s", "tokens_per_s", "engine_busy",
          "learner_busy", "mean_staleness", "steps", "final_reward")


def arm_row(result: dict[str, Any], target: float, sync_ttt: float | None) -> dict[str, Any]:
    curve = result["curve"]
    ttt = time_to(curve, target)
    first, last = (curve[0][1], curve[-1][1]) if curve else (0.0, 0.0)
    return {"time_to_target_s": ttt, "ratio_to_S": None if ttt is None or not sync_ttt else ttt / sync_ttt,
            "steps_to_target": steps_to(curve, target),
            "reward_gain_per_s": (last - first) / result["wall_s"], "tokens_per_s": result["tokens"] / result["wall_s"],
            "engine_busy": result["engine_busy"], "learner_busy": result["learner_busy"],
            "mean_staleness": result["mean_staleness"], "steps": result["steps"], "final_reward": last}


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def report(results: dict[str, list[dict[str, Any]]], target: float, out: Path) -> dict[str, Any]:
    s_runs = results.get("S", [])
    gen = statistics.fmean(r["gen_s"] for r in s_runs) if s_runs else None
    train = statistics.fmean(r["train_s"] for r in s_runs) if s_runs else None
    ideal = max(gen, train) / (gen + train) if gen is not None and train is not None else None
    sync_ttt = sync_time_to(results, target)
    table: dict[str, Any] = {}
    if gen is not None and train is not None:
        print(f"target held-out reward {target}; S: gen {gen:.1f}s + train {train:.1f}s -> ideal ratio "
              f"{ideal:.3f} (gen/train {gen / max(train, 1e-9):.2f})")
    else:
        print(f"target held-out reward {target}; no arm S in this run: no ratios to S, no ideal ratio")
    print(f"{'arm':<15} " + " ".join(f"{f:>17}" for f in FIELDS))
    for name, runs in results.items():
        rows = [arm_row(r, target, sync_ttt) for r in runs]
        table[name] = {"runs": rows, "median": {f: _median_of(f, [row[f] for row in rows]) for f in FIELDS},
                       "min": {f: _pick(min, [row[f] for row in rows]) for f in FIELDS},
                       "max": {f: _max_of(f, [row[f] for row in rows]) for f in FIELDS}}
        print(f"{name:<15} " + " ".join(f"{_fmt(table[name]['median'][f]):>17}" for f in FIELDS))
        if len(rows) > 1:
            print(f"{'  min/max':<15} " + " ".join(
                f"{_fmt(table[name]['min'][f]) + '/' + _fmt(table[name]['max'][f]):>17}" for f in FIELDS))
    best = min((v["median"]["ratio_to_S"] for k, v in table.items() if k.startswith("P")
                and v["median"]["ratio_to_S"] is not None), default=None)
    print(f"best pipeline ratio to S: {_fmt(best)} (target <= 0.65); ideal {_fmt(ideal)}; "
          f"gap {_fmt(None if best is None or ideal is None else best / ideal)} (target <= 1.15)")
    sensitivity = ratios_by_target(results, sorted({round(target + d, 2) for d in (-0.1, -0.05, 0.0, 0.05, 0.1)}))
    warmup = statistics.fmean(r.get("warmup_s", 0.0) for r in s_runs) if s_runs else None  # outside S's clock
    summary = {"target": target, "ideal_ratio": ideal, "sync_gen_s": gen, "sync_train_s": train,
               "sync_warmup_s": warmup,
               "best_pipeline_ratio": best, "arms": table, "ratio_by_target": sensitivity,
               "dynamics": dynamics_table(results),
               "curves": {k: [r["curve"] for r in v] for k, v in results.items()}}
    (out / "async.json").write_text(json.dumps(summary, indent=2))
    _plot(results, target, out / "async.png")
    return summary


def sync_time_to(results: dict[str, list[dict[str, Any]]], target: float) -> float | None:
    """S's median time to ``target`` (a run that never reached it counts as the slowest): what every ratio divides
    by (None: half or more of S's runs never reached it, or no S run)."""
    return _median_to_target([time_to(r["curve"], target) for r in results.get("S", [])])


def ratios_by_target(results: dict[str, list[dict[str, Any]]], targets: list[float]) -> dict[str, dict[str, Any]]:
    """Median ratio to S of every pipeline arm at targets around the chosen one, printed as a table: a conclusion
    that holds at one target only is an artefact of where the target fell on a noisy curve."""
    table: dict[str, dict[str, Any]] = {}
    for target in targets:
        sync = sync_time_to(results, target)
        table[f"{target:.2f}"] = {name: _median_to_target([None if t is None or not sync else t / sync for t in
                                                           (time_to(r["curve"], target) for r in runs)])
                                  for name, runs in results.items() if name.startswith("P")}
    names = sorted({n for row in table.values() for n in row})
    print("median ratio to S by target: " + " | ".join(
        f"{t}: " + ", ".join(f"{n} {_fmt(row[n])}" for n in names) for t, row in table.items()))
    return table


def dynamics_table(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's :func:`dynamics`, median over its repeats, printed a line per arm (early | all)."""
    keys = [f"{k}_{w}" for w in ("early", "all") for k in DYNAMICS]
    table = {name: {k: _median([r.get("dynamics", {}).get(k) for r in runs]) for k in keys}
             for name, runs in results.items()}
    print(f"learner metrics, mean per step over the first {EARLY_STEPS} steps | all steps (median of repeats):")
    print(f"{'arm':<15} " + " ".join(f"{k:>23}" for k in DYNAMICS))
    for name, row in table.items():
        print(f"{name:<15} " + " ".join(f"{_fmt(row[k + '_early']) + ' | ' + _fmt(row[k + '_all']):>23}"
                                        for k in DYNAMICS))
    return table


TO_TARGET = ("time_to_target_s", "ratio_to_S", "steps_to_target")  # None: that repeat never reached the target


def _median_to_target(values: list[Any]) -> Any:
    """The median of times (or steps, or ratios) to the target, a repeat that never reached it counting as slower
    than every one that did: dropping it would report the arm's lucky repeats only. None when the median repeat
    itself never reached the target."""
    ordered = sorted(values, key=lambda v: (v is None, v if v is not None else 0))
    n = len(ordered)
    middle = ordered[(n - 1) // 2:n // 2 + 1] if n else [None]
    return None if None in middle else statistics.fmean(middle) if len(middle) == 2 else middle[0]


def _median_of(field: str, values: list[Any]) -> Any:
    return _median_to_target(values) if field in TO_TARGET else _median(values)


def _max_of(field: str, values: list[Any]) -> Any:
    """The largest value; for a field to the target, None ("-") when a repeat never reached it."""
    return None if field in TO_TARGET and None in values else _pick(max, values)


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _pick(fn: Any, values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return fn(known) if known else None


def _plot(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        for k, r in enumerate(runs):
            ax.plot([c[0] for c in r["curve"]], [c[1] for c in r["curve"]], "o-", ms=3, color=f"C{i}",
                    alpha=0.9 if k == 0 else 0.4, label=name if k == 0 else None)
    ax.axhline(target, ls="--", color="grey", lw=0.8)
    ax.set(xlabel="wall-clock seconds (from the first generated token)", ylabel="held-out reward (positions)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
