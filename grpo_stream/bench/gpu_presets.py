"""The GPU check's throughput section: ``bench throughput``'s learner side on the GPU, per model preset.

``bench throughput`` itself needs vLLM, Java and Kafka, which the GPU machine does not have. What it can run there
is the learner's side of a preset scenario: one learner step on a batch shaped as ``bench throughput`` shapes it
(2 prompts x G 8 a step, completion lengths drawn lognormal with median 64 and p99 8x the median, capped at 512;
``configs/bench-throughput.yaml``'s learner section), for each model preset (``tiny``, ``50m``, ``qwen2.5-0.5b``:
the shapes of ``grpo_stream.tiny_model.PRESETS``, random weights), in the check's dtype. Printed per preset: the
step time (mean of the timed steps after a warm-up) and trained tokens/s; in the JSON under ``presets``.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from grpo_core import wire
from grpo_learner.trainer import Trainer, load_model
from grpo_producers.backends.lengths import LengthsConfig
from grpo_stream.tiny_model import PRESETS, TOKENIZER_VOCAB, VOCAB_MULTIPLE

if TYPE_CHECKING:
    from grpo_stream.bench.gpu_check import Plan, Report

BENCH_CONFIG = "configs/bench-throughput.yaml"
PROMPTS, GROUP_SIZE, MAX_TOKENS = 2, 8, 512  # bench throughput's defaults (--prompts, --group-size, --max-tokens)
LENGTHS = LengthsConfig(dist="lognormal", median=64, p99_ratio=8.0)
PROMPT_LEN = (12, 20)  # the copy task's prompts, `copy(12345678)=`, in the tiny tokenizer's tokens
WARMUP, TIMED = 1, 3


def preset_shape(preset: str) -> dict[str, int]:
    """Qwen2Config's sizes of a ``tiny_model`` preset (its vocabulary padded as ``tiny_model.make_config`` pads)."""
    p = PRESETS[preset]
    vocab = max(-(-TOKENIZER_VOCAB // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, p.get("vocab", 0))
    return {"hidden_size": p["hidden"], "num_hidden_layers": p["layers"], "num_attention_heads": p["heads"],
            "num_key_value_heads": p["kv_heads"], "intermediate_size": p["intermediate"], "vocab_size": vocab,
            "max_position_embeddings": p["max_position"]}


def drawn_groups(vocab: int, rng: np.random.Generator) -> list[wire.ScoredGroup]:
    """One step's groups: random prompt and completion tokens, completion lengths drawn as the producers draw
    them, behaviour logprobs near a random model's, rewards with variance (the overlong term's 0/1 ends)."""
    from grpo_stream.bench.gpu_check import completion, scored_group, through_wire

    groups = []
    for g in range(PROMPTS):
        gid = wire.make_group_id(f"tp-{g}", 0)
        prompt = rng.integers(1, vocab, int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1)))
        members = [completion(gid, k, GROUP_SIZE, prompt, rng.integers(1, vocab, n),
                              np.minimum(-math.log(vocab) + rng.normal(0.0, 0.5, n), 0.0), "length", 1.0)
                   for k, n in enumerate(LENGTHS.draw(GROUP_SIZE, rng, MAX_TOKENS))]
        groups.append(scored_group(gid, members, [float(k % 2) for k in range(GROUP_SIZE)]))
    return through_wire(groups)


def presets_section(plan: Plan, bench_config: Path, report: Report) -> None:
    """Each of ``plan.presets``: build it, time ``TIMED`` learner steps after ``WARMUP`` on the same batch."""
    from grpo_stream.bench import gpu_check as gc

    rng = np.random.default_rng(0)
    sync = gc.make_sync(plan.device)
    report.data["presets"] = {}
    for preset in plan.presets:
        sub = dataclasses.replace(plan, shape=preset_shape(preset), groups=PROMPTS, group_size=GROUP_SIZE,
                                  completion_len=MAX_TOKENS, micro_batch_tokens=None)
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{preset}-") as tmp:
            params, _ = gc.build_model_dir(sub, Path(tmp))
            cfg = gc.learner_config(sub, bench_config, Path(tmp), 1)
            groups = drawn_groups(sub.shape["vocab_size"], rng)
            model = load_model(cfg.model)
            gc.add_sync_hooks(model, sync)
            trainer = Trainer(cfg, model)
            trainer.optimizer.register_step_post_hook(sync)
            runs = [gc.timed_step(trainer, groups, sync) for _ in range(WARMUP + TIMED)]
            del trainer, model
            gc.free_memory()
        step_s = sum(w for _, w in runs[WARMUP:]) / TIMED
        tokens = runs[-1][0].tokens
        losses = [s.metrics.get("loss", float("nan")) for s, _ in runs]
        report.row(f"preset {preset} step", f"{step_s:.3f} s (mean of {TIMED} after {WARMUP} warm-up; "
                                            f"{params / 1e6:.1f}M parameters, {PROMPTS} prompts x G={GROUP_SIZE}, "
                                            f"{tokens} completion tokens: {tokens / step_s:,.0f} trained tokens/s)")
        report.check(f"preset {preset} train steps", all(math.isfinite(x) for x in losses),
                     f"losses {', '.join(f'{x:.4g}' for x in losses)}")
        report.data["presets"][preset] = {"step_s": step_s, "params": params, "completion_tokens": tokens,
                                          "trained_tokens_per_s": tokens / step_s}
