"""Errors that name their cause, fast: bad input to any command is one line on stderr and exit 2, with no
traceback, found before anything heavy is imported or started; and the run supervisor says why a child exited."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo_stream.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "vllm")


def cli(*args: str, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess[str], float, set[str]]:
    """Run ``grpo-stream ARGS`` as a user would; returns the process, its wall time and the heavy modules it
    imported (from ``python -X importtime``, whose lines are taken out of stderr)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo_stream.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    wall = time.monotonic() - t0
    imported = set(re.findall(r"^import time:.*\|\s+(\S+)$", proc.stderr, re.M))
    proc.stderr = "".join(line for line in proc.stderr.splitlines(keepends=True)
                          if not line.startswith("import time:"))
    return proc, wall, {m for m in HEAVY if m in imported}


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, so that nobody else takes it meanwhile): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize(("role", "config", "heavy"), [
    ("learner", "configs/learner.yaml", HEAVY),
    ("producer", "configs/producer.yaml", HEAVY),
    ("verifier", "configs/verifier.yaml", HEAVY),
    ("feed", "configs/feeder.yaml", HEAVY),
])
def test_a_mistyped_key_is_rejected_before_the_role_is_imported(role: str, config: str,
                                                                heavy: tuple[str, ...]) -> None:
    """Before, the service module (torch, transformers, vLLM) came first: 7-9 s for a typo."""
    proc, wall, imported = cli(role, "--config", config, "--pipeline", "configs/pipeline.yaml", "publish_evry=1")
    assert_one_line_error(proc, f"grpo-stream {role}: error: publish_evry: unknown key")
    assert not imported & set(heavy), f"{role} imported {sorted(imported)} before rejecting its config"
    assert wall < 60, wall  # the import check is the real bound; this only catches a hang


@pytest.mark.parametrize(("role", "config", "key"), [("learner", "configs/learner.yaml", "model.path"),
                                                    ("producer", "configs/producer.yaml", "backend.model")])
def test_a_missing_model_directory_is_one_line_naming_key_and_path(tmp_path: Path, role: str, config: str,
                                                                   key: str) -> None:
    """Before: a Hugging Face `Repo id must be in the form ...` traceback once the model was loaded."""
    missing = tmp_path / "runs" / "nope" / "model"
    proc, _, imported = cli(role, "--config", config, "--pipeline", "configs/pipeline.yaml", f"{key}={missing}")
    assert_one_line_error(proc, f"{key}: {missing}: no such directory")
    assert "transformers" not in imported


def test_a_model_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    proc, _, _ = cli("producer", "--config", "configs/producer.yaml", "--pipeline", "configs/pipeline.yaml",
                     f"backend.model={tmp_path / 'model'}")
    assert_one_line_error(proc, "backend.model:", "has no config.json")


def test_an_unreachable_broker_is_one_line_naming_it_within_the_bound(closed_port: int) -> None:
    """Before: the verifier waited ~6 minutes and died of `KafkaTimeoutError: Unable to bootstrap` with a
    traceback. Now kafka.connect_timeout_s bounds the wait (3 s here, 50 s by default)."""
    bootstrap = f"127.0.0.1:{closed_port}"
    proc, wall, _ = cli("verifier", "--config", "configs/verifier.yaml", "--pipeline", "configs/pipeline.yaml",
                        f"kafka.bootstrap={bootstrap}", "kafka.connect_timeout_s=3", "metrics.port=-1",
                        "rewards.workers=1")
    line = assert_one_line_error(proc, f"no Kafka broker answered at {bootstrap} within 3s",
                                 "kafka.connect_timeout_s")
    assert "kafka." not in proc.stderr.replace(line, "").replace("kafka.bootstrap", "")  # no client log lines
    assert wall < 90, wall


def test_topics_create_against_an_unreachable_broker_is_one_line(closed_port: int) -> None:
    t0 = time.monotonic()
    proc, _, _ = cli("topics", "create", f"kafka.bootstrap=127.0.0.1:{closed_port}", "kafka.connect_timeout_s=2")
    assert_one_line_error(proc, f"127.0.0.1:{closed_port}")
    assert time.monotonic() - t0 < 60


def test_invalid_yaml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka:\n  bootstrap: [1,\n")
    proc, _, _ = cli("verifier", "--config", str(bad))
    assert_one_line_error(proc, f"{bad}: invalid YAML")


def test_an_invalid_kafka_log_level_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.cli", "config", "explain", "pipeline"],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "GRPO_STREAM_KAFKA_LOG_LEVEL": "LOUD"})
    assert_one_line_error(proc, "GRPO_STREAM_KAFKA_LOG_LEVEL", "'LOUD'")


@pytest.mark.parametrize("override", ["name=../evil", "name=a/b", "name=.hidden"])
def test_run_refuses_a_bad_run_name_before_starting_anything(tmp_path: Path, override: str) -> None:
    """Before: `run name=../evil` started a broker, then died of InvalidTopicError."""
    out = tmp_path / "out"
    proc, _, _ = cli("run", "configs/demo.yaml", override, f"out_dir={out}")
    assert_one_line_error(proc, "grpo-stream run: error: name: ")
    assert not out.exists()


def test_run_checks_every_section_and_model_path_before_starting_anything(tmp_path: Path) -> None:
    """Before: a broker and topics first (10-22 s), then the roles' sections; a missing model crash-looped the
    learner six times."""
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    base = ["run", "configs/demo.yaml", f"out_dir={out}", f"learner.model.path={model}",
            f"producers.config.backend.model={model}"]
    proc, _, _ = cli(*base, "producers.config.prompts_per_bach=4")
    assert_one_line_error(proc, "producer: prompts_per_bach: unknown key")
    proc, _, _ = cli(*base, f"learner.model.path={tmp_path / 'gone' / 'model'}")
    assert_one_line_error(proc, f"learner: model.path: {tmp_path / 'gone' / 'model'}: no such directory")
    proc, _, _ = cli(*base, f"producers.config.backend.model={tmp_path}")
    assert_one_line_error(proc, f"producer: backend.model: {tmp_path} has no config.json")
    assert not out.exists(), "something was started before the configs were checked"


# ------------------------------------------------------------------------------------------ the supervisor


def _supervisor(tmp_path: Path, *overrides: str):  # -> Supervisor (imported late: run.py's imports)
    from grpo_core.config import load_config
    from grpo_stream.run import RunConfig, Supervisor

    return Supervisor(load_config(RunConfig, REPO / "configs/demo.yaml", [f"out_dir={tmp_path}", *overrides]))


def _child(sup, tmp_path: Path, code: str):  # -> Child
    from grpo_stream.run import Child

    child = Child("verifier-0", [sys.executable, "-c", code], (tmp_path / "c.log").open("w"), lambda n, line: None)
    sup.children.append(child)
    child.start()
    return child


def _until_restart_logged(sup, caplog: pytest.LogCaptureFixture, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.tick()
        exits = [r.getMessage() for r in caplog.records if r.name == "run" and " exited with " in r.getMessage()]
        if exits:
            return exits[-1]
        time.sleep(0.05)
    raise AssertionError("the supervisor never noticed the exit")


LOG_SETUP = "import logging; logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
CRASH = LOG_SETUP + """
logging.getLogger('learner').error('checkpoint 40 unreadable')
def load():
    raise FileNotFoundError(2, 'No such file', '/ckpt/model.safetensors')
try:
    load()
except OSError as e:
    raise RuntimeError('no usable checkpoint in /ckpt') from e
"""


def test_the_supervisor_names_the_last_error_line_of_a_child_that_exits(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Before: the terminal showed `Traceback (most recent call last):` per crash and never the reason."""
    caplog.set_level(logging.INFO, logger="run")
    sup = _supervisor(tmp_path, "restart_backoff_s=60")
    _child(sup, tmp_path, CRASH)
    message = _until_restart_logged(sup, caplog)
    assert "verifier-0 exited with 1 (RuntimeError: no usable checkpoint in /ckpt)" in message, message
    caplog.clear()
    sup.children.clear()
    _child(sup, tmp_path, LOG_SETUP + "logging.getLogger('x').error('boom'); raise SystemExit(3)")
    message = _until_restart_logged(sup, caplog)
    assert re.search(r"exited with 3 \(\S+ \S+ ERROR x: boom\)", message), message
    caplog.clear()
    sup.children.clear()
    _child(sup, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert "exited with -9 (killed by SIGKILL)" in _until_restart_logged(sup, caplog)


def test_the_supervisor_does_not_echo_a_tracebacks_header(tmp_path: Path) -> None:
    from grpo_stream.run import _route

    shown: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            shown.append(text)

    for line in ["Traceback (most recent call last):\n", "2026-01-01 10:00:00,000 ERROR learner: x\n",
                 "2026-01-01 10:00:00,000 INFO learner: step 3\n"]:
        _route(Sink(), "learner", line)  # type: ignore[arg-type]
    assert shown == ["[learner] 2026-01-01 10:00:00,000 ERROR learner: x\n"]


@pytest.mark.parametrize(("reset_s", "gives_up"), [(0.3, False), (0.0, True)])
def test_a_stable_period_resets_a_childs_crash_count(tmp_path: Path, reset_s: float, gives_up: bool) -> None:
    """As Kubernetes' back-off: a child that ran restart_reset_s before crashing starts counting again, so a role
    that crashes once a day is not given up on after max_restarts days; crashes in a row still are."""
    sup = _supervisor(tmp_path, "max_restarts=1", "restart_backoff_s=0.01", f"restart_reset_s={reset_s}")
    child = _child(sup, tmp_path, "import time; time.sleep(0.6); raise SystemExit(1)")
    deadline = time.monotonic() + 60
    while child.restarts < 3 and not child.done and time.monotonic() < deadline:
        sup.tick()
        time.sleep(0.05)
    assert child.done is gives_up, (child.restarts, child.crashes)
    if gives_up:
        assert (child.restarts, child.crashes) == (2, 2)
    else:
        assert child.restarts == 3 and child.crashes == 1
        child.proc.kill()


def test_last_error_takes_the_exception_line_of_a_chained_traceback() -> None:
    from grpo_stream.exit_reason import LastError

    seen = LastError()
    for line in ["2026-01-01 10:00:00,000 INFO learner: resuming\n",
                 "2026-01-01 10:00:01,000 ERROR learner: step failed\n",
                 "Traceback (most recent call last):\n", '  File "a.py", line 1, in <module>\n', "    f()\n",
                 "    ^^^\n", "KeyError: 'x'\n", "\n",
                 "During handling of the above exception, another exception occurred:\n", "\n",
                 "Traceback (most recent call last):\n", '  File "a.py", line 3, in <module>\n',
                 "ValueError: model.path is not a directory\n"]:
        seen.feed(line)
    assert seen.reason(1) == "ValueError: model.path is not a directory"
    seen.reset()
    seen.feed("grpo-stream learner: error: model.path: /m: no such directory\n")
    seen.feed("2026-01-01 10:00:02,000 WARNING learner: late\n")
    assert seen.reason(2) == "grpo-stream learner: error: model.path: /m: no such directory"
    seen.reset()
    assert seen.reason(1) == "no error line in its output" and seen.reason(-15) == "killed by SIGTERM"
