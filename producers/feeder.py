"""The feeder: publishes a dataset's prompts as PromptTasks to the prompts topic (``grpo-stream feed``).

One PromptTask per (prompt, epoch, sample round) -- one GRPO group each, group id
``make_group_id(prompt_id, epoch, round)`` -- keyed by prompt id. Within an epoch the order is round by round
(every prompt once, then again for round 1, ...), each round a permutation seeded by (seed, epoch, round), so a
run is reproducible and no prompt's samples bunch up.

Resuming: the cursor (epoch, position in that epoch's schedule) is written atomically to ``state_path`` every
``flush_every`` records, and only after the broker acknowledged every record before it (flush, then each
future's result). A restart therefore never re-publishes an acknowledged record that a saved state covers. What
it may re-publish: the records sent after the last saved state when the process died (at most ``flush_every``
of them); they carry the same group ids, which the producers and the learner deduplicate. A clean stop
(epochs done, ``max_records``, SIGTERM/SIGINT) saves the exact cursor, so nothing is repeated.

The state also stores a fingerprint of the schedule (item ids, seed, shuffle, sample rounds): resuming a
position in a different schedule would silently skip or repeat prompts, so a mismatch is refused with advice.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_core import wire
from grpo_core.config import (
    ConfigError,
    load_config,
    require,
)
from grpo_core.kafka_io import (
    BrokerError,
    SendFuture,
    acked,
    consumer_lag,
    make_admin,
    make_producer,
    partitions_of,
    with_retry,
)
from grpo_core.process import serve
from grpo_producers.datasets import (
    LOADERS,
    DatasetItem,
)
from grpo_producers.feeder_config import FeederConfig
from grpo_producers.feeder_metrics import FeederMetrics

log = logging.getLogger("feeder")
STATE_VERSION = 1
_BAD_LOG_LIMIT = 10  # log this many bad items per reason verbatim; the rest are only counted


# ------------------------------------------------------------------------------------------ metrics, bad items


class BadItems:
    """Counts skipped items by reason (metric + summary) and logs the first few of each with their location."""

    def __init__(self, metrics: FeederMetrics) -> None:
        self.metrics = metrics
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.metrics.bad.labels(reason=reason).inc()
        if self.counts[reason] <= _BAD_LOG_LIMIT:
            log.warning("skipped %s (%s)%s", where, reason,
                        "; further ones are only counted" if self.counts[reason] == _BAD_LOG_LIMIT else "")


def load_items(cfg: FeederConfig, on_bad: BadItems) -> list[DatasetItem]:
    """The source's items after the feeder's own checks (length cap, unique ids, encodable), in source order."""
    items: list[DatasetItem] = []
    seen: set[str] = set()
    for item in LOADERS[cfg.source](getattr(cfg, cfg.source), cfg.name, on_bad):
        if cfg.max_prompt_chars and len(item.prompt) > cfg.max_prompt_chars:
            on_bad("too_long", f"{item.prompt_id}: {len(item.prompt)} chars > max_prompt_chars")
        elif item.prompt_id in seen:
            # Same id twice = the same group ids twice: downstream would drop one anyway.
            on_bad("duplicate_id", f"{item.prompt_id}: id already seen")
        else:
            try:
                wire.encode(wire.PromptTask(item.prompt_id, item.prompt, item.task, metadata=item.metadata))
            except wire.WireError as exc:
                on_bad("unencodable", f"{item.prompt_id}: {exc}")
                continue
            seen.add(item.prompt_id)
            items.append(item)
    return items


# ------------------------------------------------------------------------------------------ schedule, state


def schedule_fingerprint(items: list[DatasetItem], cfg: FeederConfig) -> str:
    """What a saved position is relative to: the item ids in source order and the ordering settings."""
    h = hashlib.sha256(f"{cfg.seed}|{cfg.shuffle}|{cfg.sample_rounds}|".encode())
    for item in items:
        h.update(item.prompt_id.encode())
        h.update(b"\n")
    return h.hexdigest()


def round_order(n: int, seed: int, epoch: int, sample_round: int, shuffle: bool) -> list[int]:
    """Item indices for one (epoch, round): a permutation seeded by all three (stable across processes)."""
    order = list(range(n))
    if shuffle:
        digest = hashlib.sha256(f"{seed}:{epoch}:{sample_round}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


@dataclass
class FeederState:
    """The saved cursor: the next record to publish is (epoch, position) of the schedule."""

    fingerprint: str
    epoch: int = 0
    position: int = 0
    published_total: int = 0
    version: int = STATE_VERSION
    updated_at: float = 0.0


def load_state(path: Path, fingerprint: str, resume: bool) -> FeederState:
    """The saved cursor, a fresh one, or a ConfigError when the file belongs to another schedule."""
    if not resume or not path.exists():
        return FeederState(fingerprint)
    try:
        state = FeederState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"state_path: {path} is unreadable ({exc}); delete it or set resume=false") from None
    if state.fingerprint != fingerprint:
        raise ConfigError(f"state_path: {path} was written for another dataset or seed/shuffle/sample_rounds; "
                          "restore those, set resume=false to start over at epoch 0, or use another state_path")
    return state


def save_state(path: Path, state: FeederState) -> None:
    """Atomic replace (temp file, fsync, rename): a crash leaves the old state or the new, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state.updated_at = time.time()
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(state), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------ the feeder


class Feeder:
    """Publishes the schedule from the saved cursor on; see the module docstring for the resume contract."""

    def __init__(self, cfg: FeederConfig) -> None:
        self.cfg = cfg
        self.metrics = FeederMetrics()
        self.bad = BadItems(self.metrics)
        self.items = load_items(cfg, self.bad)
        require(bool(self.items), f"source {cfg.source}: no valid items (skipped: {dict(self.bad.counts)})")
        self.metrics.items.set(len(self.items))
        self.state_path = cfg.resolved_state_path()
        self.state = load_state(self.state_path, schedule_fingerprint(self.items, cfg), cfg.resume)
        self.epoch, self.position = self.state.epoch, self.state.position
        self.per_epoch = len(self.items) * cfg.sample_rounds
        self.topic = cfg.pipeline.topic("prompts")
        self.producer = make_producer(cfg.kafka, "feeder")
        self.admin = make_admin(cfg.kafka, "feeder-admin")
        try:
            partitions_of(self.admin, self.topic)
        except BrokerError as exc:
            self.close()
            raise ConfigError(f"topics.prompts.name: topic {self.topic!r} is not available ({exc}); "
                              "create the plan with `grpo-stream topics create`") from None
        self.pending: list[tuple[SendFuture, Callable[[], SendFuture]]] = []
        self.sent = 0
        self.stopping = False
        self._next_send_at = 0.0
        self._order_key: tuple[int, int] | None = None
        self._order: list[int] = []

    def stop(self) -> None:
        """Ask run() to save the state and return (safe from a signal handler: only sets a flag)."""
        self.stopping = True

    def health(self) -> tuple[bool, dict[str, Any]]:
        return not self.stopping, {"epoch": self.epoch, "position": self.position, "sent": self.sent}

    def run(self) -> int:
        """Publish until the epochs are done, ``max_records`` were sent or stop(); returns records sent."""
        self._roll_epoch()
        log.info("feeding %d items x %d rounds per epoch to %s from epoch %d position %d (epochs: %s)",
                 len(self.items), self.cfg.sample_rounds, self.topic, self.epoch, self.position,
                 self.cfg.epochs or "forever")
        while self._more_epochs() and not self._should_stop():
            self.metrics.epoch.set(self.epoch)
            self._publish_epoch()
            self._roll_epoch()
        self.checkpoint()
        done = not self._more_epochs()
        log.info("feeder %s after %d records this run (epoch %d, position %d; skipped %s)",
                 "finished" if done else "stopped", self.sent, self.epoch, self.position, dict(self.bad.counts))
        return self.sent

    def _more_epochs(self) -> bool:
        return self.cfg.epochs == 0 or self.epoch < self.cfg.epochs

    def _should_stop(self) -> bool:
        return self.stopping or 0 < self.cfg.max_records <= self.sent

    def _roll_epoch(self) -> None:
        if self.position >= self.per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def _publish_epoch(self) -> None:
        """Send the rest of the current epoch, checkpointing every ``flush_every`` records."""
        n = len(self.items)
        while self.position < self.per_epoch and not self._should_stop():
            if not self.pending and not self._wait_for_room():
                return
            if not self._pace():
                return
            sample_round, index = divmod(self.position, n)
            item = self.items[self._round_order(sample_round)[index]]
            self._send(item, sample_round)
            self.position += 1
            self.metrics.position.set(self.position)
            if len(self.pending) >= self.cfg.flush_every:
                self.checkpoint()

    def _round_order(self, sample_round: int) -> list[int]:
        if self._order_key != (self.epoch, sample_round):
            self._order_key = (self.epoch, sample_round)
            self._order = round_order(len(self.items), self.cfg.seed, self.epoch, sample_round, self.cfg.shuffle)
        return self._order

    def _send(self, item: DatasetItem, sample_round: int) -> None:
        task = wire.PromptTask(prompt_id=item.prompt_id, prompt=item.prompt, task=item.task, epoch=self.epoch,
                               sample_round=sample_round, metadata=item.metadata, created_at=wire.now())
        send = functools.partial(self.producer.send, self.topic, key=item.prompt_id.encode(), value=wire.encode(task))
        self.pending.append((send(), send))
        self.sent += 1

    def checkpoint(self) -> None:
        """Wait until the broker acknowledged everything sent, then save the cursor (that order is the point)."""
        if self.pending:
            for future, send in self.pending:  # through a broker outage: a pause, then the state is saved
                acked(future, send, f"feeder: {self.topic}")
                self.metrics.published.inc()
            self.state.published_total += len(self.pending)
            self.pending.clear()
        self.state.epoch, self.state.position = self.epoch, self.position
        save_state(self.state_path, self.state)

    def _pace(self) -> bool:
        """Rate limit as a token bucket of depth one: records evenly spaced, no burst after an idle spell."""
        if self.cfg.rate_limit_per_s <= 0:
            return True
        now = time.monotonic()
        if self._next_send_at > now and not self._sleep(self._next_send_at - now):
            return False
        self._next_send_at = max(self._next_send_at, time.monotonic()) + 1.0 / self.cfg.rate_limit_per_s
        return True

    def _wait_for_room(self) -> bool:
        """Backpressure (``max_ahead``): wait while the producers' group lags this far behind the topic."""
        if not self.cfg.max_ahead:
            return True
        while not self.stopping:
            # Retried: a young cluster answers CoordinatorNotAvailable until its offsets topic exists.
            group = self.cfg.pipeline.group("producers")
            # (mypy cannot infer a lambda with a default argument: the ignore below)
            lag = with_retry(lambda g=group: consumer_lag(self.admin, g, self.topic),  # type: ignore[misc]
                             f"feeder: lag of {group}")
            ahead = sum(lag.values())
            self.metrics.ahead.set(ahead)
            if ahead < self.cfg.max_ahead:
                return True
            self._sleep(self.cfg.lag_poll_s)
        return False

    def _sleep(self, seconds: float) -> bool:
        """Sleep in short slices so stop() takes effect quickly; False when stopped."""
        end = time.monotonic() + seconds
        while not self.stopping:
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.1))
        return False

    def close(self) -> None:
        self.producer.close()
        self.admin.close()


def main(config: str | None, overrides: list[str], pipeline: str | None = None) -> int:
    """``grpo-stream feed``: run until the epochs are exhausted (exit 0) or SIGTERM/SIGINT (state saved, exit 0)."""
    cfg = load_config(FeederConfig, config, overrides, pipeline_file=pipeline)
    feeder = Feeder(cfg)
    return serve(feeder.metrics.registry, cfg.metrics, feeder.health, feeder.run, feeder.stop, feeder.close,
                 "saving progress after the broker acknowledges what was sent")
