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
from kafka import KafkaAdminClient

from grpo_stream.kafka_io import consumer_lag, with_retry

log = logging.getLogger(__name__)


@dataclass
class Knobs:
    max_backlog_groups: int
    max_version_lag: int


class LiveKnobs:
    """The knobs, refreshed from an optional YAML file whenever its mtime changes; a bad edit is logged and
    ignored (the previous values stay), never fatal."""

    def __init__(self, knobs: Knobs, path: str) -> None:
        self.knobs, self.path = knobs, Path(path) if path else None
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
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as exc:
            log.error("control file %s ignored: %s", self.path, exc)
            return self.knobs
        if new != self.knobs:
            log.info("live knobs changed: %s -> %s", self.knobs, new)
        self.knobs = new
        return new


class Backlog:
    """Reads the backlog from committed offsets (the same numbers Kafka lag tools show)."""

    def __init__(self, admin: KafkaAdminClient, groups_topic: str, learner_group: str, completions_topic: str,
                 verifier_group: str, group_size: int) -> None:
        self.admin = admin
        self.groups_topic, self.learner_group = groups_topic, learner_group
        self.completions_topic, self.verifier_group = completions_topic, verifier_group
        self.group_size = group_size

    def groups(self) -> int:
        """Backlog in groups. An I/O edge: a coordinator still loading (new group, broker restart) is retried."""
        return with_retry(self._groups, "producer: read the backlog", attempts=5, backoff_s=0.2)

    def _groups(self) -> int:
        unlearned = sum(consumer_lag(self.admin, self.learner_group, self.groups_topic).values())
        unscored = sum(consumer_lag(self.admin, self.verifier_group, self.completions_topic).values())
        return unlearned + unscored // self.group_size


def pause_reason(knobs: Knobs, backlog: int | None, own_version: int, newest_version: int) -> str:
    """Why the next batch must wait ('' = go). ``backlog`` None means the limit is off (not measured)."""
    if knobs.max_backlog_groups > 0 and backlog is not None and backlog >= knobs.max_backlog_groups:
        return "backlog"
    if knobs.max_version_lag >= 0 and newest_version - own_version > knobs.max_version_lag:
        return "version_lag"
    return ""
