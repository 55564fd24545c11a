"""A broker restart is a pause, not a crash: producers and verifiers keep running through it, rejoin their groups
and continue from committed offsets, and every prompt fed before, during and after the outage is scored; and a
quiet one: each role says once that the broker is gone and once that it is back."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_admin, make_consumer, make_producer, read_topic, send_acked
from grpo_core.topics import ensure_topics
from grpo_producers.config import ProducerConfig
from grpo_producers.service import Producer
from grpo_stream.broker import LocalBroker, restartable_port
from grpo_stream.tiny_model import build_tiny_model
from grpo_verifiers.config import VerifierConfig
from grpo_verifiers.service import Verifier

G = 2
pytestmark = pytest.mark.slow


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A broker of this test's own: it is stopped and started again mid-test."""
    ports: set[int] = set()
    b = LocalBroker(data_dir=tmp_path / "kafka", port=restartable_port(ports), controller_port=restartable_port(ports))
    b.up(fresh=True)
    try:
        yield b
    finally:
        b.down()


def feed(kafka: KafkaConfig, plan: PipelineContract, ids: range) -> None:
    producer = make_producer(kafka, "test")
    for i in ids:
        task = wire.PromptTask(prompt_id=f"q{i}", prompt=f"max({i % 10},{(i * 7) % 10})=", task="exact",
                               metadata={"answer": str(max(i % 10, (i * 7) % 10))})
        producer.send(plan.topic("prompts"), key=task.prompt_id.encode(), value=wire.encode(task))
    producer.flush()
    producer.close()


def scored(kafka: KafkaConfig, plan: PipelineContract, want: int, timeout_s: float) -> set[str]:
    consumer = make_consumer(kafka, "test", None, [plan.topic("groups")])
    ids: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(ids) < want and time.monotonic() < deadline:
        for msgs in consumer.poll(timeout_ms=500).values():
            ids |= {wire.decode(m.value, wire.ScoredGroup).prompt_id for m in msgs}
    consumer.close()
    return ids


class Service:
    """A service's run loop on a thread, remembering whatever ended it."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self.thread.start()

    def _main(self, run: Callable[[], object]) -> None:
        try:
            run()
        except BaseException as exc:  # the test reports it: a service must not die of an outage
            self.error = exc


def _role_configs(broker: LocalBroker, tmp_path: Path, run: str) -> tuple[KafkaConfig, PipelineContract]:
    """Topics of run ``run`` on ``broker``, and a producer's (p.yaml) and a verifier's (v.yaml) config for it."""
    kafka = KafkaConfig(bootstrap=broker.bootstrap)
    plan = PipelineContract(run=run, group_size=G, max_new_tokens=4)
    admin = make_admin(kafka)
    ensure_topics(admin, plan)
    admin.close()
    model = build_tiny_model(tmp_path / "model")
    common = {"kafka": to_dict(kafka), "pipeline": to_dict(plan), "metrics": {"port": -1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**common, "backend": {"kind": "hf", "model": str(model)},
                                                     "prompts_per_batch": 2, "backpressure_poll_s": 0.2,
                                                     "weights": {"fs": {"root": str(tmp_path / "w")}}}))
    (tmp_path / "v.yaml").write_text(yaml.safe_dump({**common, "rewards": {"workers": 1}}))
    return kafka, plan


def test_producer_and_verifier_survive_a_broker_restart(broker: LocalBroker, tmp_path: Path) -> None:
    kafka, plan = _role_configs(broker, tmp_path, "outage")
    producer = Producer(load_config(ProducerConfig, tmp_path / "p.yaml"))
    verifier = Verifier(load_config(VerifierConfig, tmp_path / "v.yaml"))
    services = [Service(producer.run), Service(verifier.run)]
    try:
        feed(kafka, plan, range(0, 10))
        assert len(scored(kafka, plan, 10, 120)) == 10
        feed(kafka, plan, range(10, 20))  # in flight when the broker goes away
        broker.down()
        time.sleep(8)  # long enough for every client to notice: commits, fetches and sends fail meanwhile
        broker.up()
        feed(kafka, plan, range(20, 30))
        got = scored(kafka, plan, 30, 240)
        assert [s.error for s in services] == [None, None], "a service died of the outage"
        assert all(s.thread.is_alive() for s in services)
        assert got == {f"q{i}" for i in range(30)}, f"lost: {sorted({f'q{i}' for i in range(30)} - got)}"
    finally:
        producer.stop()
        verifier.stop()
        for s in services:
            s.thread.join(timeout=60)
        producer.close()
        verifier.close()


def test_a_send_waits_through_an_outage_longer_than_the_clients_delivery_timeout(broker: LocalBroker) -> None:
    """What every role's publish goes through (completions, groups, dead letters, announcements, prompts): the
    client gives up on a record after delivery_timeout_ms (2 minutes by default; 3 s here) and the send used to
    raise then, killing the role; now it is sent again once the broker is back."""
    kafka = KafkaConfig(bootstrap=broker.bootstrap)
    plan = PipelineContract(run="acked", group_size=G)
    admin = make_admin(kafka)
    ensure_topics(admin, plan)
    admin.close()
    producer = make_producer(kafka, "test", delivery_timeout_ms=3000, request_timeout_ms=1000, linger_ms=0)
    outcome: list[object] = []
    try:
        broker.down()
        sender = threading.Thread(target=lambda: outcome.append(
            send_acked(producer, plan.topic("dlq"), b"through the outage", b"k", "test")), daemon=True)
        sender.start()
        time.sleep(9)  # three delivery timeouts
        assert sender.is_alive() and not outcome, "the send gave up during the outage"
        broker.up()
        sender.join(timeout=120)
        assert outcome and not sender.is_alive()
    finally:
        producer.close()
    values = [m.value for m in read_topic(kafka, plan.topic("dlq"))]
    assert b"through the outage" in values


ABOVE_INFO = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) |^Traceback ")


def _start_role(role: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own handle
        return subprocess.Popen([sys.executable, "-m", "grpo_stream.cli", role, "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT)


def test_a_broker_outage_is_one_warning_and_one_info_per_role(broker: LocalBroker, tmp_path: Path) -> None:
    """A 10 s outage under real role processes, as an operator reads their logs: each role writes at most 5
    lines above INFO for it (one WARNING when the broker stops answering), and one INFO with the outage's length
    once it answers again; kafka-python's own connection errors stay out of the log."""
    kafka, plan = _role_configs(broker, tmp_path, "quiet")
    logs = {"producer": tmp_path / "producer.log", "verifier": tmp_path / "verifier.log"}
    procs = {role: _start_role(role, tmp_path / f"{role[0]}.yaml", logs[role]) for role in logs}
    try:
        feed(kafka, plan, range(0, 6))
        assert len(scored(kafka, plan, 6, 240)) == 6, {r: logs[r].read_text()[-2000:] for r in logs}
        before = {role: len(logs[role].read_bytes()) for role in logs}
        broker.down()
        time.sleep(10)
        broker.up()
        feed(kafka, plan, range(6, 12))
        assert len(scored(kafka, plan, 12, 240)) == 12
        assert [p.poll() for p in procs.values()] == [None, None], "a role died of the outage"
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for role, log in logs.items():
        lines = log.read_bytes()[before[role]:].decode(errors="replace").splitlines()
        loud = [line for line in lines if ABOVE_INFO.search(line)]
        assert len(loud) <= 5, f"{role}: {len(loud)} lines above INFO for one outage:\n" + "\n".join(loud[:40])
        assert sum("is not answering" in line for line in loud) == 1, f"{role}: " + "\n".join(loud)
        back = [line for line in lines if " INFO " in line and "answers again after" in line]
        assert len(back) == 1, f"{role}: " + "\n".join(lines[-60:])
        assert not any(" kafka." in line for line in loud), f"{role}: kafka-python's own log: " + "\n".join(loud)
