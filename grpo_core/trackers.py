"""Experiment trackers (TensorBoard, Weights & Biases): sinks for the metrics a process already writes.

``metrics.jsonl`` stays the source of truth; a tracker gets each line as it is written, from the one place that
writes it (the learner's ``LearnerMetrics``, the demo's evaluator), flattened to scalars. A process opens its
trackers once with its resolved config as hyperparameters, under its ``job`` name (``learner``, ``eval``):

* ``tensorboard`` -- event files in ``<out_dir>/tensorboard/<job>/`` (``tensorboard --logdir <out_dir>/tensorboard``);
  the config goes in as TensorBoard hparams.
* ``wandb`` -- a run per job in project ``$WANDB_PROJECT`` (default ``grpo-stream``), grouped by the pipeline's
  run name, its files under ``<out_dir>/wandb/``. ``WANDB_MODE=offline`` keeps everything on the machine (the
  tests use it; ``wandb sync`` uploads later).

Both packages are optional (``pip install 'grpo-stream[trackers]'``); asking for one that is not installed fails
at start-up with what to install.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from grpo_core.config import ConfigError

Tracker = Literal["tensorboard", "wandb"]
PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Sink(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def check_installed(kinds: Sequence[str]) -> None:
    """Raise ConfigError naming the package for a tracker that cannot be used here."""
    for kind in kinds:
        if kind not in PACKAGES:
            raise ConfigError(f"report_to: unknown tracker {kind!r}; allowed: {sorted(PACKAGES)}")
        if importlib.util.find_spec(PACKAGES[kind]) is None:
            raise ConfigError(f"report_to: {kind} needs the {PACKAGES[kind]} package: "
                              f"pip install 'grpo-stream[trackers]' (or pip install {PACKAGES[kind]})")


def scalars(line: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A metrics line as tracker scalars: numbers as they are, dicts as ``key/sub``, lists of numbers as their
    mean (``staleness`` -> ``staleness_mean``); text, non-finite values and ``step`` / ``time`` are left out."""
    out: dict[str, float] = {}
    for key, value in line.items():
        name = f"{prefix}{key}"
        if key in ("step", "time") and not prefix:
            continue
        if isinstance(value, int | float) and math.isfinite(value):  # bools too: 0.0 / 1.0
            out[name] = float(value)
        elif isinstance(value, dict):
            out |= scalars(value, f"{name}/")
        elif isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
            out[f"{name}_mean"] = float(sum(value) / len(value))
    return out


def hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as flat ``a.b.c`` hyperparameters (lists and None as text: trackers take scalars)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= hparams(value, f"{name}.")
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = str(value)
    return out


class Trackers:
    """The trackers of one process; ``log`` fans a metrics line out to each (none configured: does nothing)."""

    def __init__(self, kinds: Sequence[str], out_dir: Path, run: str, job: str, config: dict[str, Any]) -> None:
        check_installed(kinds)
        self.sinks: list[Sink] = []
        for kind in dict.fromkeys(kinds):
            self.sinks.append(_OPEN[kind](out_dir, run, job, hparams(config)))

    def log(self, line: dict[str, Any], step: int) -> None:
        values = scalars(line)
        for sink in self.sinks:
            sink.log(values, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class _TensorBoard:
    def __init__(self, out_dir: Path, run: str, job: str, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard" / job))
        # In this run's own event file (SummaryWriter.add_hparams would start a run of its own beside it).
        for summary in hparams_summary(params, {}):
            # file_writer: made by SummaryWriter(), declared None in its __init__ (the type mypy infers)
            cast(Any, self.writer.file_writer).add_summary(summary)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a kill -9 loses at most the line being written, as with metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out_dir: Path, run: str, job: str, params: dict[str, Any]) -> None:
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-stream"), group=run, job_type=job,
                              name=f"{run}-{job}", dir=str(out_dir), config=params, reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_OPEN: dict[str, Any] = {"tensorboard": _TensorBoard, "wandb": _Wandb}
