"""Staleness and backpressure through topic offsets: when a producer must not start another batch.

Two knobs (both live: re-read from ``control_file`` when it changes):

* ``max_backlog_groups`` -- backlog = groups on ``groups`` the learner has not consumed yet (log-end minus the
  learner group's committed offset) + groups still on their way (completions the verifiers have not consumed
  yet, divided by G). At or above the limit the producer waits. It checks before each batch, so the backlog
  peaks at the limit plus one batch. This bounds how far generation runs ahead of learning.
* ``max_version_lag`` -- while the newest announced policy version is ahead of the producer's by more than
  this, it blocks until it has swapped weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpo_core.config import ConfigError
from grpo_core.contract import PipelineContract, check_staleness_bound
from grpo_core.kafka_io import Admin, consumer_lag, with_retry

log = logging.getLogger(__name__)


@dataclass
class Knobs:
    max_backlog_groups: int
    max_version_lag: int


class LiveKnobs:
    """The knobs, refreshed from an optional YAML file whenever its mtime changes; a bad edit is logged and
    ignored (the previous values stay), never fatal."""

    def __init__(self, knobs: Knobs, path: str, contract: PipelineContract) -> None:
        self.knobs, self.path, self.contract = knobs, Path(path) if path else None, contract
        self._mtime: float | None = None

    def refresh(self) -> Knobs:
        if self.path is None:
            return self.knobs
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return self.knobs
        if mtime == self._mtime:
            return self.knobs
        self._mtime = mtime
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
            new = Knobs(int(data.get("max_backlog_groups", self.knobs.max_backlog_groups)),
                        int(data.get("max_version_lag", self.knobs.max_version_lag)))
            if new.max_backlog_groups < 0 or new.max_version_lag < -1:
                raise ValueError("max_backlog_groups must be >= 0 and max_version_lag >= -1")
            check_staleness_bound(new.max_version_lag, self.contract, "max_version_lag")
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError, ConfigError) as exc:
            log.error("control file %s ignored: %s", self.path, exc)
            return self.knobs
        if new != self.knobs:
            log.info("live knobs changed: %s -> %s", self.knobs, new)
        self.knobs = new
        return new


class Backlog:
    """Reads the backlog from committed offsets (the same numbers Kafka lag tools show)."""

    def __init__(self, admin: Admin, contract: PipelineContract) -> None:
        self.admin, self.contract = admin, contract

    def groups(self) -> int:
        """Backlog in groups. An I/O edge: a coordinator still loading (new group, broker restart) is retried."""
        return with_retry(self._groups, "producer: read the backlog", attempts=5, backoff_s=0.2)

    def _groups(self) -> int:
        c = self.contract
        unlearned = sum(consumer_lag(self.admin, c.group("learner"), c.topic("groups")).values())
        unscored = sum(consumer_lag(self.admin, c.group("verifiers"), c.topic("completions")).values())
        return unlearned + unscored // c.group_size


def pause_reason(knobs: Knobs, backlog: int | None, own_version: int, newest_version: int) -> str:
    """Why the next batch must wait ('' = go). ``backlog`` None means the limit is off (not measured)."""
    if knobs.max_backlog_groups > 0 and backlog is not None and backlog >= knobs.max_backlog_groups:
        return "backlog"
    if knobs.max_version_lag >= 0 and newest_version - own_version > knobs.max_version_lag:
        return "version_lag"
    return ""
