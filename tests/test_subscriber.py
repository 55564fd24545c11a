"""The producer's weight subscription takes the newest good version: a version that fails while a newer one is
announced is passed over at once (not retried with backoff), a learner that resumed from an older checkpoint is
followed at the same version number, and /health reports a producer left behind for too long.

A version's identity is (version, incarnation): the tests of that run on an in-memory weights topic and a fake
fetcher (what is decided is which announcement to load, not how bytes move)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import Partition, make_consumer
from grpo_core.weights import FsStoreConfig, WeightFetcher, WeightFetchError, WeightPublisher, WeightStoreConfig
from grpo_core.weights.subscriber import LagWatch, WeightSubscriber


def _blob(path: Path, seed: int) -> dict[str, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(seed).bytes(4096))
    return {"model.safetensors": path}


@pytest.fixture
def pair(kafka_cfg: KafkaConfig, new_topic: Callable[..., str], tmp_path: Path
         ) -> Iterator[tuple[WeightPublisher, WeightSubscriber]]:
    # The retries of one version add up to 0.5 + 1 + 2 + 4 + 8 = 15.5 s: what waiting on a dead version costs.
    cfg = WeightStoreConfig(fs=FsStoreConfig(root=str(tmp_path / "store")), fetch_retries=5, fetch_backoff_s=0.5)
    weights = new_topic("weights", 1, {"cleanup.policy": "compact"})
    publisher = WeightPublisher(cfg, kafka_cfg, weights, "unused", "run-a")
    fetcher = WeightFetcher(cfg, kafka_cfg, "unused")
    subscriber = WeightSubscriber(make_consumer(kafka_cfg, "test-weights", None), weights, "run-a", fetcher, 0,
                                  lag=LagWatch(2, 60.0))
    yield publisher, subscriber
    publisher.close()
    subscriber.consumer.close()
    fetcher.close()


def _poll_until(subscriber: WeightSubscriber, version: int) -> None:
    deadline = time.monotonic() + 30
    while subscriber.newest_version != version:
        assert time.monotonic() < deadline, f"v{version} was never announced"
        subscriber.poll(timeout_ms=100)


def test_a_dead_version_is_passed_over_as_soon_as_a_newer_one_is_announced(
        pair: tuple[WeightPublisher, WeightSubscriber], tmp_path: Path) -> None:
    publisher, subscriber = pair
    bad = publisher.publish(3, _blob(tmp_path / "a" / "model.safetensors", 1))
    Path(publisher.cfg.fs.root, bad.location).write_bytes(b"corrupt")  # damaged in the store
    publisher.announce(bad)
    _poll_until(subscriber, 3)
    good = publisher.publish(5, _blob(tmp_path / "b" / "model.safetensors", 2))
    loaded: list[tuple[str, int]] = []
    later = threading.Timer(0.3, publisher.announce, [good])
    later.start()
    t0 = time.monotonic()
    swap = subscriber.maybe_swap(lambda model_dir, version: loaded.append((model_dir.name, version)))
    waited = time.monotonic() - t0
    later.join()
    assert swap is not None and swap.version == 5
    assert loaded == [(Path(good.location).parent.name, 5)]  # the load is told the version it loads
    assert subscriber.version == 5 and subscriber.skipped == 1
    assert waited < 3.0, f"waited {waited:.1f}s on a dead version while a newer one was announced"


def test_the_newest_failing_is_reported_and_not_retried_at_once(pair: tuple[WeightPublisher, WeightSubscriber],
                                                                tmp_path: Path) -> None:
    publisher, subscriber = pair
    subscriber.fetcher.cfg.fetch_retries, subscriber.fetcher.cfg.fetch_backoff_s = 1, 0.01
    bad = publisher.publish(4, _blob(tmp_path / "a" / "model.safetensors", 1))
    Path(publisher.cfg.fs.root, bad.location).unlink()  # garbage-collected
    publisher.announce(bad)
    _poll_until(subscriber, 4)
    with pytest.raises(WeightFetchError, match="missing"):
        subscriber.maybe_swap(lambda model_dir, version: None)
    assert subscriber.maybe_swap(lambda model_dir, version: None) is None  # within retry_after_s: not again
    assert subscriber.version == 0 and subscriber.skipped == 0


def test_the_same_version_with_other_bytes_is_loaded(pair: tuple[WeightPublisher, WeightSubscriber],
                                                     tmp_path: Path) -> None:
    """A learner that fell back to an older checkpoint trains the same steps again and announces the same version
    numbers with other weights: the producer must load them, not keep the ones it had."""
    publisher, subscriber = pair
    first = publisher.publish(6, _blob(tmp_path / "a" / "model.safetensors", 1))
    publisher.announce(first)
    _poll_until(subscriber, 6)
    assert subscriber.maybe_swap(lambda model_dir, version: None) is not None
    again = publisher.publish(6, _blob(tmp_path / "b" / "model.safetensors", 2))
    publisher.announce(again)
    deadline = time.monotonic() + 30
    while subscriber.newest is None or subscriber.newest.sha256 != again.sha256:
        assert time.monotonic() < deadline
        subscriber.poll(timeout_ms=100)
    swap = subscriber.maybe_swap(lambda model_dir, version: None)
    assert swap is not None and subscriber.sha256 == again.sha256
    assert subscriber.maybe_swap(lambda model_dir, version: None) is None


class MemoryTopic:
    """The weights topic as the subscriber's consumer sees it: announcements appended, each polled once."""

    def __init__(self) -> None:
        self.records: list[SimpleNamespace] = []
        self.read = 0

    def announce(self, version: int, incarnation: int, sha: str) -> wire.WeightsAnnouncement:
        ann = wire.WeightsAnnouncement(run="run-a", version=version, store="fs", location=f"run-a/v{version}",
                                       sha256=sha * 64, size_bytes=4096, incarnation=incarnation)
        self.records.append(SimpleNamespace(value=wire.encode(ann), offset=len(self.records)))
        return ann

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps: list[Partition]) -> None:
        pass

    def seek_to_beginning(self, *tps: Partition) -> None:
        pass

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Partition, list[SimpleNamespace]]:
        new, self.read = self.records[self.read:], len(self.records)
        return {Partition("weights", 0): new} if new else {}


class FakeFetcher:
    """Fetches by writing nothing: returns a path naming the announcement; ``bad`` sha256 digits fail."""

    def __init__(self, root: Path, bad: str = "") -> None:
        self.root, self.bad = root, bad
        self.fetched: list[tuple[int, int, str]] = []

    def fetch(self, ann: wire.WeightsAnnouncement, superseded: Callable[[], bool] | None = None) -> Path:
        self.fetched.append((ann.version, ann.incarnation, ann.sha256[0]))
        if self.bad and ann.sha256[0] in self.bad:
            raise WeightFetchError(f"v{ann.version}: sha256 mismatch")
        return self.root / f"v{ann.version}-i{ann.incarnation}" / "model.safetensors"


def _memory_subscriber(tmp_path: Path, bad: str = "") -> tuple[MemoryTopic, FakeFetcher, WeightSubscriber]:
    topic, fetcher = MemoryTopic(), FakeFetcher(tmp_path, bad)
    subscriber = WeightSubscriber(topic, "weights", "run-a", fetcher, 0)  # type: ignore[arg-type]
    return topic, fetcher, subscriber


def _load_into(loaded: list[tuple[str, int]]) -> Callable[[Path, int], None]:
    return lambda model_dir, version: loaded.append((model_dir.name, version))


def test_a_new_incarnation_of_our_version_with_other_bytes_is_loaded(tmp_path: Path) -> None:
    """The learner crashed past its checkpoint and re-trained v12: the v12 we have died with incarnation 0."""
    topic, fetcher, subscriber = _memory_subscriber(tmp_path)
    topic.announce(12, 0, "a")
    subscriber.poll()
    loaded: list[tuple[str, int]] = []
    assert subscriber.maybe_swap(_load_into(loaded)) is not None
    assert (subscriber.version, subscriber.incarnation) == (12, 0) and not subscriber.outdated
    topic.announce(12, 1, "b")
    subscriber.poll()
    assert subscriber.outdated  # what the in-flight loop asks before it swaps
    swap = subscriber.maybe_swap(_load_into(loaded))
    assert swap is not None and (swap.version, swap.incarnation) == (12, 1)
    assert loaded == [("v12-i0", 12), ("v12-i1", 12)]
    assert (subscriber.version, subscriber.incarnation, subscriber.sha256) == (12, 1, "b" * 64)
    assert not subscriber.outdated and subscriber.maybe_swap(_load_into(loaded)) is None


def test_the_same_bytes_under_a_new_incarnation_are_adopted_without_a_reload(tmp_path: Path) -> None:
    """A restarted learner re-announcing its checkpoint's version names the bytes we already generate with."""
    topic, fetcher, subscriber = _memory_subscriber(tmp_path)
    topic.announce(12, 0, "a")
    subscriber.poll()
    assert subscriber.maybe_swap(lambda model_dir, version: None) is not None
    topic.announce(12, 1, "a")
    subscriber.poll()
    assert not subscriber.outdated
    assert subscriber.maybe_swap(lambda model_dir, version: None) is None
    assert fetcher.fetched == [(12, 0, "a")]
    assert (subscriber.version, subscriber.incarnation) == (12, 1)


def test_the_initial_weights_are_not_a_new_incarnations_version(tmp_path: Path) -> None:
    """The initial weights' bytes are unknown: v0 from incarnation 1 is loaded, v0 from incarnation 0 is ours."""
    topic, fetcher, subscriber = _memory_subscriber(tmp_path)
    topic.announce(0, 0, "a")
    subscriber.poll()
    assert subscriber.maybe_swap(lambda model_dir, version: None) is None and fetcher.fetched == []
    topic.announce(0, 1, "b")
    subscriber.poll()
    assert subscriber.maybe_swap(lambda model_dir, version: None) is not None
    assert (subscriber.version, subscriber.incarnation) == (0, 1)


def test_a_failed_incarnation_does_not_hold_back_the_next_one(tmp_path: Path) -> None:
    """v12@i0's bytes are gone (they died with the learner): v12@i1 is tried at once, not after retry_after_s."""
    topic, fetcher, subscriber = _memory_subscriber(tmp_path, bad="a")
    topic.announce(12, 0, "a")
    subscriber.poll()
    with pytest.raises(WeightFetchError):
        subscriber.maybe_swap(lambda model_dir, version: None)
    assert subscriber.maybe_swap(lambda model_dir, version: None) is None  # within retry_after_s: not again
    topic.announce(12, 1, "b")
    subscriber.poll()
    swap = subscriber.maybe_swap(lambda model_dir, version: None)
    assert swap is not None and (swap.version, swap.incarnation) == (12, 1)
    assert fetcher.fetched == [(12, 0, "a"), (12, 1, "b")]


def test_lag_watch_turns_unhealthy_only_after_the_grace_period() -> None:
    now = [0.0]
    watch = LagWatch(max_lag=2, grace_s=30.0, clock=lambda: now[0])
    watch.observe(version=4, newest=6)  # within the bound
    assert watch.check()[0]
    watch.observe(version=4, newest=118)
    now[0] = 29.0
    ok, detail = watch.check()
    assert ok and detail["version_lag"] == 114
    now[0] = 31.0
    ok, detail = watch.check()
    assert not ok and detail["behind_s"] == 31.0
    watch.observe(version=118, newest=118)  # caught up: healthy at once
    assert watch.check()[0]


@pytest.mark.parametrize(("max_lag", "grace_s"), [(-1, 30.0), (2, 0.0)])
def test_lag_watch_can_be_turned_off(max_lag: int, grace_s: float) -> None:
    now = [0.0]
    watch = LagWatch(max_lag=max_lag, grace_s=grace_s, clock=lambda: now[0])
    watch.observe(version=0, newest=100)
    now[0] = 1e6
    assert watch.check()[0]
