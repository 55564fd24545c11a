"""``grpo-stream chaos``: the real pipeline through a broker of its own, put through what operators meet, then
reconciled (``grpo_stream.audit``).

A finite feed of ``prompts`` prompts runs through the feeder, producers (HF backend, a tiny model), a verifier
and the learner, each its own process under the run supervisor (which restarts what dies, as ``grpo-stream run``
does). At seeded learner steps it: injects a near-limit record and a handful of malformed ones into ``prompts``,
``completions`` and ``groups``; scales the producers 1 -> 3 (consumer-group rebalances under load); kill -9s
each role once, in a seeded order; stops and restarts the broker; re-sends an already-trained group; damages the
newest published weight version in the store; kill -9s the learner and damages its newest checkpoint (it must
resume from the previous intact one); scales the producers back to 1. When the feed is done and every consumer
group has caught up, it reconciles and prints the table. A run keeps its promises when nothing was trained twice,
no ``groups`` offset is unaccounted for, no fed prompt is lost, no process crashed unless it was killed, every
process is alive at the end except those that finished (the feeder, the producers scaled away), and the damaged
checkpoint was set aside, not used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config
from grpo_core.contract import PipelineContract
from grpo_core.jsonl import read_lines
from grpo_core.kafka_io import consumer_lag, end_offsets, make_admin, make_producer, partitions_of, read_topic
from grpo_core.topics import ensure_topics
from grpo_stream.audit import Audit, audit_run, format_audit, offset_hits
from grpo_stream.broker import LocalBroker, restartable_port
from grpo_stream.configs import shipped_config
from grpo_stream.run import Child, RunConfig, Supervisor, read_metrics, role_configs, write_configs

log = logging.getLogger("chaos")
KILLABLE = ("producer", "verifier", "learner", "feeder")
LEARNER_READY = "learner reads "  # grpo_learner.source logs it once per start, after the checkpoint is restored


@dataclass
class ChaosResult:
    audit: Audit
    events: list[str] = field(default_factory=list)
    kills: dict[str, int] = field(default_factory=dict)  # child name -> kill -9s it got
    restarts: dict[str, int] = field(default_factory=dict)
    states: dict[str, str] = field(default_factory=dict)  # child name -> running | finished | down
    drained: bool = False
    wall_s: float = 0.0
    damaged: list[str] = field(default_factory=list)  # checkpoints damaged on purpose
    quarantined: list[str] = field(default_factory=list)  # checkpoints the learner moved aside at the end

    def broken(self) -> list[str]:
        """Every promise the run broke (empty: it kept them all)."""
        out = self.audit.broken()
        out += [f"{n} crashed {r - self.kills.get(n, 0)} time(s) unasked" for n, r in self.restarts.items()
                if r > self.kills.get(n, 0)]
        out += [f"{n} is {s} at the end" for n, s in self.states.items() if s == "down"]
        out += [f"{r} was never killed" for r in KILLABLE if not any(n.startswith(r) for n in self.kills)]
        out += [f"the damaged checkpoint {n} was not set aside" for n in self.damaged
                if f"damaged-{n}" not in self.quarantined]
        return out + ([] if self.drained else ["the pipeline did not drain within the budget"])

    def table(self) -> str:
        procs = {n: f"{s}, restarts {self.restarts.get(n, 0)}, kill -9 {self.kills.get(n, 0)}"
                 for n, s in self.states.items()}
        return format_audit(self.audit, procs) + f"\nwall-clock  {self.wall_s:.0f} s"


def schedule(seed: int) -> list[tuple[int, str]]:
    """(learner steps of progress since the previous event, event), in order; the kills' order and every
    distance are drawn from ``seed``. Progress, not time: each event lands on a pipeline that recovered from the
    last one and is busy again."""
    rng = random.Random(seed)
    kills = [f"kill {r}" for r in KILLABLE]
    rng.shuffle(kills)
    events = ["inject", "scale 3", kills[0], kills[1], "broker restart", kills[2], "duplicate", "damage weights",
              kills[3], "damage checkpoint", "scale 1"]
    return [(rng.randint(2, 4), event) for event in events]


def junk(contract: PipelineContract, kafka: KafkaConfig, key: str, rng: random.Random) -> list[bytes | None]:
    """A near-limit record and a handful of malformed ones for topic ``key``."""
    limit = contract.record_limit(key, kafka)  # type: ignore[arg-type]
    near = msgpack.packb({"_t": "prompt_task", "_v": wire.SCHEMA_VERSION, "prompt_id": "huge", "task": "exact",
                          "prompt": "x" * (limit - 64 * 1024)}, use_bin_type=True)
    wrong_type = wire.encode(wire.PromptTask(prompt_id="p", prompt="1", task="exact"))
    if key == "prompts":
        wrong_type = wire.encode(wire.WeightChunk(run="r", version=0, index=0, num_chunks=1, data=b"x"))
    return [near, rng.randbytes(limit - 64 * 1024), rng.randbytes(64), msgpack.packb([1, 2, 3]),
            msgpack.packb({"_t": "scored_group", "_v": 99}), b"", None, wrong_type]


class Chaos:
    def __init__(self, cfg: RunConfig, seed: int, minutes: float) -> None:
        self.cfg, self.seed, self.minutes = cfg, seed, minutes
        self.rng = random.Random(seed)
        ports: set[int] = set()
        self.broker = LocalBroker(data_dir=cfg.out / "kafka", port=restartable_port(ports),
                                  controller_port=restartable_port(ports))
        self.kafka = dataclasses.replace(cfg.kafka, bootstrap=self.broker.bootstrap)
        self.contract = cfg.contract
        self.sup = Supervisor(cfg, sink=lambda name, line: None)  # each child's log is in <out>/logs/
        self.result = ChaosResult(Audit())
        self.started = time.monotonic()
        self.paths: dict[str, Path] = {}

    def run(self) -> ChaosResult:
        self.started = started = time.monotonic()
        self.broker.up(fresh=True)
        try:
            self._start()
            deadline = started + 60 * self.minutes
            mark = 0
            for advance, event in schedule(self.seed):
                # A fast learner can train the whole feed before the schedule ends: the events left then land
                # on the drained pipeline (each still has to be met and recovered from) instead of waiting forever.
                if not self._wait(lambda m=mark + advance: self._step() >= m or self._drained(), deadline):  # type: ignore[misc]
                    break
                if self._step() < mark + advance:
                    self.result.events.append("  (the feed is trained: this event lands on the drained pipeline)")
                self._do(event)
                mark = self._step()
            self.result.drained = self._wait(self._drained, deadline, settle=12)
            self.result.events.append(f"{time.monotonic() - started:5.0f} s, step {self._step()}: "
                                      + ("drained" if self.result.drained else "not drained at the deadline"))
            # A producer scaled away gets SIGTERM and finishes its batch and closes its clients (up to
            # kafka_io.CLOSE_S): a run that drains within seconds of "scale 1" must not read it as still running.
            self._wait(self._stopped_ones_exited, min(deadline, time.monotonic() + 60))
            self.result.states = self._states()
            self.sup.stop_all()  # the learner checkpoints what it trained: the audit reads that checkpoint
            self.result.audit = audit_run(self.kafka, self.contract, self.cfg.out)
            self.result.quarantined = sorted(p.name for p in (self.cfg.out / "checkpoints").glob("damaged-*"))
        finally:
            self.sup.stop_all()
            self.broker.down()
        self.result.restarts = {c.name: c.restarts for c in self.sup.children}
        self.result.wall_s = time.monotonic() - started
        return self.result

    def _start(self) -> None:
        admin = make_admin(self.kafka)
        ensure_topics(admin, self.contract)
        admin.close()
        self.paths = write_configs(self.cfg, role_configs(self.cfg, self.kafka.bootstrap))
        self.sup.spawn("learner", 0, self.paths["learner"])
        self.sup.spawn("verifier", 0, self.paths["verifier"])
        self.sup.spawn("producer", 0, self.paths["producer"])
        self.sup.spawn("feeder", 0, self.paths["feeder"])

    def _wait(self, done: Callable[[], bool], deadline: float, settle: int = 1) -> bool:
        """Supervise (restart what died) until ``done()`` holds ``settle`` checks in a row; False at the deadline."""
        held = 0
        while time.monotonic() < deadline:
            self.sup.tick()
            held = held + 1 if done() else 0
            if held >= settle:
                return True
            time.sleep(0.25)  # short: a learner trains several steps a second here, and events count steps
        log.error("chaos: budget of %.1f min reached", self.minutes)
        return False

    def _step(self) -> int:
        """The highest learner step so far (a restarted learner repeats steps from its checkpoint)."""
        return max((int(line.get("step", 0)) for line in read_metrics(self.cfg.out / "metrics.jsonl")), default=0)

    def _do(self, event: str) -> None:
        log.info("chaos at learner step %d: %s", self._step(), event)
        self.result.events.append(f"{time.monotonic() - self.started:5.0f} s, step {self._step()}: {event}")
        if event == "inject":
            self._inject()
        elif event.startswith("scale"):
            self._scale(int(event.split()[1]))
        elif event.startswith("kill"):
            self._kill(event.split()[1])
        elif event == "broker restart":
            self.broker.down()
            time.sleep(8.0)
            self.broker.up()
        elif event == "damage weights":
            self._damage_newest(self.cfg.out / "weights" / self.contract.run, "v*")
        elif event == "damage checkpoint":
            self._kill("learner")  # first: a learner still running could checkpoint a newer step meanwhile
            damaged = self._damage_newest(self.cfg.out / "checkpoints", "step-*", "model")
            self.result.damaged += [damaged] if damaged else []
        elif event == "duplicate":
            first = next(m for m in read_topic(self.kafka, self.contract.topic("groups")) if _is_group(m.value))
            self._send("groups", [first.value], record_key=first.key)

    def _damage_newest(self, root: Path, pattern: str, sub: str = "") -> str:
        """Overwrite 4 KiB of the newest ``pattern`` directory's model file with NaNs (what a bad block or a
        botched copy does); its name, or "" if there is none."""
        found = sorted(root.glob(pattern))
        target = found[-1] / sub / "model.safetensors" if found else None
        if target is None or not target.is_file():
            self.result.events.append(f"  nothing to damage under {root}")
            return ""
        with target.open("r+b") as f:
            f.seek(-4096, os.SEEK_END)
            f.write(b"\x7f\xc0\x00\x00" * 1024)  # 1024 float32 NaNs
        self.result.events.append(f"  damaged {target.relative_to(self.cfg.out)}")
        return found[-1].name

    def _inject(self) -> None:
        for key in ("prompts", "completions", "groups"):
            self._send(key, junk(self.contract, self.kafka, key, self.rng))

    def _send(self, key: str, values: list[bytes | None], record_key: bytes | None = b"chaos") -> None:
        producer = make_producer(self.kafka, "chaos")
        try:
            for value in values:
                producer.send(self.contract.topic(key), key=record_key, value=value).get(timeout=60)  # type: ignore[arg-type]
        finally:
            producer.close()

    def _scale(self, n: int) -> None:
        live = [c for c in self.sup.children if c.name.startswith("producer-") and not c.done]
        for i in range(len(live), n):
            self.sup.spawn("producer", i, self.paths["producer"])
        for child in live[n:]:
            child.done = True  # scaled away on purpose: a clean stop, not to be restarted
            if child.proc is not None:
                child.proc.send_signal(signal.SIGTERM)

    def _kill(self, role: str) -> None:
        targets = [c for c in self.sup.children if c.name.startswith(role) and not c.done
                   and c.proc is not None and c.proc.poll() is None]
        if not targets:
            self.result.events.append(f"  {role}: nothing running to kill")
            return
        child = self.rng.choice(targets)
        os.kill(child.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        self.result.kills[child.name] = self.result.kills.get(child.name, 0) + 1

    def _drained(self) -> bool:
        """The feed is done, producers and verifiers consumed everything before them, and the learner's steps
        account for every ``groups`` offset. Its lineage says so, not its consumer group: that commits past the
        groups it has only read (queued for the next step)."""
        feeder = self.sup.child("feeder")
        if not (feeder.done and feeder.proc is not None and feeder.proc.returncode == 0) or not self._learner_up():
            return False
        admin = make_admin(self.kafka)
        try:
            lags = [consumer_lag(admin, self.contract.group(g), self.contract.topic(t))  # type: ignore[arg-type]
                    for g, t in (("producers", "prompts"), ("verifiers", "completions"))]
            groups = self.contract.topic("groups")
            end = sum(end_offsets(admin, groups, partitions_of(admin, groups)).values())
        finally:
            admin.close()
        accounted = len(offset_hits(read_lines(self.cfg.out / "lineage.jsonl")))
        return all(lag and sum(lag.values()) == 0 for lag in lags) and accounted >= end

    def _learner_up(self) -> bool:
        """Whether the learner started since its last kill -9 has restored its state: until then the lineage
        still holds the lost incarnation's steps and would read as drained."""
        log_file = self.cfg.out / "logs" / "learner.log"
        starts = log_file.read_text(errors="replace").count(LEARNER_READY) if log_file.is_file() else 0
        return starts > sum(n for name, n in self.result.kills.items() if name.startswith("learner"))

    def _stopped_ones_exited(self) -> bool:
        return all(c.proc is None or c.proc.poll() is not None for c in self.sup.children if c.done)

    def _states(self) -> dict[str, str]:
        def state(c: Child) -> str:
            if c.proc is not None and c.proc.poll() is None:
                return "running"
            clean = c.proc is not None and c.proc.returncode in (0, -signal.SIGTERM)
            return "finished" if c.done and clean else "down"

        return {c.name: state(c) for c in self.sup.children}


def _is_group(value: bytes) -> bool:
    try:
        wire.decode(value, wire.ScoredGroup)
    except wire.WireError:
        return False
    return True


def chaos_config(out: Path, model: Path, prompts: int, overrides: list[str]) -> RunConfig:
    """The shipped chaos run (``configs/chaos.yaml``) for ``model``, writing to ``out``."""
    weights = out / "weights"
    return load_config(RunConfig, str(shipped_config("chaos.yaml")), [
        f"out_dir={out}", f"learner.model.path={model}", f"producers.config.backend.model={model}",
        f"learner.weights.fs.root={weights}", f"producers.config.weights.fs.root={weights}",
        f"feeder.synthetic.num_items={prompts}", *overrides])


def main(seed: int, prompts: int, minutes: float, out: str | None, overrides: list[str]) -> int:
    from grpo_stream.tiny_model import build_tiny_model

    root = Path(out or f"runs/chaos-seed{seed}")
    cfg = chaos_config(root, build_tiny_model(root / "model"), prompts, overrides)
    result = Chaos(cfg, seed, minutes).run()
    print("\n".join(result.events))
    print(result.table())
    broken = result.broken()
    print("promises kept" if not broken else "BROKEN: " + "; ".join(broken))
    return 1 if broken else 0
