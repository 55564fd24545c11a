"""``grpo-stream bench engine``: in-flight against between-batch weight swaps on one vLLM engine, alone.

The pipeline arms of ``bench async`` generate only as fast as the learner consumes (the producer pauses on its
backlog), so their tokens/s say as much about the learner and the shared cores as about the engine. This
benchmark isolates what ``weights.swap`` changes: the same :class:`AsyncVLLMEngine`, model, prompts (the
``copy`` task of ``bench async``), group size and batch, the weights reloaded equally often, no Kafka and no
learner, and the engine pinned to one CPU as the pipeline's producer is.

Arms, interleaved ``repeats`` times so that the drift of a shared machine hits each alike:

* ``between``: generate a batch of B groups, reload the weights, repeat (the batch loop: the batch's longest
  sample holds up the rest, and the weights change only between batches).
* ``inflight``: B groups always in the engine, each finished group replaced at once, the weights swapped under
  them every ``swap_every`` s (default: the first ``between`` run's time per batch, so that both reload at the
  same cadence), each request keeping its KV cache across the swap (``weights.inflight_kv: keep``, the default).
* ``inflight_recompute``: the same with ``weights.inflight_kv: recompute``: every request in flight has its
  prefix recomputed with the new weights after each swap.
* ``continuous``: as ``inflight`` without swaps: what continuous batching alone gains, so that the swaps' cost
  is the difference between the two.

Printed: tokens/s per arm (median, min/max), the ratios to ``between``, where an in-flight swap's time goes
(pause: the step under way ends, and with ``recompute`` the KV cache is cleared; reload; resume), per swap and
rule, and the engine's cost
model (:func:`occupancy`: tokens/s and time per step against the sequences in a batch), which says whether
continuous batching can pay at this operating point at all. Written: ``engine.json``.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ARMS = ("between", "inflight", "inflight_recompute", "continuous")
SWAP_ARMS = {"inflight": "keep", "inflight_recompute": "recompute"}  # arm -> weights.inflight_kv


@dataclass
class ArmRun:
    """One timed run of one arm."""

    tokens: int = 0
    seconds: float = 0.0
    swaps: int = 0
    swap_split_s: dict[str, float] = field(default_factory=dict)  # summed over the run's swaps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def parse_lengths(spec: str) -> list[int]:
    """``1-8``: every digit count from 1 to 8 alike; ``1,1,2,12``: drawn from the list (a repeat is a weight)."""
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-"))
            out = list(range(lo, hi + 1))
        else:
            out = [int(x) for x in spec.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"bench engine --lengths {spec!r}: give a range like 1-8 or digit counts like 1,1,2,12")
    return out


def copy_prompts(tokenizer: Any, lengths: list[int], count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["copy({})=".format("".join(rng.choice("0123456789") for _ in range(rng.choice(lengths))))
             for _ in range(count)]
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]


class Bench:
    """The engine, the prompts and the three arms (see the module docstring)."""

    def __init__(self, engine: Any, model: Path, prompts: list[list[int]], sampling: Any, group_size: int,
                 batch: int) -> None:
        self.engine, self.model, self.prompts, self.sampling = engine, model, prompts, sampling
        self.g, self.b = group_size, batch
        self.next = 0
        self.version = 0

    def next_prompt(self) -> list[int]:
        self.next += 1
        return self.prompts[self.next % len(self.prompts)]

    def between(self, seconds: float) -> ArmRun:
        run, t0 = ArmRun(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            out = self.engine.generate([self.next_prompt() for _ in range(self.b)], self.g, self.sampling)
            run.tokens += sum(len(s.token_ids) for group in out for s in group)
            self.engine.load_weights(self.model)
            run.swaps += 1
        run.seconds = time.perf_counter() - t0
        return run

    def inflight(self, seconds: float, swap_every: float | None, kv: str = "keep") -> ArmRun:
        """B groups in flight for ``seconds``; swapped under them every ``swap_every`` s (None: never), each
        request keeping its KV or having it recomputed (``kv``)."""
        run, keys = ArmRun(), set()

        def submit() -> None:
            key = f"g{self.next}"
            self.engine.submit(key, self.next_prompt(), self.g, self.sampling, self.version)
            keys.add(key)

        for _ in range(self.b):
            submit()
        t0 = last = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for done in self.engine.finished(0.02):
                keys.discard(done.key)
                if done.samples is None:
                    raise RuntimeError(f"bench engine: generation failed: {done.error!r}")
                run.tokens += sum(len(s.token_ids) for s in done.samples)
                submit()
            if swap_every is not None and time.perf_counter() - last >= swap_every:
                self.version += 1
                self.engine.swap(self.model, self.version, kv)
                for k, v in asdict(self.engine.last_swap).items():
                    run.swap_split_s[k] = run.swap_split_s.get(k, 0.0) + v
                run.swaps, last = run.swaps + 1, time.perf_counter()
        run.seconds = time.perf_counter() - t0
        for key in keys:  # not counted: unfinished when the time was up
            self.engine.abort(key)
        self.engine.finished(0.2)
        return run


def occupancy(bench: Bench, seconds: float) -> list[dict[str, float]]:
    """Tokens/s and time per engine step against the sequences in one batch (no swaps): the engine's cost
    model. Where a step's time grows with the sequences in it, the slots a batch's early finishers leave idle
    cost nothing and continuous batching has nothing to fill; where it stays flat, they are the loss."""
    rows, b0 = [], bench.b
    for b in sorted({max(1, b0 // 8), max(1, b0 // 4), max(1, b0 // 2), b0, 2 * b0}):
        tokens, steps, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            out = bench.engine.generate([bench.next_prompt() for _ in range(b)], bench.g, bench.sampling)
            tokens += sum(len(s.token_ids) for group in out for s in group)
            steps += max(len(s.token_ids) for group in out for s in group)  # the batch's decode steps
        dt = time.perf_counter() - t0
        rows.append({"sequences": b * bench.g, "tokens_per_s": tokens / dt, "ms_per_step": 1000 * dt / steps})
    return rows


def summarise(runs: dict[str, list[ArmRun]]) -> dict[str, Any]:
    med = {arm: statistics.median(r.tokens_per_s for r in rs) for arm, rs in runs.items()}
    split = {arm: _per_swap_ms([r for r in runs[arm] if r.swaps]) for arm in SWAP_ARMS if arm in runs}
    base = med.get("between") or 0.0
    return {"tokens_per_s": {arm: {"median": med[arm], "min": min(r.tokens_per_s for r in rs),
                                   "max": max(r.tokens_per_s for r in rs)} for arm, rs in runs.items()},
            "ratio_to_between": {arm: (m / base if base else None) for arm, m in med.items()},
            "swap_ms": split,
            "runs": {arm: [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rs] for arm, rs in runs.items()}}


def _per_swap_ms(runs: list[ArmRun]) -> dict[str, float]:
    swaps = max(1, sum(r.swaps for r in runs))
    return {k.removesuffix("_s"): 1000 * sum(r.swap_split_s.get(k, 0.0) for r in runs) / swaps
            for k in ("pause_s", "reload_s", "resume_s")}


def print_report(summary: dict[str, Any], swap_every: float, lengths: list[int]) -> None:
    print("engine cost model (between-batch generation, no swaps): " + "; ".join(
        f"{r['sequences']} seqs {r['tokens_per_s']:.0f} tok/s {r['ms_per_step']:.1f} ms/step"
        for r in summary["occupancy"]))
    print(f"digit counts {sorted(set(lengths))}, weights reloaded every {swap_every:.3f}s in 'inflight' "
          f"(the between arm's time per batch)")
    print(f"{'arm':<18} {'tokens_per_s':>13} {'min/max':>15} {'ratio_to_between':>17}")
    for arm, t in summary["tokens_per_s"].items():
        ratio = summary["ratio_to_between"][arm]
        print(f"{arm:<18} {t['median']:>13.1f} {t['min']:>7.0f}/{t['max']:<7.0f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>17}")
    for arm, s in summary["swap_ms"].items():
        print(f"in-flight swap, {SWAP_ARMS[arm]} KV: pause {s['pause']:.1f} ms + reload {s['reload']:.1f} ms + "
              f"resume {s['resume']:.1f} ms per swap")
    print(f"inflight/between {_r(summary, 'inflight')} (target >= 1.3), inflight_recompute/between "
          f"{_r(summary, 'inflight_recompute')}, continuous/between {_r(summary, 'continuous')}")


def _r(summary: dict[str, Any], arm: str) -> str:
    ratio = summary["ratio_to_between"].get(arm)
    return "-" if ratio is None else f"{ratio:.3f}"


def main(seconds: float = 20.0, repeats: int = 3, lengths: str = "1-8", cpu: int = 0,
         out: str = "runs/bench-engine", batch: int | None = None) -> int:
    """``batch``: groups per batch and in flight (default: ``groups_per_batch`` of ``bench-async.yaml``)."""
    from transformers import AutoTokenizer

    from grpo_core.config import build, validate_tree
    from grpo_producers.backends.vllm_async import AsyncVLLMEngine
    from grpo_producers.config import ProducerConfig
    from grpo_stream.bench.async_bench import Arm, base_config, prepare_model
    from grpo_stream.run import role_configs

    digits = parse_lengths(lengths)
    model = prepare_model("copy")  # the long tail: 1-8 digits
    run_cfg = base_config(model, Path(out), Arm("engine", True), seconds)
    pcfg = build(ProducerConfig, role_configs(run_cfg, "unused:9092")["producer"], "producer")
    validate_tree(pcfg)
    sampling = pcfg.sampling_params()
    sampling.max_tokens = max(sampling.max_tokens or 0, max(digits) + 4)  # room for the longest answer and EOS
    os.sched_setaffinity(0, {cpu})  # the engine's processes start here and stay on this CPU
    engine = AsyncVLLMEngine(pcfg.backend_config())
    try:
        tok = AutoTokenizer.from_pretrained(model)
        bench = Bench(engine, model, copy_prompts(tok, digits, 4000), sampling, pcfg.pipeline.group_size,
                      batch or run_cfg.learner["groups_per_batch"])
        bench.between(min(5.0, seconds))  # warm-up: the first batches of an engine are slow
        runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
        swap_every = 0.0
        for rep in range(repeats):
            runs["between"].append(bench.between(seconds))
            if rep == 0:
                first = runs["between"][0]
                swap_every = first.seconds / max(1, first.swaps)
            for arm, kv in SWAP_ARMS.items():
                runs[arm].append(bench.inflight(seconds, swap_every, kv))
            runs["continuous"].append(bench.inflight(seconds, None))
            print(f"[bench engine] repeat {rep + 1}/{repeats}: " + ", ".join(
                f"{arm} {rs[-1].tokens_per_s:.0f} tok/s" for arm, rs in runs.items()), flush=True)
        cost = occupancy(bench, max(1.0, seconds / 4))
    finally:
        engine.close()
    summary = summarise(runs) | {"swap_every_s": swap_every, "lengths": digits, "seconds": seconds,
                                 "occupancy": cost}
    print_report(summary, swap_every, digits)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "engine.json").write_text(json.dumps(summary, indent=2))
    print(f"[bench engine] wrote {Path(out) / 'engine.json'}")
    return 0
