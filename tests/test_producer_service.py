"""The producer on a real broker with the HF backend and a tiny local model: offset-based backpressure (and its
live knobs), weight hot-swap, bad prompts, kill -9 recovery, and two producers sharing one consumer group."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from kafka import KafkaAdminClient, TopicPartition
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import commit_processed, committed_offsets, end_offsets, make_consumer, make_producer
from grpo_core.weights import WeightPublisher
from grpo_producers.config import ProducerConfig
from grpo_producers.service import Producer
from grpo_stream.tiny_model import build_tiny_model

G = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _cfg(model_dir: Path, kafka_cfg: KafkaConfig, plan: PipelineContract, tmp_path: Path,
         *extra: str) -> ProducerConfig:
    base = {"kafka": {"bootstrap": kafka_cfg.bootstrap}, "metrics": {"port": -1},
            "pipeline": {**to_dict(plan), "group_size": G, "max_new_tokens": 8},
            "backend": {"kind": "hf", "model": str(model_dir)},
            "weights": {"kind": "fs", "fs": {"root": str(tmp_path / "weights")}}, "prompts_per_batch": 2,
            "backpressure_poll_s": 0.2}
    path = tmp_path / f"producer-{len(list(tmp_path.glob('producer-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_config(ProducerConfig, path, list(extra))


def other_weights(tmp_path: Path) -> dict[str, Path]:
    """A second tiny model's weights as a learner publishes them (``model.safetensors``, the tied head left out)."""
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "other", seed=7))
    (tmp_path / "w").mkdir()
    path = tmp_path / "w" / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, path,
              metadata={"format": "pt"})
    return {"model.safetensors": path}


def publisher_for(cfg: ProducerConfig, kafka_cfg: KafkaConfig, contract: str | None = None) -> WeightPublisher:
    """A learner's publisher for the producer's run (its contract, unless another digest is given)."""
    return WeightPublisher(cfg.weights, kafka_cfg, cfg.pipeline.topic("weights"), cfg.pipeline.topic("weight_data"),
                           cfg.pipeline.run, contract=cfg.pipeline.digest() if contract is None else contract)


def feed(kafka_cfg: KafkaConfig, plan: PipelineContract, n: int, start: int = 0, extra: list[bytes] = ()) -> list[str]:
    producer = make_producer(kafka_cfg, "test")
    ids = []
    for i in range(start, start + n):
        task = wire.PromptTask(prompt_id=f"q{i}", prompt=f"max({i % 10},{(i * 7) % 10})=", task="exact",
                               metadata={"answer": str(max(i % 10, (i * 7) % 10))})
        producer.send(plan.topic("prompts"), key=task.prompt_id.encode(), value=wire.encode(task))
        ids.append(task.group_id)
    for raw in extra:
        producer.send(plan.topic("prompts"), key=b"bad", value=raw)
    producer.flush()
    producer.close()
    return ids


def completions(kafka_cfg: KafkaConfig, topic: str, settle_s: float = 1.5) -> list[wire.Completion]:
    consumer = make_consumer(kafka_cfg, "test", None, [topic])
    out, quiet_since = [], time.monotonic()
    while time.monotonic() - quiet_since < settle_s:
        got = [m for msgs in consumer.poll(timeout_ms=200).values() for m in msgs]
        if got:
            quiet_since = time.monotonic()
        out += [wire.decode(m.value, wire.Completion) for m in got]
    consumer.close()
    return out


def wait_for(pred: Callable[[], bool], timeout_s: float = 90, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Running:
    """A Producer in a background thread (in-process, so tests can read its metrics)."""

    def __init__(self, cfg: ProducerConfig) -> None:
        self.producer = Producer(cfg)
        self.thread = threading.Thread(target=self.producer.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.producer.stopping = True
        self.thread.join(timeout=60)
        self.producer.close()


@pytest.fixture
def running() -> Iterator[Callable[[ProducerConfig], Running]]:
    started: list[Running] = []

    def start(cfg: ProducerConfig) -> Running:
        started.append(Running(cfg))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def _count(kafka_cfg: KafkaConfig, admin: KafkaAdminClient, topic: str) -> int:
    return sum(end_offsets(admin, topic, range(4)).values())


def test_backpressure_stops_at_the_backlog_and_resumes(model_dir: Path, kafka_cfg: KafkaConfig,
                                                       admin: KafkaAdminClient, plan: PipelineContract,
                                                       tmp_path: Path, running: Callable) -> None:
    control = tmp_path / "knobs.yaml"
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, "max_backlog_groups=6", f"control_file={control}")
    feed(kafka_cfg, plan, 40)
    r = running(cfg)
    topic = plan.topic("completions")
    # Nobody scores completions: the backlog grows 2 groups per batch and generation stops at 6 (+ one batch).
    wait_for(lambda: r.producer.metrics.paused.labels(reason="backlog")._value.get() > 0, what="a pause")
    time.sleep(1.5)
    assert 6 * G <= _count(kafka_cfg, admin, topic) <= (6 + 2) * G
    # Live knob: a larger limit in the control file lets it go on, without a restart.
    control.write_text("max_backlog_groups: 10\n")
    wait_for(lambda: _count(kafka_cfg, admin, topic) >= 10 * G, what="resume after the knob change")
    time.sleep(1.5)
    assert _count(kafka_cfg, admin, topic) <= (10 + 2) * G
    # Offsets advancing (the verifiers consume everything) also resumes it.
    verifier = make_consumer(kafka_cfg, "test", cfg.pipeline.group("verifiers"))
    ends = end_offsets(admin, topic, range(4))
    verifier.assign([TopicPartition(topic, p) for p in ends])
    commit_processed(verifier, {TopicPartition(topic, p): o for p, o in ends.items()})
    verifier.close()
    before = sum(ends.values())
    wait_for(lambda: _count(kafka_cfg, admin, topic) > before, what="resume after offsets advanced")


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_hot_swap_stamps_the_new_version_and_survives_a_corrupt_file(model_dir: Path, kafka_cfg: KafkaConfig,
                                                                      plan: PipelineContract, tmp_path: Path,
                                                                      running: Callable) -> None:
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path)
    publisher = publisher_for(cfg, kafka_cfg)
    files = other_weights(tmp_path)
    bad = publisher.publish(3, files)
    (tmp_path / "weights" / bad.location).write_bytes(b"corrupt")
    publisher.announce(bad)
    r = running(cfg)
    feed(kafka_cfg, plan, 4, start=0)
    wait_for(lambda: r.producer.metrics.weight_errors._value.get() >= 1, what="a failed fetch")
    wait_for(lambda: r.producer.batches >= 2, what="batches with the old weights")
    good = publisher.publish(5, files)
    publisher.announce(good)
    wait_for(lambda: r.producer.weights.version == 5, what="the swap")
    feed(kafka_cfg, plan, 4, start=100)
    wait_for(lambda: r.producer.batches >= 4, what="batches with the new weights")
    publisher.close()
    got = completions(kafka_cfg, plan.topic("completions"))
    versions = {c.group_id: c.policy_version for c in got}
    assert {versions[f"q{i}@e0r0"] for i in range(4)} == {0}, "the corrupt v3 must not have been used"
    assert {versions[f"q{i}@e0r0"] for i in range(100, 104)} == {5}
    for gid in versions:  # one version per group
        assert len({c.policy_version for c in got if c.group_id == gid}) == 1
    assert r.producer.metrics.swap_latency._sum.get() > 0


def test_hot_swap_from_the_kafka_store_uses_the_streamed_copy(model_dir: Path, kafka_cfg: KafkaConfig,
                                                               plan: PipelineContract, tmp_path: Path,
                                                               running: Callable) -> None:
    """No shared volume: the weights travel as chunks on the weight-data topic. The producer's stream assembles
    them while they are published, so the swap after the announcement does not download them again."""
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, "weights.kind=kafka", "weights.kafka.chunk_bytes=262144")
    r = running(cfg)
    feed(kafka_cfg, plan, 2, start=0)
    wait_for(lambda: r.producer.batches >= 1, what="a batch with the initial weights")
    files = other_weights(tmp_path)
    publisher = publisher_for(cfg, kafka_cfg)
    ann = publisher.publish(2, files)
    assert ann.store == "kafka" and ann.num_chunks > 1
    publisher.announce(ann)
    publisher.close()
    wait_for(lambda: r.producer.weights.version == 2, what="the swap")
    feed(kafka_cfg, plan, 2, start=100)
    wait_for(lambda: r.producer.batches >= 2, what="a batch with the new weights")
    stream = r.producer.weights.fetcher.stream
    assert stream is not None and stream.hits == 1
    versions = {c.group_id: c.policy_version for c in completions(kafka_cfg, plan.topic("completions"))}
    assert {versions[f"q{i}@e0r0"] for i in (100, 101)} == {2}


def test_bad_prompts_go_to_the_dlq(model_dir: Path, kafka_cfg: KafkaConfig, plan: PipelineContract, tmp_path: Path,
                                   running: Callable) -> None:
    long_prompt = wire.encode(wire.PromptTask(prompt_id="long", prompt="9" * 2000, task="exact"))
    empty = wire.encode(wire.PromptTask(prompt_id="empty", prompt="   ", task="exact"))
    ids = feed(kafka_cfg, plan, 3, extra=[b"\x01garbage", long_prompt, empty])
    running(_cfg(model_dir, kafka_cfg, plan, tmp_path))
    wait_for(lambda: len({c.group_id for c in completions(kafka_cfg, plan.topic("completions"), 0.5)}) == 3,
             what="the good prompts")
    letters = [wire.decode(m.value, wire.DeadLetter) for m in _all(kafka_cfg, plan.topic("dlq"), 3)]
    reasons = " | ".join(d.reason for d in letters)
    assert "not msgpack" in reasons and "prompt_too_long" in reasons and "empty_prompt" in reasons
    assert sorted({c.group_id for c in completions(kafka_cfg, plan.topic("completions"))}) == sorted(ids)


def _all(kafka_cfg: KafkaConfig, topic: str, n: int) -> list:
    consumer = make_consumer(kafka_cfg, "test", None, [topic])
    out: list = []
    deadline = time.monotonic() + 60
    while len(out) < n and time.monotonic() < deadline:
        out += [m for msgs in consumer.poll(timeout_ms=300).values() for m in msgs]
    consumer.close()
    return out


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_two_producers_split_the_prompts_without_doing_one_twice(model_dir: Path, kafka_cfg: KafkaConfig,
                                                                 plan: PipelineContract, tmp_path: Path,
                                                                 running: Callable) -> None:
    a = running(_cfg(model_dir, kafka_cfg, plan, tmp_path, "producer_id=A"))
    b = running(_cfg(model_dir, kafka_cfg, plan, tmp_path, "producer_id=B"))
    # Steady state: both members hold partitions before prompts flow (a rebalance may legitimately re-deliver).
    wait_for(lambda: a.producer.prompts.assignment() and b.producer.prompts.assignment(), what="assignments")
    ids = feed(kafka_cfg, plan, 30)
    wait_for(lambda: len({c.group_id for c in completions(kafka_cfg, plan.topic("completions"), 0.5)}) == 30,
             what="all groups")
    got = completions(kafka_cfg, plan.topic("completions"))
    identities = Counter((c.group_id, c.index) for c in got)
    assert set(identities) == {(g, i) for g in ids for i in range(G)}
    assert max(identities.values()) == 1, "a prompt was generated twice"
    assert {c.producer_id for c in got} == {"A", "B"}


@pytest.mark.slow
def test_kill9_mid_stream_loses_no_prompt(model_dir: Path, kafka_cfg: KafkaConfig, admin: KafkaAdminClient,
                                          plan: PipelineContract, tmp_path: Path) -> None:
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, "idle_timeout_s=8")
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    ids = feed(kafka_cfg, plan, 60)
    cmd = [sys.executable, "-m", "grpo_stream.cli", "producer", "--config", str(path)]
    log = (tmp_path / "producer.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: _count(kafka_cfg, admin, plan.topic("completions")) >= 10, what="some completions")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _count(kafka_cfg, admin, plan.topic("completions")) < 60 * G, "killed too late to test anything"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    assert proc.wait(timeout=240) == 0
    got = completions(kafka_cfg, plan.topic("completions"))
    identities = Counter((c.group_id, c.index) for c in got)
    assert set(identities) == {(g, i) for g in ids for i in range(G)}, "every prompt's whole group is there"
    # Duplicates are possible (the interrupted batch is redone) and are told apart by their attempt id.
    for (gid, index), n in identities.items():
        if n > 1:
            attempts = {c.metadata["attempt"] for c in got if (c.group_id, c.index) == (gid, index)}
            assert len(attempts) == n


def test_weights_from_a_learner_with_another_contract_are_refused(model_dir: Path, kafka_cfg: KafkaConfig,
                                                                   plan: PipelineContract, tmp_path: Path,
                                                                   running: Callable) -> None:
    """A learner whose pipeline contract differs (here: another G) announces weights: the producer never loads
    them, says why naming both digests, and its /health turns unhealthy."""
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path)
    theirs = dataclasses.replace(cfg.pipeline, group_size=G + 1)
    publisher = publisher_for(cfg, kafka_cfg, contract=theirs.digest())
    files = other_weights(tmp_path)
    publisher.announce(publisher.publish(4, files))
    publisher.close()
    r = running(cfg)
    feed(kafka_cfg, plan, 2)
    wait_for(lambda: bool(r.producer.weights.refused), what="the refusal")
    assert theirs.digest() in r.producer.weights.refused and cfg.pipeline.digest() in r.producer.weights.refused
    wait_for(lambda: r.producer.batches >= 1, what="a batch")
    assert r.producer.weights.version == 0
    assert {c.policy_version for c in completions(kafka_cfg, plan.topic("completions"))} == {0}


def test_a_restarted_producer_generates_with_the_newest_weights_from_its_first_batch(
        model_dir: Path, kafka_cfg: KafkaConfig, plan: PipelineContract, tmp_path: Path, running: Callable) -> None:
    """The learner is at v6 when a producer (re)starts: it reads the compacted weights topic to its end and swaps
    before generating, instead of sending a first batch with its initial weights that the learner would drop."""
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path)
    publisher = publisher_for(cfg, kafka_cfg)
    files = other_weights(tmp_path)
    for version in (3, 6):
        publisher.announce(publisher.publish(version, files))
    publisher.close()
    feed(kafka_cfg, plan, 4)
    r = running(cfg)
    assert r.producer.weights.newest_version == 6  # known before the first batch
    wait_for(lambda: r.producer.batches >= 2, what="two batches")
    assert {c.policy_version for c in completions(kafka_cfg, plan.topic("completions"))} == {6}


def test_a_broken_engine_stops_the_producer_instead_of_dead_lettering_everything(
        model_dir: Path, kafka_cfg: KafkaConfig, plan: PipelineContract, tmp_path: Path) -> None:
    """Every batch fails: the first ones' prompts are dead-lettered (a bad prompt fails one batch), the health
    turns unhealthy, and at max_failed_batches the producer exits, leaving that batch's prompts uncommitted."""
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, "max_failed_batches=3")
    producer = Producer(cfg)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    producer.backend.generate = broken  # type: ignore[method-assign]
    feed(kafka_cfg, plan, 10)
    try:
        with pytest.raises(RuntimeError, match="failed for 3 batches in a row"):
            producer.run()
        assert producer.failed_batches == 3
        done = sum(committed_offsets(producer.admin, plan.group("producers"), plan.topic("prompts")).values())
    finally:
        producer.close()
    # Two failed batches (of up to 2 prompts) were dead-lettered and committed; the third was left for others.
    assert 2 <= done <= 4
    letters = [wire.decode(m.value, wire.DeadLetter) for m in _all(kafka_cfg, plan.topic("dlq"), done)]
    assert len(letters) == done and all(d.reason.startswith("generation_error") for d in letters)


CHAT = ("{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}")


@pytest.mark.parametrize("chat_template", [True, False])
def test_a_prompt_becomes_token_ids_with_or_without_the_chat_template(model_dir: Path, chat_template: bool) -> None:
    """With apply_chat_template the prompt is the user turn of the template plus the generation prompt, as a list
    of ints: transformers 5's apply_chat_template returns a BatchEncoding by default, which was taken for the ids."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT
    fake = SimpleNamespace(cfg=SimpleNamespace(apply_chat_template=chat_template), tokenizer=tokenizer,
                           backend=SimpleNamespace(max_context=lambda: 512), sampling=SimpleNamespace(max_tokens=8))
    task = wire.PromptTask(prompt_id="p", prompt="last(372)=", task="last_digit")
    ids, reason = Producer._prompt_ids(fake, task)  # type: ignore[arg-type]
    text = "<u>last(372)=</u><a>" if chat_template else "last(372)="
    want = tokenizer(text, add_special_tokens=not chat_template)["input_ids"]
    assert reason == "" and ids == want and all(type(t) is int for t in ids)
