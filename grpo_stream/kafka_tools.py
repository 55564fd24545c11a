"""``grpo-stream kafka-tool NAME [ARGS...]``: Kafka's own operator tools, from the jars ``ops/setup.sh`` fetched.

The same programs as Kafka's ``bin/kafka-*.sh`` scripts (which the Maven jars do not ship), for any cluster:
inspect or reset consumer groups, describe topics, read records, list offsets. ``--bootstrap-server`` defaults
to ``$KAFKA_BOOTSTRAP``, else the local broker. Note the learner's rule: it resumes from its checkpoint, not from
its consumer group, so resetting the learner's group changes nothing (use ``skip_to``); resetting the producers'
or verifiers' groups does re-deliver or skip records for them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from grpo_stream.broker import DEFAULT_LIBS_DIR, LIBS_ENV, BrokerError, java_executable, jvm_performance_opts

TOOLS = {
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "topics": "org.apache.kafka.tools.TopicCommand",
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "get-offsets": "org.apache.kafka.tools.GetOffsetShell",
}


def tool_command(name: str, args: list[str], libs_dir: str | None, bootstrap: str | None) -> list[str]:
    """The java command line of one tool; BrokerError when the tool or its jars are missing."""
    if name not in TOOLS:
        raise BrokerError(f"unknown Kafka tool {name!r}; one of {sorted(TOOLS)}")
    libs = Path(libs_dir or os.environ.get(LIBS_ENV) or DEFAULT_LIBS_DIR).expanduser().resolve()
    if not any(libs.glob("kafka-tools-[0-9]*.jar")):
        raise BrokerError(f"Kafka's tools are missing: no kafka-tools-*.jar in {libs}. Run ./ops/setup.sh (or pass "
                          f"--jars / set {LIBS_ENV})")
    if not any(a == "--bootstrap-server" or a.startswith("--bootstrap-server=") for a in args):
        args = ["--bootstrap-server", bootstrap or os.environ.get("KAFKA_BOOTSTRAP") or "127.0.0.1:9092", *args]
    return [java_executable(), *jvm_performance_opts(), "-cp", f"{libs}/*", TOOLS[name], *args]


def run_tool(name: str, args: list[str], libs_dir: str | None = None, bootstrap: str | None = None) -> int:
    return subprocess.call(tool_command(name, args, libs_dir, bootstrap))
