"""``grpo-stream demo``: a tiny model visibly learning through the whole Kafka pipeline on a laptop CPU.

1. Build a tiny Qwen2 model + byte-level BPE tokenizer locally (nothing downloaded).
2. Warm-start it with a few seconds of supervised training that teaches only the answer *format*: one of the
   prompt's digits, chosen at random, then EOS. Held-out accuracy starts at chance among the prompt's digits
   (~0.4 on the demo's 2-3 digit numbers).
3. Evaluate it on held-out prompts (greedy decoding).
4. Run the full pipeline (``configs/demo.yaml``): a local Kafka broker, the feeder, 2 producers, 1 verifier and
   the learner (off-policy GRPO, v > 1) as separate processes; evaluate the published weights every
   ``EVAL_EVERY_S``. The run ends once ``until`` is reached (held-out reward at or above it for ``HOLD``
   evaluations in a row: the point is shown) or at the time budget, whichever comes first.
5. Evaluate the final checkpoint with the same decoding; write summary.json and report.png; print a short table.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from grpo_core.config import load_config, to_dict
from grpo_core.trackers import Trackers
from grpo_stream.configs import shipped_config

FINAL_EVAL_RESERVE_MIN = 0.5  # minutes kept back from the budget for shutdown and the final evaluation
# An evaluation (198 prompts, greedy, one token) takes ~0.08 s on one thread: every 10 s costs under 1% of a core
# and tells the target within ~10-20 s of reaching it (two in a row).
EVAL_EVERY_S = 10.0
HOLD = 2  # evaluations in a row at or above the target: one lucky evaluation does not end the demo
DEFAULT_UNTIL = 0.95  # near the plateau (the demo reaches 1.00 held-out)


def target_reached(rewards: list[float], until: float | None, hold: int = HOLD) -> bool:
    """True once the last ``hold`` held-out rewards (published versions, in order) are all >= ``until``."""
    return until is not None and len(rewards) >= hold and all(r >= until for r in rewards[-hold:])


class Evaluator:
    """Evaluates the newest published weights (fs store) every ``every_s`` seconds -> eval.jsonl."""

    def __init__(self, out: Path, weights_root: Path, run: str, tokenizer_dir: Path, prompts: list[str],
                 answers: list[str], max_tokens: int, every_s: float = EVAL_EVERY_S,
                 until: float | None = None, pass_k: int = 0, temperature: float = 1.0,
                 reward: str = "exact") -> None:
        from transformers import AutoTokenizer

        self.path, self.versions_dir = out / "eval.jsonl", weights_root / run
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.prompts, self.answers, self.every_s, self.max_tokens = prompts, answers, every_s, max_tokens
        self.last, self.done_versions = time.monotonic(), {0}
        self.rewards: list[float]
        self.reached_at: int | None
        self.until, self.rewards, self.reached_at = until, [], None  # rewards: of published versions, in order
        self.reached_s: float | None = None  # seconds from start_clock() to the evaluation that met the target
        self.clock = time.monotonic()
        self.trackers: Trackers | None = None  # the run's report_to, job "eval"
        self.pass_k, self.temperature = pass_k, temperature  # pass_k > 0: Pass@1 over k samples too (the sweep)
        self.reward = reward  # greedy evaluation: exact match, or positions' partial credit (multi-token tasks)

    def record(self, step: int, reward: float, model_dir: Path | None = None) -> None:
        """The one place an evaluation goes out: eval.jsonl (the source of truth), then the trackers. With
        ``pass_k`` and ``model_dir``, the line also has ``pass_at_1`` over ``pass_k`` samples per prompt."""
        line: dict[str, Any] = {"step": step, "eval_reward": reward, "time": time.time()}
        if self.pass_k and model_dir is not None:
            from grpo_stream.demo_model import sampled_pass_at_1

            line["pass_at_1"] = sampled_pass_at_1(model_dir, self.prompts, self.answers, self.pass_k,
                                                  self.temperature, self.max_tokens, tokenizer=self.tokenizer)
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self.trackers is not None:
            self.trackers.log(line, step)

    def evaluate_dir(self, model_dir: Path) -> float:
        from transformers import AutoModelForCausalLM

        from grpo_stream.demo_model import evaluate

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        return evaluate(model, self.prompts, self.answers, max_tokens=self.max_tokens, tokenizer=self.tokenizer,
                        reward=self.reward)

    def tick(self) -> bool:
        """Evaluate the newest published version when one is due; True (end the run) once the target holds."""
        if time.monotonic() - self.last < self.every_s or not self.versions_dir.exists():
            return False
        self.last = time.monotonic()
        versions = sorted(p for p in self.versions_dir.glob("v*") if (p / "model.safetensors").exists())
        if not versions:
            return False
        newest = versions[-1]
        version = int(newest.name[1:])
        if version in self.done_versions:
            return False
        try:
            reward = self.evaluate_dir(newest)
        except (OSError, ValueError) as exc:  # the store's GC may remove a version under our feet: next time
            print(f"[demo] eval of {newest.name} skipped: {exc}")
            return False
        self.done_versions.add(version)
        self.record(version, reward, newest)
        self.rewards.append(reward)
        print(f"[demo] held-out reward {reward:.3f} at v{version}", flush=True)
        if target_reached(self.rewards, self.until):
            self.reached_at, self.reached_s = version, time.monotonic() - self.clock
            return True
        return False


def prepare_model(seed: int, task: str) -> Path:
    """The warm-started tiny model (cached per seed and task under .cache/demo-models)."""
    from grpo_stream.demo_model import warm_recipe, warm_start
    from grpo_stream.tiny_model import build_tiny_model

    root = Path(".cache") / "demo-models" / f"seed{seed}"
    base = build_tiny_model(root / "base", seed=seed)
    # The warm start teaches the format -- "answer with one of the prompt's digits" (which one: random), or for
    # a multi-token task "the prompt's digits in some order" -- so the held-out score starts at chance; RL has
    # to learn which answer is right.
    answers, steps = warm_recipe(task)
    return warm_start(base, task, steps=steps, seed=seed, out_dir=root / f"warm-{task.replace(',', '+')}",
                      answers=answers)


def run_demo(backend: str = "hf", minutes: float = 8.0, seed: int = 0, out: str | None = None,
             task: str = "last_digit", config: str | Path | None = None,
             overrides: tuple[str, ...] = (), until: float | None = DEFAULT_UNTIL,
             pass_k: int = 0, eval_every_s: float = EVAL_EVERY_S) -> dict[str, Any]:
    import torch

    from grpo_stream.demo_model import task_items, task_reward
    from grpo_stream.report import write_report
    from grpo_stream.run import RunConfig, execute

    started = time.monotonic()
    out_dir = Path(out or f"runs/demo-seed{seed}")
    shutil.rmtree(out_dir, ignore_errors=True)  # a demo always starts fresh (no checkpoint to resume)
    out_dir.mkdir(parents=True)
    model = prepare_model(seed, task)
    prompts, answers = task_items(task, "eval")
    cfg = load_config(RunConfig, config or shipped_config("demo.yaml"), overrides)
    # The same decoding length for sampling and evaluation: the answer is what the producers would generate.
    max_tokens = cfg.producers.config.get("sampling", {}).get("max_tokens") or cfg.pipeline.max_new_tokens
    temperature = float(cfg.producers.config.get("sampling", {}).get("temperature", 1.0))
    evaluator = Evaluator(out_dir, out_dir / "weights", "demo", model, prompts, answers, max_tokens, until=until,
                          every_s=eval_every_s, pass_k=pass_k, temperature=temperature, reward=task_reward(task))
    initial = evaluator.evaluate_dir(model)
    print(f"[demo] {task}: {len(prompts)} held-out prompts; warm-started model scores {initial:.3f}")
    budget = minutes - (time.monotonic() - started) / 60 - FINAL_EVAL_RESERVE_MIN
    cfg = load_config(RunConfig, config or shipped_config("demo.yaml"), [
        "name=demo", f"out_dir={out_dir}", f"max_minutes={max(budget, 0.5):.2f}",
        f"learner.model.path={model}", f"learner.seed={seed}", f"learner.weights.fs.root={out_dir / 'weights'}",
        f"producers.config.backend.model={model}", f"producers.config.backend.kind={backend}",
        f"producers.config.backend.seed={seed}", f"producers.config.weights.fs.root={out_dir / 'weights'}",
        f"feeder.synthetic.tasks=[{task}]", f"feeder.seed={seed}", *overrides])
    if cfg.learner.get("report_to"):
        evaluator.trackers = Trackers(cfg.learner["report_to"], out_dir, cfg.name, "eval", to_dict(cfg))
    evaluator.record(0, initial, model)
    threads = torch.get_num_threads()
    try:
        # The evaluations share the machine with the pipeline's processes: one thread, as each of them has
        # (grpo_stream/threads.py).
        torch.set_num_threads(1)
        evaluator.clock = time.monotonic()
        summary, rc = execute(cfg, on_tick=evaluator.tick)
        torch.set_num_threads(threads)
        final_dir = _final_model(out_dir)
        final = evaluator.evaluate_dir(final_dir) if final_dir else initial
        evaluator.record(summary["learner_steps"], final, final_dir)
    finally:
        if evaluator.trackers is not None:
            evaluator.trackers.close()
    summary |= {"initial_eval_reward": initial, "final_eval_reward": final, "eval_gain": final - initial,
                "task": task, "backend": backend, "seed": seed, "eval_prompts": len(prompts),
                "wall_seconds": round(time.monotonic() - started, 1), "warm_start_model": str(model),
                "pipeline_seconds": summary["wall_seconds"],
                "target_seconds": None if evaluator.reached_s is None else round(evaluator.reached_s, 1),
                "until": until, "stopped_by": "target" if evaluator.reached_at is not None else "budget",
                "exit_code": rc}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(out_dir)
    return summary


def _final_model(out: Path) -> Path | None:
    from grpo_learner import checkpoint

    ckpt = checkpoint.load_latest(out / "checkpoints")
    return ckpt.model_dir if ckpt else None


def _pipeline_row(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """How long the pipeline ran and when the target held, counted from its start (broker up, no warm start)."""
    if summary.get("target_seconds") is None:
        return []
    return [("pipeline time", f"{summary['pipeline_seconds']:.0f} s, the target held {summary['target_seconds']:.0f} "
                              "s after it started")]


def final_table(summary: dict[str, Any]) -> str:
    """The demo's result in a few lines (the whole summary is in summary.json)."""
    why = (f"reached {summary['until']:.2f} held-out for {HOLD} evaluations" if summary["stopped_by"] == "target"
           else "the time budget")
    rows = [("held-out reward", f"{summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f}"),
            ("learner steps", summary["learner_steps"]), ("groups trained", summary["groups_trained"]),
            ("mean staleness", f"{summary['mean_staleness']:.2f} steps"),
            ("versions published", summary["weight_versions_published"]),
            ("wall time", f"{summary['wall_seconds']:.0f} s (stopped by {why})"),
            *_pipeline_row(summary),
            ("report", f"{summary['run_dir']}/report.png (summary.json, logs/ beside it)")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(backend: str = "hf", minutes: float = 8.0, seed: int = 0, out: str | None = None,
         until: float | None = DEFAULT_UNTIL) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per evaluation would bury the demo's own lines
    summary = run_demo(backend, minutes, seed, out, until=until)
    print(final_table(summary))
    return int(summary["exit_code"])
