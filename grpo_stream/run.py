"""``grpo-stream run CONFIG.yaml``: a whole pipeline as separate OS processes, supervised.

The run YAML holds the shared ``kafka`` section, the pipeline contract (``pipeline``: group size, names, ...;
its ``run`` is the run's ``name``) and one section per role (``feeder``,
``producers``, ``verifiers``, ``learner``) in that role's own config format; each role is started exactly as k8s
would start it: ``grpo-stream <role> --config runs/<name>/configs/<role>.yaml``. The supervisor writes their
logs to ``runs/<name>/logs/`` and echoes only their warnings and errors (with a prefix), restarts a crashed
child with backoff (naming its last error line), shows learner progress (a bar, or a status line without a
terminal), stops everything on Ctrl-C / SIGTERM / the time budget / the learner's ``max_steps``, and exits
non-zero when the learner failed. Every section and model path is checked before anything starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from grpo_core.config import ConfigError, KafkaConfig, build, check_paths, opt, require, to_dict, validate_tree
from grpo_core.contract import PipelineContract, check_run_name
from grpo_stream.exit_reason import LastError
from grpo_stream.run_metrics import RunMetrics
from grpo_stream.threads import child_env

log = logging.getLogger("run")
STATUS_EVERY_S = 10.0  # without a terminal: one learner status line this often (the full logs are in logs/)


@dataclass
class RoleCount:
    """A scalable role: how many processes, and their config section."""

    count: int = opt(1, "Processes of this role.")
    config: dict[str, Any] = opt(factory=dict, help="The role's own config keys (see config explain <role>).")


@dataclass
class RunConfig:
    name: str = opt("run", "Run name: runs/<name>/ and pipeline.run (weight announcements, topic prefix).")
    out_dir: str = opt("", "Output directory. Empty: runs/<name>.")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster. bootstrap empty: start a local broker for the run.")
    pipeline: PipelineContract = opt(factory=PipelineContract, help="The contract every role gets (its run: "
                                                                   "name); its topic plan is created at start.")
    feeder: dict[str, Any] = opt(factory=dict, help="Feeder config keys (config explain feeder). {} = no feeder.")
    producers: RoleCount = opt(factory=RoleCount, help="Producer processes.")
    verifiers: RoleCount = opt(factory=RoleCount, help="Verifier processes.")
    learner: dict[str, Any] = opt(factory=dict, help="Learner config keys (config explain learner).")
    max_minutes: float = opt(0.0, "Stop the run after this long (0: when the learner reaches max_steps).")
    restart_backoff_s: float = opt(2.0, "First restart delay of a crashed child (doubles per crash).")
    max_restarts: int = opt(
        5, "Give up on a role after this many crashes in a row (then the run fails); a child that ran "
           "restart_reset_s without crashing starts counting again.")
    restart_reset_s: float = opt(
        600.0, "A child that ran this long before it crashed is restarted after restart_backoff_s again, its count "
               "towards max_restarts back to 1 (Kubernetes resets its crash-loop back-off after 10 min the same "
               "way); 0: crashes count for the whole run.")
    metrics_host: str = opt("127.0.0.1", "Bind address of the supervisor's /metrics (restarts, children up; "
                                         "/targets: the children's endpoints for Prometheus http_sd_configs).")
    metrics_port: int = opt(9404, "Port of the supervisor's /metrics (ops/prometheus/prometheus-run.yml scrapes "
                                  "9404); 0 picks a free one (logged), -1 disables it.")
    learner_ranks: int = opt(
        1, "Learner ranks on this machine: > 1 starts the learner under torchrun --standalone --nproc-per-node N "
           "(learner.parallel.strategy ddp or fsdp2); torchrun restarts the whole group when a rank dies, up to "
           "learner_rank_restarts times, and the learner resumes from its newest checkpoint.")
    learner_rank_restarts: int = opt(3, "torchrun's --max-restarts for a learner of several ranks.")
    cpus: dict[str, list[int]] = opt(
        factory=dict, help="CPUs per role (feeder, producer, verifier, learner), e.g. {producer: [0], learner: "
        "[1]}: the supervisor pins each child of the role to them (its later threads and processes, a vLLM "
        "engine's included, inherit the set). Absent: unpinned.")
    threads: dict[str, int] = opt(
        factory=dict, help="Compute threads (OMP_NUM_THREADS: torch's) per process of a role, e.g. {learner: 2}. "
        "Absent: a pinned role shares its cpus among its processes, the unpinned producers and learner ranks share "
        "the CPUs nobody is pinned to, the verifiers and the feeder get 1 (at least 1 each; an OMP_NUM_THREADS "
        "set for the supervisor is kept for the roles not named here). More threads than a process's share of the "
        "cores spin-wait against the other processes (grpo_stream/threads.py).")

    def validate(self) -> None:
        check_run_name(self.name, "name")
        require(bool(self.learner), "learner: a run needs a learner section")
        have = set(range(os.cpu_count() or 1))
        for role, cpus in self.cpus.items():
            require(role in ("feeder", "producer", "verifier", "learner"),
                    f"cpus.{role}: not a role (feeder, producer, verifier, learner)")
            require(bool(cpus) and set(cpus) <= have,
                    f"cpus.{role}: {cpus} must be a non-empty subset of this machine's CPUs {sorted(have)}")
        for role, n in self.threads.items():
            require(role in ("feeder", "producer", "verifier", "learner"),
                    f"threads.{role}: not a role (feeder, producer, verifier, learner)")
            require(isinstance(n, int) and n >= 1, f"threads.{role}: must be a whole number >= 1, got {n!r}")
        for role, section in (("feeder", self.feeder), ("producers.config", self.producers.config),
                              ("verifiers.config", self.verifiers.config), ("learner", self.learner)):
            require("pipeline" not in section, f"{role}.pipeline: the contract is the run's pipeline section "
                                               f"(one for every role); move these keys there")
        require(self.producers.count >= 0 and self.verifiers.count >= 0, "producers/verifiers.count: must be >= 0")
        require(self.max_restarts >= 0, "max_restarts: must be >= 0")
        require(self.restart_reset_s >= 0, "restart_reset_s: must be >= 0 (0: never reset)")
        require(-1 <= self.metrics_port <= 65535, "metrics_port: must be -1 (off), 0 (any) or a port number")
        strategy = (self.learner.get("parallel") or {}).get("strategy", "none")
        require(self.learner_ranks >= 1 and (self.learner_ranks == 1 or strategy in ("ddp", "fsdp2")),
                f"learner_ranks: {self.learner_ranks} needs >= 1, and above 1 learner.parallel.strategy ddp or "
                f"fsdp2 (got {strategy})")
        require(self.learner_rank_restarts >= 0, "learner_rank_restarts: must be >= 0")

    @property
    def out(self) -> Path:
        return Path(self.out_dir or f"runs/{self.name}")

    @property
    def contract(self) -> PipelineContract:
        return dataclasses.replace(self.pipeline, run=self.name)


def role_configs(cfg: RunConfig, bootstrap: str | None, paths: bool = False) -> dict[str, dict[str, Any]]:
    """Each role's complete config (shared kafka/topics merged in), validated with the role's own schema;
    ``paths``: also what each names on this machine (model directories: grpo_core.config.check_paths)."""
    from grpo_learner.config import LearnerConfig
    from grpo_producers.config import ProducerConfig
    from grpo_producers.feeder_config import FeederConfig
    from grpo_verifiers.config import VerifierConfig

    shared = {"kafka": {**to_dict(cfg.kafka), "bootstrap": bootstrap}, "pipeline": to_dict(cfg.contract)}
    sections: dict[str, tuple[type, dict[str, Any]]] = {
        "learner": (LearnerConfig, {"out_dir": str(cfg.out), **cfg.learner}),
        "producer": (ProducerConfig, cfg.producers.config),
        "verifier": (VerifierConfig, cfg.verifiers.config),
    }
    if cfg.feeder:
        sections["feeder"] = (FeederConfig, {"out_dir": str(cfg.out), **cfg.feeder})
    resolved = {}
    for role, (cls, section) in sections.items():
        merged = _deep_merge(shared, section)
        try:
            built: Any = build(cls, merged, "")
            validate_tree(built)
            if paths:
                check_paths(built)
        except ConfigError as exc:
            raise ConfigError(f"{role}: {exc}") from None
        resolved[role] = merged
    _check_knobs(resolved)
    return resolved


def _check_knobs(resolved: dict[str, dict[str, Any]]) -> None:
    """Cross-role settings that would deadlock the run: a backlog limit below one learner batch means the
    producers pause before the learner has enough groups to take its first step."""
    from grpo_learner.config import LearnerConfig
    from grpo_producers.config import ProducerConfig

    backlog = build(ProducerConfig, resolved["producer"], "").max_backlog_groups
    batch = build(LearnerConfig, resolved["learner"], "").groups_per_batch
    require(backlog == 0 or backlog >= batch,
            f"producers.config.max_backlog_groups ({backlog}) must be 0 or >= learner.groups_per_batch ({batch}): "
            "below one batch the producers pause before the learner can take a step")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Child:
    """One supervised process of a role; every output line goes to its log file and to ``sink``."""

    name: str
    cmd: list[str]
    log_file: IO[str]
    sink: Callable[[str, str], object]
    proc: subprocess.Popen[str] | None = None
    restarts: int = 0  # every restart of the run
    crashes: int = 0  # crashes in a row, reset by a stable period (RunConfig.restart_reset_s): the back-off's count
    next_start: float = 0.0
    started_at: float = 0.0
    done: bool = False
    cpus: set[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's (threads.child_env)
    last_error: LastError = field(default_factory=LastError)
    pumper: threading.Thread | None = None

    def start(self) -> None:
        # A session of its own: what the child starts (a vLLM engine's processes) shares its process group,
        # so reap() can end them when the child itself died without shutting them down (kill -9, a crash).
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True, env={**os.environ, **self.env})
        if self.cpus:  # before the child has started any thread or engine process of its own (imports take s)
            os.sched_setaffinity(self.proc.pid, self.cpus)
        self.started_at = time.monotonic()
        self.last_error.reset()
        self.pumper = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self.pumper.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log_file.write(line)
            self.log_file.flush()
            self.last_error.feed(line)
            self.sink(self.name, line)

    def reap(self) -> None:
        """SIGKILL whatever is left of the child's process group once the child has exited (an orphaned vLLM
        engine would otherwise keep its memory, and a restart would start a second one beside it)."""
        if self.proc is not None and self.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left
                os.killpg(self.proc.pid, signal.SIGKILL)

    def exit_reason(self, returncode: int) -> str:
        """The last error line of the child that exited (its output read to the end first, for at most 2 s)."""
        if self.pumper is not None:
            self.pumper.join(timeout=2.0)
        return self.last_error.reason(returncode)

    def status(self) -> str:
        state = "done" if self.done else ("running" if self.proc and self.proc.poll() is None else "down")
        pid = self.proc.pid if self.proc else "-"
        return f"{self.name:<12} {state:<8} pid {pid} restarts {self.restarts}"


@dataclass
class Supervisor:
    cfg: RunConfig
    sink: Callable[[str, str], object] = lambda name, line: sys.stdout.write(f"[{name}] {line}")
    on_crash: Callable[[Child, int], None] = lambda child, rc: None  # run_metrics counts error exits
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    learner_failed: bool = False

    def spawn(self, role: str, index: int, config_path: Path) -> None:
        name = role if role in ("learner", "feeder") else f"{role}-{index}"
        logs = self.cfg.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "grpo_stream.cli", role if role != "feeder" else "feed", "--config",
               str(config_path)]
        if role == "learner" and self.cfg.learner_ranks > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.cfg.learner_ranks}",
                        f"--max-restarts={self.cfg.learner_rank_restarts}", "-m", "grpo_stream.cli"]
        if role == "producer":
            cmd.append(f"producer_id={name}")
        elif role == "verifier":
            cmd.append(f"verifier_id={name}")
        cpus = self.cfg.cpus.get(role)
        child = Child(name, cmd, (logs / f"{name}.log").open("a"), self.sink, cpus=set(cpus) if cpus else None,
                      env=child_env(self.cfg, role))
        child.start()
        self.children.append(child)
        self.write_status()

    def write_status(self) -> None:
        """runs/<name>/children.json: pid and restarts per child (for operators and tests)."""
        data = {c.name: {"pid": c.proc.pid if c.proc else None, "restarts": c.restarts} for c in self.children}
        (self.cfg.out / "children.json").write_text(json.dumps(data, indent=1))

    def watch(self, deadline: float | None, on_tick: Callable[[], bool | None] | None = None,
              tick_s: float = 0.5) -> None:
        """Until the learner finishes, the deadline passes, a stop is requested or ``on_tick`` returns True:
        restart crashed children."""
        while not self.stopping:
            if deadline is not None and time.monotonic() > deadline:
                log.info("time budget reached")
                break
            if self.tick():
                return
            if on_tick is not None and on_tick():
                log.info("stopped by the caller")
                break
            time.sleep(tick_s)

    def tick(self) -> bool:
        """One round of the watch: restart whatever crashed; True when the learner has exited."""
        return any([self._check(child) for child in self.children])

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _check(self, child: Child) -> bool:
        """Restart a crashed child; True when the run is over (the learner exited)."""
        if child.done or child.proc is None:
            return False
        rc = child.proc.poll()
        if rc is None:
            return False
        child.reap()
        if rc == 0 or self.stopping:
            child.done = True
            return child.name == "learner"
        if child.next_start == 0.0:
            reset = self.cfg.restart_reset_s
            if reset and time.monotonic() - child.started_at >= reset:
                child.crashes = 0  # it ran stably: a fresh back-off
            child.restarts += 1
            child.crashes += 1
            self.on_crash(child, rc)
            reason = child.exit_reason(rc)
            if child.crashes > self.cfg.max_restarts:
                log.error("%s exited with %d (%s); %d crashes in a row: giving up", child.name, rc, reason,
                          child.crashes)
                self.learner_failed = self.learner_failed or child.name == "learner"
                child.done = True
                return child.name == "learner"
            delay = self.cfg.restart_backoff_s * 2 ** (child.crashes - 1)
            log.warning("%s exited with %d (%s); restart %d in %.1fs", child.name, rc, reason, child.restarts, delay)
            child.next_start = time.monotonic() + delay
        elif time.monotonic() >= child.next_start:
            child.next_start = 0.0
            child.start()
            self.write_status()
        return False

    def stop_all(self, timeout_s: float = 60.0) -> None:
        """SIGTERM everyone (the learner checkpoints on it), then SIGKILL whatever is left after the timeout."""
        self.stopping = True
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.reap()
            if child.name == "learner" and child.proc.returncode not in (0, -signal.SIGTERM):
                self.learner_failed = True
            child.log_file.close()

    def status_lines(self) -> list[str]:
        return [c.status() for c in self.children]


def write_configs(cfg: RunConfig, resolved: dict[str, dict[str, Any]]) -> dict[str, Path]:
    out = cfg.out / "configs"
    out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "run-config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    paths = {}
    for role, data in resolved.items():
        paths[role] = out / f"{role}.yaml"
        paths[role].write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The learner's metrics.jsonl so far (a line being written right now is skipped)."""
    from grpo_core.jsonl import read_lines

    return list(read_lines(path))


def summarize(cfg: RunConfig, wall_s: float, supervisor: Supervisor, extra: dict[str, Any]) -> dict[str, Any]:
    """summary.json: what the run did, from the learner's own records."""
    from grpo_core.jsonl import read_lines

    lineage = list(read_lines(cfg.out / "lineage.jsonl"))
    trained = [e for line in lineage for e in line["trained"]]
    dropped = [e for line in lineage for e in line["dropped"]]
    skipped = sum(r["to"] - r["from"] for line in lineage for r in line.get("operator_skip", []))
    staleness = [e["staleness"] for e in trained]
    metrics = read_metrics(cfg.out / "metrics.jsonl")
    initial = 1 if cfg.learner.get("publish_initial", True) else 0
    summary = {
        "run_dir": str(cfg.out), "learner_steps": lineage[-1]["step"] if lineage else 0,
        "offsets_operator_skipped": skipped,
        "wall_seconds": round(wall_s, 1), "groups_trained": len(trained),
        "groups_dropped_stale": sum(e["reason"] == "stale" for e in dropped),
        "groups_dropped_other": sum(e["reason"] != "stale" for e in dropped),
        "mean_staleness": (sum(staleness) / len(staleness)) if staleness else 0.0,
        "weight_versions_published": initial + sum("publish" in m.get("timings", {}) for m in metrics),
        "restarts": {c.name: c.restarts for c in supervisor.children if c.restarts},
        "learner_failed": supervisor.learner_failed, **extra,
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class Progress:
    """The learner's progress from its metrics.jsonl: a tqdm bar on a terminal, a log line otherwise."""

    def __init__(self, cfg: RunConfig, tty: bool) -> None:
        from tqdm import tqdm

        self.path = cfg.out / "metrics.jsonl"
        total = int(cfg.learner.get("max_steps", 0)) or None
        self.bar = tqdm(total=total, unit="step", desc=cfg.name, disable=not tty, dynamic_ncols=True)
        self.tty, self.seen, self.last_log = tty, 0, 0.0

    def tick(self) -> None:
        lines = read_metrics(self.path)
        if len(lines) <= self.seen:
            return
        new, self.seen = lines[self.seen:], len(lines)
        last = new[-1]
        stale = [s for m in new for s in m.get("staleness", [])]
        step_s = sum(last.get("timings", {}).values()) or 1e-9
        info = {"reward": f"{last.get('reward_mean', 0.0):.3f}",
                "staleness": f"{(sum(stale) / len(stale)) if stale else 0.0:.2f}",
                "tok/s": f"{last.get('tokens', 0) / step_s:.0f}"}
        self.bar.update(len(new))
        self.bar.set_postfix(info, refresh=True)
        if not self.tty and time.monotonic() - self.last_log > STATUS_EVERY_S:
            self.last_log = time.monotonic()
            log.info("learner step %d: %s", last["step"], " ".join(f"{k} {v}" for k, v in info.items()))

    def write(self, text: str) -> None:
        self.bar.write(text.rstrip("\n")) if self.tty else sys.stdout.write(text)

    def close(self) -> None:
        self.bar.close()


def execute(cfg: RunConfig, tty: bool | None = None, on_tick: Callable[[], bool | None] | None = None,
            tick_s: float = 0.5) -> tuple[dict[str, Any], int]:
    """Run the pipeline described by ``cfg`` to its end; returns (summary, exit code). ``on_tick`` runs every
    ``tick_s`` in the supervisor (the demo evaluates published weights from it); True from it ends the run."""
    from grpo_core.kafka_io import make_admin
    from grpo_core.topics import ensure_topics
    from grpo_stream.broker import LocalBroker, free_port

    tty = sys.stdout.isatty() if tty is None else tty
    # Every role's section and model path before anything starts (a broker, topics, a port): one line, exit 2.
    role_configs(cfg, cfg.kafka.bootstrap or os.environ.get("KAFKA_BOOTSTRAP") or "127.0.0.1:9092", paths=True)
    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    broker = None
    run_metrics = RunMetrics(cfg.metrics_host, cfg.metrics_port).start()  # a taken port fails before the broker
    bootstrap = cfg.kafka.bootstrap or os.environ.get("KAFKA_BOOTSTRAP")
    if not bootstrap:  # the embedded default: a broker of our own for the run, stopped at the end
        broker = LocalBroker(data_dir=cfg.out / "kafka", port=free_port(), controller_port=free_port())
        bootstrap = broker.up(fresh=True)["bootstrap"]
    progress = Progress(cfg, tty)
    # Children's INFO lines go to their log files only (runs/<name>/logs/): on a terminal the bar owns the screen,
    # and without one (CI, nohup) thousands of step and batch lines buried the warnings; progress comes as a
    # status line every STATUS_EVERY_S instead.
    sup = Supervisor(cfg, sink=lambda name, line: _route(progress, name, line))
    run_metrics.watch(sup)
    try:
        admin = make_admin(KafkaConfig(**{**to_dict(cfg.kafka), "bootstrap": bootstrap}))
        ensure_topics(admin, cfg.contract)
        admin.close()
        paths = write_configs(cfg, role_configs(cfg, bootstrap))
        _install_signals(sup, progress)
        sup.spawn("learner", 0, paths["learner"])
        for i in range(cfg.verifiers.count):
            sup.spawn("verifier", i, paths["verifier"])
        for i in range(cfg.producers.count):
            sup.spawn("producer", i, paths["producer"])
        if "feeder" in paths:
            sup.spawn("feeder", 0, paths["feeder"])
        deadline = started + 60 * cfg.max_minutes if cfg.max_minutes else None
        def tick() -> bool:
            progress.tick()
            return bool(on_tick is not None and on_tick())

        sup.watch(deadline, tick, tick_s)
    finally:
        sup.stop_all()
        progress.tick()
        progress.close()
        if broker is not None:
            broker.down()
        run_metrics.stop()
    summary = summarize(cfg, time.monotonic() - started, sup, {})
    return summary, 1 if sup.learner_failed else 0


def _route(progress: Progress, name: str, line: str) -> None:
    # A traceback's header says nothing; the supervisor's line on the exit names the error (Child.exit_reason).
    if " WARNING " in line or " ERROR " in line or " CRITICAL " in line:
        progress.write(f"[{name}] {line}")


def _install_signals(sup: Supervisor, progress: Progress) -> None:
    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping the run", signum)
        sup.stopping = True

    def status(_signum: int, _frame: object) -> None:
        for line in sup.status_lines():
            progress.write(line + "\n")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, status)


def main(config: str, overrides: list[str]) -> int:
    from grpo_core.config import load_config
    from grpo_stream.report import write_report

    cfg = load_config(RunConfig, config, overrides)
    summary, rc = execute(cfg)
    write_report(cfg.out)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {cfg.out} (summary.json, report.png, metrics.jsonl, lineage.jsonl, logs/)")
    return rc
