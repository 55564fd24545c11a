"""The grpo-stream CLI as a user runs it (subprocesses, real broker)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from grpo_stream.broker import free_port

CLI = [sys.executable, "-m", "grpo_stream.cli"]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}: {proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.integration
def test_kafka_up_status_down(tmp_path: Path) -> None:
    port, ctl = free_port(), free_port()
    common = ["--data-dir", str(tmp_path / "k"), "--port", str(port), "--controller-port", str(ctl)]
    try:
        out = run("kafka", "up", *common).stdout
        assert f"bootstrap 127.0.0.1:{port}" in out
        status = json.loads(run("kafka", "status", *common).stdout)
        assert status["running"] is True and status["bootstrap"] == f"127.0.0.1:{port}"
        assert status["version"].startswith("4.3.") and isinstance(status["pid"], int)
        assert "kafka stopped" in run("kafka", "down", *common).stdout
        assert json.loads(run("kafka", "status", *common).stdout)["running"] is False
    finally:
        run("kafka", "down", *common, check=False)


def test_kafka_up_on_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run("kafka", "up", "--data-dir", str(tmp_path / "k"), "--port", str(port), check=False)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port} is already in use" in proc.stderr and "Traceback" not in proc.stderr


def test_topics_create_against_the_session_broker(kafka_bootstrap: str, unique: Callable) -> None:
    run_name = unique("cli")
    first = run("topics", "create", "--pipeline", "configs/pipeline.yaml", f"kafka.bootstrap={kafka_bootstrap}",
                f"pipeline.run={run_name}")
    assert first.stdout.count("created") == 6 and f"{run_name}.groups: created" in first.stdout
    second = run("topics", "create", f"kafka.bootstrap={kafka_bootstrap}", f"pipeline.run={run_name}")
    assert second.stdout.count("exists, matches the plan") == 6
    bad = run("topics", "create", f"kafka.bootstrap={kafka_bootstrap}", f"pipeline.run={run_name}",
              "pipeline.topics.groups.partitions=9", check=False)
    assert bad.returncode == 2 and "partitions is 4, plan says 9" in bad.stderr


def test_bad_override_is_a_clear_error() -> None:
    proc = run("topics", "create", "pipeline.topics.groups.partitionz=3", check=False)
    assert proc.returncode == 2 and "did you mean 'partitions'" in proc.stderr


@pytest.mark.parametrize(("role", "key"), [("topics", "pipeline.topics.groups.partitions = 4"),
                                           ("learner", "publish_every = 1"), ("producer", "max_backlog_groups = 0"),
                                           ("verifier", "group_timeout_s = 300.0"), ("feeder", "epochs = 1")])
def test_config_explain(role: str, key: str) -> None:
    assert key in run("config", "explain", role).stdout


def test_config_explain_without_a_role_is_one_line() -> None:
    proc = run("config", "explain", check=False)
    assert proc.returncode == 2 and "name a role" in proc.stderr and "Traceback" not in proc.stderr


def test_kafka_operator_tools_reset_a_consumer_group(kafka_bootstrap: str, new_topic: Callable,
                                                     unique: Callable) -> None:
    """Kafka's own consumer-group tool runs from the fetched jars: an operator can see and reset a group."""
    from grpo_core.config import KafkaConfig
    from grpo_core.kafka_io import Partition, commit_processed, committed_offsets, make_admin, make_consumer

    kafka = KafkaConfig(bootstrap=kafka_bootstrap)
    topic, group = new_topic("prompts"), unique("producers")
    consumer = make_consumer(kafka, "test", group)
    commit_processed(consumer, {Partition(topic, 0): 5})
    consumer.close()
    described = run("kafka-tool", "consumer-groups", "--bootstrap-server", kafka_bootstrap, "--describe",
                    "--group", group)
    assert topic in described.stdout
    run("kafka-tool", "consumer-groups", "--bootstrap-server", kafka_bootstrap, "--reset-offsets", "--group", group,
        "--topic", topic, "--to-earliest", "--execute")
    admin = make_admin(kafka)
    try:
        assert committed_offsets(admin, group, topic) == {0: 0}
    finally:
        admin.close()


def test_kafka_tool_without_the_jars_says_run_setup(tmp_path: Path) -> None:
    proc = run("kafka-tool", "--jars", str(tmp_path), "topics", "--list", check=False)
    assert proc.returncode == 2 and "Kafka's tools are missing" in proc.stderr and "ops/setup.sh" in proc.stderr
