"""Monitoring that tells the truth: every labelled series exists from a process's start (so ``rate()`` counts the
first events), the run supervisor exports its children's health, and a real Prometheus scraping a healthy
running pipeline through the shipped scrape config and rules has a series for every dashboard query and no
alert pending or firing."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

from grpo_stream.broker import free_port

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------ known label values
# Every reason the code can give must be in its metrics module's list (its series exist from the start); the
# lists must not keep reasons the code no longer gives. Reasons are found in the source: the leading literal
# (up to ':') of what is passed to `<x>.dead.send(msg, reason)` or `on_bad(reason, where)`, returned by the named
# functions that compute reasons, or assigned to `reason` there; a reason passed on from elsewhere (an f-string
# starting with a placeholder) is found where it is made.
REASON_FUNCTIONS = {
    "learner/source.py": ("_invalid", "_drop_reason"),
    "producers/service.py": ("_prompt_ids",),
    "producers/backpressure.py": ("pause_reason",),
    "grpo_core/kafka_io.py": ("decode_or_reason",),
}


def _head(node: ast.AST | None) -> str | None:
    """The reason class a string expression starts with: ``f"too_long: {n}"`` -> ``too_long``."""
    if isinstance(node, ast.Subscript):  # f"..."[:1000]
        node = node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        text = str(node.values[0].value)
    else:
        return None
    return text.split(":", 1)[0].strip() or None


def _heads(nodes: Iterable[ast.AST | None]) -> set[str]:
    out = set()
    for node in nodes:
        for n in (node.elts if isinstance(node, ast.Tuple) else [node]):
            if (h := _head(n)) is not None:
                out.add(h)
    return out


def dead_letter_reasons(tree: ast.AST) -> set[str]:
    """Literal reasons given to ``<x>.dead.send(msg, reason)``."""
    return _heads(n.args[1] for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) >= 2
                  and isinstance(n.func, ast.Attribute) and n.func.attr == "send"
                  and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "dead")


def bad_item_reasons(tree: ast.AST) -> set[str]:
    """Literal reasons given to ``on_bad(reason, where)``."""
    return _heads(n.args[0] for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                  and isinstance(n.func, ast.Name) and n.func.id == "on_bad")


def function_reasons(tree: ast.AST, name: str) -> set[str]:
    """What function ``name`` returns as a reason, or assigns to ``reason``."""
    found = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name]
    assert found, f"no function {name}: renamed? update REASON_FUNCTIONS in tests/test_monitoring.py"
    nodes: list[ast.AST | None] = []
    for n in ast.walk(found[0]):
        returned = isinstance(n, ast.Return)
        if returned or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason"
                                                          for t in n.targets)):
            nodes.append(n.value)  # type: ignore[union-attr]
    return _heads(nodes)


def timing_phases(tree: ast.AST) -> set[str]:
    """Keys stored into a ``timings`` dict (the learner's step phases)."""
    return {n.slice.value for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "timings"
            and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)}


def _tree(path: str) -> ast.AST:
    return ast.parse((ROOT / path).read_text(), path)


def _package(folder: str) -> list[ast.AST]:
    return [_tree(str(p.relative_to(ROOT))) for p in sorted((ROOT / folder).rglob("*.py"))]


def test_the_reason_scanner_finds_a_new_reason() -> None:
    """What makes the test below fail when someone adds a reason and not its series."""
    tree = ast.parse("def f(self, msg, n):\n"
                     "    self.dead.send(msg, f'brand_new: {n}')\n"
                     "    self.dead.send(msg, f'{n}: passed on')\n"
                     "    on_bad('odd_item', 'x.jsonl:1')\n"
                     "def _invalid(g):\n"
                     "    if g: return f'made_up: {g}'\n"
                     "    reason = 'assigned'\n"
                     "    return [], ''\n")
    assert dead_letter_reasons(tree) == {"brand_new"}
    assert bad_item_reasons(tree) == {"odd_item"}
    assert function_reasons(tree, "_invalid") == {"made_up", "assigned"}


def test_every_reason_the_code_gives_has_its_series_from_the_start() -> None:
    from grpo_learner import metrics as lm
    from grpo_producers import feeder_metrics as fm
    from grpo_producers import metrics as pm
    from grpo_verifiers import metrics as vm

    fn = {path: set().union(*(function_reasons(_tree(path), f) for f in names))
          for path, names in REASON_FUNCTIONS.items()}
    decode = fn["grpo_core/kafka_io.py"]
    assert decode == {"decode"}
    learner, producers, verifiers = (_package(p) for p in ("learner", "producers", "verifiers"))
    learner_dead = decode | set().union(*map(dead_letter_reasons, learner)) | function_reasons(
        _tree("learner/source.py"), "_invalid")
    assert set(lm.DEAD_LETTER_REASONS) == learner_dead
    assert set(lm.DROP_REASONS) == learner_dead | fn["learner/source.py"]
    assert set(lm.PHASES) == set().union(*map(timing_phases, learner))
    assert set(pm.DEAD_LETTER_REASONS) == (decode | set().union(*map(dead_letter_reasons, producers))
                                           | fn["producers/service.py"])
    assert set(pm.PAUSE_REASONS) == fn["producers/backpressure.py"]
    assert set(fm.BAD_ITEM_REASONS) == set().union(*map(bad_item_reasons, producers))
    assert set(vm.DEAD_LETTER_REASONS) == decode | set().union(*map(dead_letter_reasons, verifiers))


def _samples(registry: object, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for family in registry.collect()  # type: ignore[attr-defined]
            for s in family.samples if s.name == name}


def test_labelled_counters_start_at_zero_for_every_known_label() -> None:
    from grpo_learner.metrics import DEAD_LETTER_REASONS, DROP_REASONS, PHASES, LearnerMetrics
    from grpo_producers.feeder_metrics import BAD_ITEM_REASONS, FeederMetrics
    from grpo_producers.metrics import PAUSE_REASONS, ProducerMetrics
    from grpo_verifiers.metrics import ERROR_KINDS, ZERO_KINDS, VerifierMetrics

    learner, producer, feeder, verifier = LearnerMetrics(), ProducerMetrics(), FeederMetrics(), VerifierMetrics()
    expect = [
        (learner, "grpo_stream_learner_dead_letters_total", DEAD_LETTER_REASONS, "reason"),
        (learner, "grpo_stream_learner_groups_dropped_total", DROP_REASONS, "reason"),
        (learner, "grpo_stream_learner_step_phase_seconds_count", PHASES, "phase"),
        (producer, "grpo_stream_producer_paused_seconds_total", PAUSE_REASONS, "reason"),
        (producer, "grpo_stream_producer_dead_letters_total", ["decode", "generation_error"], "reason"),
        (feeder, "grpo_stream_feeder_bad_items_total", BAD_ITEM_REASONS, "reason"),
        (verifier, "grpo_stream_verifier_reward_errors_total", ERROR_KINDS, "reason"),
        (verifier, "grpo_stream_verifier_reward_zero_total", ZERO_KINDS, "reason"),
        (verifier, "grpo_stream_verifier_dead_letters_total", ["decode", "incomplete_group"], "reason"),
    ]
    for metrics, name, values, label in expect:
        got = _samples(metrics.registry, name)
        for v in values:
            assert got.get(((label, v),)) == 0.0, (name, v, got)


def test_an_empty_completion_is_a_zero_by_rule_not_a_reward_error() -> None:
    from grpo_verifiers.metrics import VerifierMetrics

    m = VerifierMetrics()
    m.observe_reward("empty", failed=False)
    m.observe_reward("oversized: 70000 chars", failed=False)
    m.observe_reward("timeout: 5.0s", failed=False)  # a term's zero_on: [timeout]
    m.observe_reward("timeout: 5.0s", failed=True)
    m.observe_reward("exception: ValueError: x", failed=True)
    m.observe_reward(None, failed=False)
    errors = _samples(m.registry, "grpo_stream_verifier_reward_errors_total")
    zeros = _samples(m.registry, "grpo_stream_verifier_reward_zero_total")
    assert {k[0][1]: v for k, v in errors.items() if v} == {"timeout": 1.0, "exception": 1.0}
    assert {k[0][1]: v for k, v in zeros.items() if v} == {"empty": 1.0, "oversized": 1.0, "timeout": 1.0}
    assert _samples(m.registry, "grpo_stream_verifier_reward_failed_total") == {(): 2.0}


# ------------------------------------------------------------------------------------------ run supervisor


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def test_the_supervisor_exports_restarts_children_and_their_endpoints(tmp_path: Path) -> None:
    """A child that logs its metrics address is listed at /targets (0.0.0.0 as loopback) and up; killed, it is
    down, counted as an error exit of its role with the signal as the reason, and still listed (its target reads
    as down, not as a gap); a child that finished (exit 0) is neither counted nor listed."""
    from grpo_stream.run import Child, RoleCount, RunConfig, Supervisor
    from grpo_stream.run_metrics import RunMetrics

    cfg = RunConfig(out_dir=str(tmp_path), learner={"max_steps": 1}, feeder={"source": "synthetic"},
                    producers=RoleCount(count=1), verifiers=RoleCount(count=0), restart_backoff_s=60.0)
    sup = Supervisor(cfg, sink=lambda name, line: None)
    metrics = RunMetrics("127.0.0.1", 0).start()
    metrics.watch(sup)
    try:
        talk = "import sys, time; print('INFO grpo_core.metrics: metrics on http://0.0.0.0:45678/metrics', flush=True)"
        for name, code in (("producer-0", talk + "; time.sleep(60)"), ("feeder", talk.replace("45678", "45679"))):
            child = Child(name, [sys.executable, "-c", code], (tmp_path / f"{name}.log").open("w"), sup.sink)
            sup.children.append(child)
            child.start()
        producer, feeder = sup.children
        base = f"http://127.0.0.1:{metrics.server.port}"
        deadline = time.monotonic() + 30
        while len(metrics.targets) < 2 or feeder.proc.poll() is None:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, metrics.targets
            time.sleep(0.1)
        assert json.loads(_get(base + "/targets")) == [
            {"targets": ["127.0.0.1:45678"], "labels": {"role": "producer", "child": "producer-0"}}]
        text = _get(base + "/metrics").decode()
        assert 'grpo_stream_run_child_up{index="0",role="producer"} 1.0' in text
        assert 'grpo_stream_run_last_restart_reason{index="0",reason="none",role="producer"} 1.0' in text
        for role in ("learner", "feeder", "producer"):
            assert f'grpo_stream_run_restarts_total{{role="{role}"}} 0.0' in text
        assert 'role="verifier"' not in text and "process_start_time_seconds" in text
        producer.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        producer.proc.wait()  # type: ignore[union-attr]
        sup.tick()
        text = _get(base + "/metrics").decode()
        assert 'grpo_stream_run_restarts_total{role="producer"} 1.0' in text
        assert 'grpo_stream_run_restarts_total{role="feeder"} 0.0' in text
        assert 'grpo_stream_run_child_up{index="0",role="producer"} 0.0' in text
        assert 'grpo_stream_run_last_restart_reason{index="0",reason="SIGKILL",role="producer"} 1.0' in text
        assert [g["targets"] for g in json.loads(_get(base + "/targets"))] == [["127.0.0.1:45678"]]
        sup.sink("producer-0", "INFO grpo_core.metrics: metrics on http://127.0.0.1:45680/metrics\n")  # restarted
        assert [g["targets"] for g in json.loads(_get(base + "/targets"))] == [["127.0.0.1:45680"]]
    finally:
        metrics.stop()
        for c in sup.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
            c.log_file.close()


def test_a_taken_supervisor_port_fails_the_run_before_anything_starts(tmp_path: Path) -> None:
    from grpo_core.config import ConfigError, load_config
    from grpo_stream.run import RunConfig, execute
    from grpo_stream.run_metrics import RunMetrics
    from grpo_stream.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")  # nothing else wrong with the run
    taken = RunMetrics("127.0.0.1", 0).start()
    try:
        cfg = load_config(RunConfig, ROOT / "configs/demo.yaml", [
            f"out_dir={tmp_path / 'run'}", f"metrics_port={taken.server.port}", f"learner.model.path={model}",
            f"producers.config.backend.model={model}"])
        with pytest.raises(ConfigError, match=rf"^metrics_port {taken.server.port} on 127.0.0.1: address already "
                                              r"in use \(another process\? set metrics_port"):
            execute(cfg, tty=False)
        assert not (tmp_path / "run/kafka").exists()  # no broker was started
    finally:
        taken.stop()
    assert RunMetrics("127.0.0.1", -1).start().server.port is None  # -1: off
    with pytest.raises(ConfigError, match="metrics_port: must be -1"):
        load_config(RunConfig, ROOT / "configs/demo.yaml", ["metrics_port=70000"])


# ------------------------------------------------------------------------------------------ a real Prometheus

# Dashboard queries that need kube-state-metrics (only deployed on Kubernetes): no series outside a cluster.
K8S_ONLY = ("kube_pod_container_status_restarts_total", "kube_pod_container_status_last_terminated_reason")


def _prometheus_config(tmp_path: Path, run_port: int, prom_port: int) -> Path:
    """ops/prometheus/prometheus-run.yml as shipped (jobs, service discovery, relabelling, rules), with the
    test's ports and a 1 s scrape and rule interval."""
    cfg = yaml.safe_load((ROOT / "ops/prometheus/prometheus-run.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ROOT / "ops/prometheus" / f) for f in cfg["rule_files"]]
    text = yaml.safe_dump(cfg).replace("127.0.0.1:9404", f"127.0.0.1:{run_port}")
    text = text.replace("127.0.0.1:9090", f"127.0.0.1:{prom_port}").replace("refresh_interval: 5s",
                                                                            "refresh_interval: 1s")
    assert str(run_port) in text and "9404" not in text
    (path := tmp_path / "prometheus.yml").write_text(text)
    return path


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
    return json.loads(_get(url))["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard: panel, PromQL) of every committed dashboard, Grafana's $__rate_interval as 1m."""
    out = []
    for f in sorted((ROOT / "ops/grafana/dashboards").glob("*.json")):
        for panel in json.loads(f.read_text())["panels"]:
            for target in panel["targets"]:
                out.append((f"{f.stem}: {panel['title']}", target["expr"].replace("$__rate_interval", "1m")))
    return out


def _missing(port: int) -> list[str]:
    try:
        return [f"{where}: {expr}" for where, expr in dashboard_queries()
                if not any(k in expr for k in K8S_ONLY) and not _query(port, expr)]
    except OSError as exc:
        return [f"prometheus not answering: {exc}"]


def _inject_empty_group(out: Path) -> None:
    """A whole group of empty completions: scored 0 by rule, which must not count as reward errors."""
    import numpy as np

    from grpo_core import wire
    from grpo_core.config import KafkaConfig, build
    from grpo_core.contract import PipelineContract
    from grpo_core.kafka_io import make_producer

    learner_cfg = yaml.safe_load((out / "configs/learner.yaml").read_text())
    contract = build(PipelineContract, learner_cfg["pipeline"], "pipeline.")
    producer = make_producer(KafkaConfig(bootstrap=learner_cfg["kafka"]["bootstrap"]), "test")
    rng = np.random.default_rng(0)
    for i in range(contract.group_size):
        producer.send(contract.topic("completions"), key=b"empty@e0r0", value=wire.encode(wire.Completion(
            group_id="empty@e0r0", index=i, group_size=contract.group_size, prompt_id="empty", task="exact",
            prompt_token_ids=rng.integers(0, 200, 4, dtype=np.int32),
            completion_token_ids=np.zeros(0, dtype=np.int32), behaviour_logprobs=np.zeros(0, dtype=np.float32),
            policy_version=0, producer_id="test", finish_reason="stop", completion="",
            metadata={"answer": "1"})))
    producer.flush()
    producer.close()


# The healthy run's length after every series is there: 0 in the suite; GRPO_STREAM_HEALTHY_MINUTES=30 (with
# pytest --timeout=2400) for the long check (docs/results/2026-12-07-no-silent-failure.md), whose alert windows
# (up to 30 min) then fill up.
HEALTHY_MINUTES = float(os.environ.get("GRPO_STREAM_HEALTHY_MINUTES", "0"))


@pytest.mark.slow
def test_a_real_prometheus_sees_every_dashboard_query_and_no_alert_in_a_healthy_run(tmp_path: Path) -> None:
    """`grpo-stream run` (the demo's pipeline, one producer, the tiny model) scraped by the real Prometheus through
    ops/prometheus/prometheus-run.yml and its rules: every dashboard query has a series (0 where nothing happened:
    no dead letter, no restart), every role and the supervisor are up with their process_* metrics, a group of
    empty completions is no reward error, and no alert is pending or firing, at the end or at any time before."""
    from grpo_stream.tiny_model import build_tiny_model

    if (prometheus := shutil.which("prometheus")) is None:
        pytest.fail("prometheus not found: apt-get install -y prometheus", pytrace=False)
    model = build_tiny_model(tmp_path / "model")
    out, run_port, prom_port = tmp_path / "run", free_port(), free_port()
    cmd = [sys.executable, "-m", "grpo_stream.cli", "run", str(ROOT / "configs/demo.yaml"), "name=monitoring",
           f"out_dir={out}", f"max_minutes={5 + HEALTHY_MINUTES}", "producers.count=1", f"metrics_port={run_port}",
           f"learner.model.path={model}", f"producers.config.backend.model={model}",
           f"learner.weights.fs.root={out / 'weights'}", f"producers.config.weights.fs.root={out / 'weights'}"]
    err = tmp_path / "run.err"
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err.open("w"))
    prom = subprocess.Popen([prometheus, f"--config.file={_prometheus_config(tmp_path, run_port, prom_port)}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 240
        while not (out / "configs/learner.yaml").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        _inject_empty_group(out)
        missing: list[str] = ["not queried yet"]
        while missing or not _query(prom_port, "grpo_stream_learner_steps_total > 2"):
            assert run.poll() is None, f"the run stopped early: {err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no series for:\n" + "\n".join(missing)
            time.sleep(3)
            missing = _missing(prom_port)
        healthy_until = time.monotonic() + 60 * HEALTHY_MINUTES
        while time.monotonic() < healthy_until:
            assert run.poll() is None, f"the run stopped early: {err.read_text()[-3000:]}"
            time.sleep(10)
        assert not _missing(prom_port)
        _check_health(prom_port)
        window = max(1, int(time.monotonic() - started + 59) // 60)
        # Firing at any time (pending is allowed on the way: GrpoLearnerAbsent is, until the first scrape of it).
        ever = [r["metric"] for r in _query(prom_port, f'max_over_time(ALERTS{{alertstate="firing"}}[{window}m])')]
        assert not ever, f"alerts fired during the healthy run: {ever}"
        steps = _query(prom_port, "max(grpo_stream_learner_steps_total)")
        print(f"healthy for {window} min: learner steps {steps[0]['value'][1]}, no alert pending or firing")
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        prom.terminate()
        prom.wait(timeout=30)


def _check_health(port: int) -> None:
    """At the end of the healthy run: everything up and counted as it should be, no alert pending or firing."""
    ups = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1]
           for r in _query(port, 'up{job=~"grpo-stream-.+"}')}
    roles = ("run", "learner", "producer", "verifier", "feeder")
    assert {job for job, _ in ups} == {f"grpo-stream-{r}" for r in roles}
    assert set(ups.values()) == {"1"}, ups
    assert ("grpo-stream-producer", "producer-0") in ups  # the instance is the child's name
    starts = _query(port, 'process_start_time_seconds{job=~"grpo-stream-.+"}')
    assert len(starts) == len(ups), starts
    assert {r["value"][1] for r in _query(port, "grpo_stream_run_child_up")} == {"1"}
    assert {r["value"][1] for r in _query(port, "sum(grpo_stream_run_restarts_total)")} == {"0"}
    zero = _query(port, 'sum(grpo_stream_verifier_reward_zero_total{reason="empty"})')
    assert zero and float(zero[0]["value"][1]) >= 16, zero  # the injected group was scored ...
    assert _query(port, "sum(grpo_stream_verifier_reward_errors_total)")[0]["value"][1] == "0"  # ... no error
    rules = (ROOT / "ops/prometheus/rules/grpo-stream.yml").read_text()
    unseen = [n for n in sorted(set(re.findall(r"\bgrpo_stream_[a-z0-9_]+", rules))) if not _query(port, n)]
    assert not unseen, f"the rules use series the running pipeline does not export: {unseen}"
    alerts = [r["metric"] for r in _query(port, "ALERTS")]  # pending (a condition already true) or firing
    assert not alerts, f"alerts in a healthy run: {alerts}"
