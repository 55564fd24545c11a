"""``grpo-stream bench learner``, part 2: what one learner checkpoint costs as the dedup window fills.

Two layouts of the same checkpoint (the tiny model, its AdamW state, the RNG state; ``grpo_learner.checkpoint``):
the whole dedup set pickled into ``trainer.pt`` at every checkpoint (the layout before ``grpo_learner.seen_log``),
and the log that each checkpoint appends only its new ids to (now). ``NEW_IDS`` ids per checkpoint: one step of
``bench async`` at v = 1, where every step is checkpointed. Both run here, one after the other, in one process.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import torch

from grpo_learner import checkpoint
from grpo_learner.publish import metadata_payloads, safetensors_payload
from grpo_learner.seen_log import SeenLog

NEW_IDS = 16
WINDOWS = (10_000, 100_000, 1_000_000)  # the last is LearnerConfig.dedup_window's default


def _model_and_state(model_dir: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cast(torch.Tensor, sum(p.sum() for p in model.parameters())).backward()
    optimizer.step()  # so the state holds both moments, as a learner's does after its first step
    return model, {"optimizer": optimizer.state_dict()}


def _written(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def measure(model_dir: Path, window: int, repeats: int = 5) -> dict[str, float]:
    """Median ms and MB written per checkpoint for both layouts, the dedup window full at ``window`` ids."""
    model, trainer_state = _model_and_state(model_dir)
    prefix = uuid.uuid4().hex[:12]
    ids = [f"{prefix}-p{i}@e0r0" for i in range(window)]
    files = {"model.safetensors": safetensors_payload(model), **metadata_payloads(model)}
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="grpo-bench-ckpt-") as tmp:
        whole, appended = Path(tmp) / "whole", Path(tmp) / "log"
        times, sizes = [], []
        for step in range(repeats):
            t0 = time.perf_counter()
            state = {"trainer": trainer_state, "rng": checkpoint.rng_state(), "seen": list(ids)}
            path = checkpoint.save(whole, step, {"model": files}, state, {"offsets": {}}, keep=1)
            times.append(time.perf_counter() - t0)
            sizes.append(_written(path))
        out["whole_ms"], out["whole_mb"] = 1000 * statistics.median(times), statistics.median(sizes) / 1e6
        log = SeenLog(appended, window)
        log.start(ids)  # the window as a long run leaves it
        times, sizes = [], []
        for step in range(repeats):
            new = [f"{prefix}-q{step}-{j}@e0r0" for j in range(NEW_IDS)]
            ids = ids[NEW_IDS:] + new
            before = _written(appended, "seen-*.jsonl")
            t0 = time.perf_counter()
            ref = log.append(new, ids)
            path = checkpoint.save(appended, step, {"model": files}, {"trainer": trainer_state,
                                                                       "rng": checkpoint.rng_state()},
                                   {"offsets": {}, "seen_log": ref}, keep=1)
            log.gc(appended.glob("step-*"))
            times.append(time.perf_counter() - t0)
            sizes.append(_written(path) + _written(appended, "seen-*.jsonl") - before)
        log.close()
        out["log_ms"], out["log_mb"] = 1000 * statistics.median(times), statistics.median(sizes) / 1e6
    return out


def report(model_dir: Path, windows: tuple[int, ...] = WINDOWS, repeats: int = 5) -> list[dict[str, float]]:
    print(f"learner checkpoint as the dedup window fills (tiny model + AdamW state, {NEW_IDS} new ids a "
          f"checkpoint, median of {repeats}):")
    rows = []
    for window in windows:
        r = measure(model_dir, window, repeats)
        print(f"  window {window:>9,} ids: whole set in trainer.pt {r['whole_ms']:8.1f} ms {r['whole_mb']:6.2f} MB"
              f"  | appended log {r['log_ms']:6.1f} ms {r['log_mb']:6.2f} MB  | {r['whole_ms'] / r['log_ms']:5.1f}x")
        rows.append({"window": window, **r})
    return rows
