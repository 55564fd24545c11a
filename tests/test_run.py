"""`grpo-stream run`: the whole pipeline as supervised processes; a child killed mid-run is restarted and the run
completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_stream.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]


def test_what_a_killed_child_left_running_is_reaped(tmp_path: Path) -> None:
    """A producer killed with -9 leaves its vLLM engine processes behind (they do not watch their parent); the
    supervisor kills the child's process group before restarting it."""
    from grpo_core.config import load_config
    from grpo_stream.run import Child, RunConfig, Supervisor

    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    sup = Supervisor(load_config(RunConfig, REPO / "configs/demo.yaml", [f"out_dir={tmp_path}"]))
    child = Child("producer-0", [sys.executable, "-c", code], (tmp_path / "c.log").open("w"), lambda n, line: None)
    sup.children.append(child)
    child.start()
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    assert child.proc is not None
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    os.kill(grandchild, 0)  # still alive: an orphan, until the supervisor notices
    assert sup.tick() is False and child.restarts == 1
    deadline = time.monotonic() + 10
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the orphan survived the reap"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet waited for by init) is gone too
        return f.read().split()[2] != "Z"


def test_a_child_is_pinned_to_its_roles_cpus(tmp_path: Path) -> None:
    from grpo_stream.run import Child

    cpus = {min(os.sched_getaffinity(0))}
    child = Child("producer-0", [sys.executable, "-c", "import os, time; time.sleep(0.5); "
                                 "print(sorted(os.sched_getaffinity(0)))"],
                  (tmp_path / "c.log").open("w"), lambda name, line: None, cpus=cpus)
    child.start()
    assert child.proc is not None and child.proc.wait(timeout=30) == 0
    time.sleep(0.2)
    assert (tmp_path / "c.log").read_text().strip() == str(sorted(cpus))


@pytest.mark.slow
def test_run_restarts_a_killed_child_and_completes(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_stream.cli", "run", str(REPO / "configs" / "demo.yaml"), "name=restart-test",
           f"out_dir={out}", "max_minutes=6", "learner.max_steps=20", f"learner.model.path={model}",
           f"producers.config.backend.model={model}", f"learner.weights.fs.root={out / 'weights'}",
           f"producers.config.weights.fs.root={out / 'weights'}", "restart_backoff_s=0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    killed = None
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if killed is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            killed = json.loads((out / "children.json").read_text())["producer-0"]["pid"]
            os.kill(killed, signal.SIGKILL)  # mid-run: the learner is at step >= 5 of 20
        time.sleep(0.5)
    output, _ = proc.communicate(timeout=300)
    assert killed is not None, output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learner_steps"] == 20 and not summary["learner_failed"]
    assert summary["restarts"] == {"producer-0": 1}
    children = json.loads((out / "children.json").read_text())
    assert children["producer-0"]["pid"] != killed
    assert (out / "report.png").stat().st_size > 10_000
    assert summary["groups_trained"] == 20 * 16 and summary["weight_versions_published"] == 1 + 20 // 4


@pytest.mark.slow
def test_the_lockstep_setting_trains_continuously(tmp_path: Path) -> None:
    """On-policy lockstep through the broker (v = 1, staleness 0, producers at most one learner batch ahead): the
    groups that turn stale as the learner publishes are taken out of the backlog at once, so the producers go
    on and the learner reaches its steps (before: 1 step, then standing still for minutes)."""
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_stream.cli", "run", str(REPO / "configs" / "demo.yaml"), "name=lockstep",
           f"out_dir={out}", "max_minutes=4", "learner.max_steps=12", f"learner.model.path={model}",
           f"producers.config.backend.model={model}", f"learner.weights.fs.root={out / 'weights'}",
           f"producers.config.weights.fs.root={out / 'weights'}", "learner.publish_every=1",
           "pipeline.max_staleness=0", "producers.config.max_version_lag=0",
           "producers.config.max_backlog_groups=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert summary["learner_steps"] == 12, summary
    assert summary["mean_staleness"] == 0 and summary["groups_trained"] == 12 * 16


@pytest.mark.slow
def test_a_saved_hf_dataset_feeds_a_run(tmp_path: Path) -> None:
    """A dataset written with ``datasets``' ``save_to_disk`` (the format GSM8K / MATH copies are kept in) feeds a
    whole run through the broker: the learner trains groups of its prompts, scored against its answer column."""
    import datasets as hf_datasets

    rows = [{"id": f"hf-{i}", "question": f"last({i}{i + 3})=", "answer": str((i + 3) % 10)} for i in range(12)]
    hf_datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_stream.cli", "run", str(REPO / "configs" / "demo.yaml"), "name=hf-run",
           f"out_dir={out}", "max_minutes=4", "learner.max_steps=2", "learner.groups_per_batch=4",
           f"learner.model.path={model}", f"producers.config.backend.model={model}",
           f"learner.weights.fs.root={out / 'weights'}", f"producers.config.weights.fs.root={out / 'weights'}",
           "feeder.source=hf", f"feeder.hf.path={tmp_path / 'ds'}", "feeder.hf.id_field=id",
           "feeder.hf.task=exact", "producers.count=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = [e["group_id"] for line in map(json.loads, (out / "lineage.jsonl").read_text().splitlines())
               for e in line["trained"]]
    assert len(trained) == 8 and all(g.split("@")[0] in {r["id"] for r in rows} for g in trained), trained
    assert json.loads((out / "summary.json").read_text())["learner_steps"] == 2
