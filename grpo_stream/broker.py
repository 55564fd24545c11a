"""Local single-node Apache Kafka broker (KRaft, broker+controller in one JVM) for development and tests.

Everything the broker owns lives under one data dir (default ``.cache/kafka/data``)::

    server.properties  log4j2.properties  cluster.id  broker.json
    kraft-logs/        (metadata log, topic partitions, meta.properties)
    logs/server.log    logs/stdout.log

The JVM runs in its own session so it outlives the ``grpo-stream kafka up`` process that launched it;
``down`` finds it again through ``broker.json`` (or, as a fallback, by scanning /proc for our config path).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_stream.broker_security import BrokerSecurity

log = logging.getLogger(__name__)

# Relative to the working directory (the checkout, where ops/setup.sh puts the jars), unless the environment or
# the caller says otherwise: an installed package has no checkout to find them in.
DEFAULT_LIBS_DIR = Path(".cache") / "kafka" / "libs"
DEFAULT_DATA_DIR = Path(".cache") / "kafka" / "data"
LIBS_ENV = "GRPO_STREAM_KAFKA_LIBS"
DATA_ENV = "GRPO_STREAM_KAFKA_DATA"
MIN_JAVA = 17
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The JIT and the collector of the JVMs this module starts, unless $KAFKA_JVM_PERFORMANCE_OPTS (the variable
# Kafka's own start scripts read) names others. C1 only: a pipeline's broker spent nearly half of its CPU
# compiling (C2 most of it), on cores the learner and the producers need, while its hot path (socket reads,
# CRC32C, file appends) is native code that C2 does not speed up. Serial collector: G1's concurrent threads
# cost more than they save on a 512 MB heap. Figures: docs/getting-started.md, "The local broker".
JVM_PERF_ENV = "KAFKA_JVM_PERFORMANCE_OPTS"
JVM_PERF_OPTS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
# Files whose presence marks a directory as ours, so that fresh=True never wipes an unrelated directory.
_OWNED_MARKERS = ("server.properties", "cluster.id", "broker.json", "kraft-logs", "log4j2.properties")
_JAR_RE = re.compile(r"^kafka_[0-9.]+-([0-9][0-9A-Za-z.]*)\.jar$")


class BrokerError(RuntimeError):
    """Anything that stops the local broker from starting or stopping; the message says what to do."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def restartable_port(taken: set[int]) -> int:
    """A free port below the ephemeral range, for a broker that is stopped and started again: while it is down its
    clients keep connecting, and a port from that range can be handed to one of them as its source port (a TCP
    self-connect), so the broker could not bind it again."""
    for _ in range(200):
        port = random.randrange(20_000, 32_000)
        if port not in taken and port_is_free(port):
            taken.add(port)
            return port
    raise BrokerError("no free port in 20000-32000")


def port_is_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port.

    SO_REUSEADDR (which the JVM sets on its server sockets too) keeps TIME_WAIT connections left by a
    broker we just stopped from looking like a taken port, while a live listener still fails the bind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def new_cluster_id() -> str:
    """A random Kafka-style Uuid: 16 bytes, base64url without padding (22 chars).

    Like Kafka's Uuid.randomUuid we skip ids starting with '-' because they parse as a CLI flag.
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode("ascii")
        if not cid.startswith("-"):
            return cid


def jvm_performance_opts() -> list[str]:
    """:data:`JVM_PERF_OPTS`, or the words of ``$KAFKA_JVM_PERFORMANCE_OPTS`` when it is set and not blank."""
    chosen = os.environ.get(JVM_PERF_ENV, "").split()
    return chosen or list(JVM_PERF_OPTS)


def kafka_version(libs_dir: Path) -> str | None:
    """The Kafka version from the kafka_2.13-X.jar file name, or None if the jar is absent."""
    if not libs_dir.is_dir():
        return None
    for jar in sorted(libs_dir.iterdir()):
        m = _JAR_RE.match(jar.name)
        if m:
            return m.group(1)
    return None


def java_executable() -> str:
    """The java binary ($JAVA_HOME/bin/java first, then PATH); raises BrokerError if it is missing or < 17."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    java = str(candidate) if candidate and candidate.is_file() else shutil.which("java")
    hint = "Debian/Ubuntu: sudo apt-get install openjdk-17-jre-headless (or run ./ops/setup.sh as root)"
    if not java:
        raise BrokerError(f"Java >= {MIN_JAVA} is needed to run the Kafka broker; no `java` on PATH. {hint}")
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BrokerError(f"could not run `{java} -version`: {e}. {hint}") from e
    major = parse_java_major(out.stderr + out.stdout)
    if major is None or major < MIN_JAVA:
        raise BrokerError(
            f"Java >= {MIN_JAVA} is required to run the Kafka broker; `{java} -version` reports "
            f"{'an unknown version' if major is None else major}. {hint}"
        )
    return java


def parse_java_major(version_output: str) -> int | None:
    """Major version from `java -version` output: '1.8.0_292' -> 8, '17.0.15' -> 17, '21' -> 21."""
    m = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not m:
        return None
    major = int(m.group(1))
    # Java <= 8 reported itself as 1.x.
    return int(m.group(2) or 0) if major == 1 else major


def _task_states(pid: int) -> list[str]:
    """The state letter of every thread of pid ([] once the process is gone)."""
    states = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        # The state field follows the parenthesised command name, which may itself contain spaces or ')'.
        states.append(stat[stat.rfind(")") + 2 :][:1])
    return states


def _pid_alive(pid: int) -> bool:
    """True while any thread of pid runs. A zombie answers kill -0 but is dead for our purposes; yet a JVM's
    main thread turns zombie while its other threads (and its sockets) are still shutting down, so all
    threads are checked, not only the leader."""
    return any(state not in ("Z", "X", "") for state in _task_states(pid))


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _reap(pid: int) -> None:
    """Collect the exit status of a dead broker that is our own child (tests), so no zombie keeps the pid.
    Called only once every thread has exited, so the blocking wait returns at once."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step_s)


class LocalBroker:
    """One local Kafka broker+controller bound to 127.0.0.1, with all of its state under ``data_dir``."""

    def __init__(
        self,
        data_dir: Path | str | None = None,
        port: int = 9092,
        controller_port: int | None = None,
        libs_dir: Path | str | None = None,
        heap_mb: int = 512,
        security: BrokerSecurity | None = None,
    ) -> None:
        data = data_dir or os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR
        libs = libs_dir or os.environ.get(LIBS_ENV) or DEFAULT_LIBS_DIR
        # Absolute paths: they are baked into server.properties and matched against /proc/*/cmdline.
        self.data_dir = Path(data).expanduser().resolve()
        self.libs_dir = Path(libs).expanduser().resolve()
        self.port = int(port)
        self.controller_port = int(controller_port) if controller_port is not None else self.port + 1
        if self.port == self.controller_port:
            raise BrokerError(f"broker port and controller port must differ (both are {self.port})")
        if heap_mb < 128:
            raise BrokerError(f"heap_mb={heap_mb} is too small for a Kafka broker; use at least 128")
        self.heap_mb = int(heap_mb)
        self.security = security  # None: a plaintext client listener; else SASL/SCRAM (+ TLS), see broker_security
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- paths -------------------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def server_properties(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log4j_config(self) -> Path:
        return self.data_dir / "log4j2.properties"

    @property
    def state_file(self) -> Path:
        return self.data_dir / "broker.json"

    @property
    def cluster_id_file(self) -> Path:
        return self.data_dir / "cluster.id"

    @property
    def kraft_dir(self) -> Path:
        return self.data_dir / "kraft-logs"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    # ---- public API --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """{"running", "bootstrap", "pid", "version"}; running means our JVM for this data dir is alive."""
        state = self._read_state()
        pid = self._running_pid(state)
        version = kafka_version(self.libs_dir) or state.get("version")
        bootstrap = state.get("bootstrap") if pid is not None and state.get("bootstrap") else self.bootstrap
        return {"running": pid is not None, "bootstrap": bootstrap, "pid": pid, "version": version}

    def up(self, fresh: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
        """Start the broker (or find it already running); returns its state once it answers admin requests."""
        version = self._check_jars()
        java = java_executable()
        running = self._already_running(fresh, timeout_s)
        if running is not None:
            return running
        if fresh:
            self._wipe()
        for what, port in (("broker", self.port), ("controller", self.controller_port)):
            if not port_is_free(port):
                flag = "--port" if what == "broker" else "--controller-port"
                raise BrokerError(
                    f"{what} port 127.0.0.1:{port} is already in use by another process; "
                    f"pick a free one with {flag} (or stop whatever listens there)"
                )
        self._write_configs()
        cluster_id = self._prepare_storage(java)
        proc = self._spawn(java)
        state = {
            "pid": proc.pid,
            "bootstrap": self.bootstrap,
            "port": self.port,
            "controller_port": self.controller_port,
            "version": version,
            "cluster_id": cluster_id,
            "started_at": time.time(),
        }
        # Written before the readiness wait so that `down` can find a broker whose start was interrupted.
        self._write_state(state)
        self._wait_ready(proc, timeout_s)
        log.info("Kafka %s broker up at %s (pid %d, %s)", version, self.bootstrap, proc.pid, self.data_dir)
        return state

    def down(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL after timeout_s). True if one was running."""
        state = self._read_state()
        pids = {p for p in (self._running_pid(state),) if p is not None} | set(self._scan_pids())
        for pid in pids:
            self._stop_pid(pid, timeout_s)
        if state.get("pid") is not None:
            state["pid"] = None
            self._write_state(state)
        if pids:
            log.info("Kafka broker stopped (pid %s, %s)", ", ".join(map(str, sorted(pids))), self.data_dir)
        return bool(pids)

    def prepare(self, fresh: bool = False) -> str:
        """Write the configs and format the storage if needed, without starting; returns the cluster id."""
        self._check_jars()
        java = java_executable()
        if fresh:
            if self._running_pid(self._read_state()) is not None:
                raise BrokerError(f"a broker runs from {self.data_dir}; run `grpo-stream kafka down` first")
            self._wipe()
        self._write_configs()
        return self._prepare_storage(java)

    # ---- start-up steps ----------------------------------------------------------------------------
    def _check_jars(self) -> str:
        version = kafka_version(self.libs_dir)
        if version is None:
            raise BrokerError(
                f"the Kafka broker jars are missing: no kafka_2.13-*.jar in {self.libs_dir}. "
                f"Run ./ops/setup.sh to fetch them (or point ${LIBS_ENV} at a directory with the jars)"
            )
        return version

    def _already_running(self, fresh: bool, timeout_s: float) -> dict[str, Any] | None:
        """The state of a broker already running from this data dir, or None if there is none (any more)."""
        state = self._read_state()
        pid = self._running_pid(state)
        if pid is None:
            return None
        if fresh:
            # fresh=True explicitly asks for an empty broker, so the running one must go first.
            log.info("stopping the running broker (pid %d) before wiping %s", pid, self.data_dir)
            self.down()
            return None
        ports = (state.get("port"), state.get("controller_port"))
        if ports != (self.port, self.controller_port):
            raise BrokerError(
                f"a broker is already running on port {state.get('port')} (controller {ports[1]}) "
                f"from {self.data_dir}; run `grpo-stream kafka down` first to restart it on port {self.port}"
            )
        # It may still be starting (another `up` launched it a moment ago): give it the same deadline.
        self._wait_ready(None, timeout_s, pid=pid)
        log.info("Kafka broker already running at %s (pid %d)", self.bootstrap, pid)
        state["pid"] = pid
        return state

    def _wipe(self) -> None:
        if not self.data_dir.exists():
            return
        entries = list(self.data_dir.iterdir())
        if entries and not any((self.data_dir / m).exists() for m in _OWNED_MARKERS):
            raise BrokerError(
                f"refusing to wipe {self.data_dir}: it is not empty and does not look like a broker data dir"
            )
        shutil.rmtree(self.data_dir)

    def _write_configs(self) -> None:
        """(Re)write server.properties and the log4j2 config; ports may differ from the previous run."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.kraft_dir),
            # Single node: every internal topic has exactly one replica.
            "offsets.topic.replication.factor": "1",
            # 4 instead of 50 partitions: the first consumer group gets its coordinator much sooner.
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # No other members will ever join, so waiting for them only slows tests down.
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
            # Topics are created explicitly with the right partition counts; typos must fail loudly.
            "auto.create.topics.enable": "false",
            # Weight chunks go through Kafka as records of up to 64 MiB.
            "message.max.bytes": str(MAX_MESSAGE_BYTES),
            "replica.fetch.max.bytes": str(MAX_MESSAGE_BYTES),
            # A produce request may carry a full batch plus overhead; keep head-room over one record.
            "socket.request.max.bytes": str(2 * MAX_MESSAGE_BYTES),
            "log.retention.hours": "168",
        }
        if self.security is not None:
            props |= self.security.server_props(self.port, self.controller_port)
        text = "# written by grpo_stream.broker; rewritten on every `up`\n"
        text += "".join(f"{k}={v}\n" for k, v in props.items())
        self.server_properties.write_text(text)
        self.log4j_config.write_text(self._log4j2_text())

    def _log4j2_text(self) -> str:
        server_log = str(self.logs_dir / "server.log").replace("\\", "/")
        return "\n".join(
            [
                "# written by grpo_stream.broker: INFO to logs/server.log, nothing on stdout",
                "name = grpo-stream-broker",
                "status = error",
                # Without this log4j complains on stderr that it cannot register its hook during JVM exit.
                "shutdownHook = disable",
                "appender.file.type = File",
                "appender.file.name = FILE",
                f"appender.file.fileName = {server_log}",
                "appender.file.append = true",
                "appender.file.layout.type = PatternLayout",
                "appender.file.layout.pattern = [%d] %p %m (%c)%n",
                "rootLogger.level = INFO",
                "rootLogger.appenderRef.file.ref = FILE",
                "",
            ]
        )

    def _prepare_storage(self, java: str) -> str:
        """Format the KRaft storage unless it already is; returns the cluster id, checked against ours."""
        meta = self.kraft_dir / "meta.properties"
        ours = self._read_text(self.cluster_id_file)
        if meta.exists():
            theirs = _read_properties(meta).get("cluster.id")
            if ours and theirs and ours != theirs:
                raise BrokerError(
                    f"data dir {self.data_dir} belongs to cluster {theirs}, not {ours}; "
                    f"use --fresh to wipe it (or pick another --data-dir)"
                )
            cluster_id = theirs or ours
            if not cluster_id:
                raise BrokerError(f"{meta} has no cluster.id; use --fresh to wipe {self.data_dir}")
            self.cluster_id_file.write_text(cluster_id + "\n")
            return cluster_id
        cluster_id = ours or new_cluster_id()
        self.cluster_id_file.write_text(cluster_id + "\n")
        cmd = [java, *self._jvm_common(), STORAGE_TOOL, "format", "--standalone", "-t", cluster_id,
               "-c", str(self.server_properties),
               *(self.security.format_args() if self.security else [])]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0 or not meta.exists():
            raise BrokerError(
                f"formatting the Kafka storage in {self.kraft_dir} failed (exit {out.returncode}):\n"
                f"{(out.stdout + out.stderr).strip()}\n{_tail(self.logs_dir / 'server.log', 15)}"
            )
        return cluster_id

    def _jvm_common(self) -> list[str]:
        # The config dir on the class path is what the issue asks for; the explicit property wins either way.
        classpath = f"{self.libs_dir}/*{os.pathsep}{self.data_dir}"
        log4j = f"-Dlog4j2.configurationFile={self.log4j_config}"
        return [*jvm_performance_opts(), log4j, "-Djava.awt.headless=true", "-cp", classpath]

    def _spawn(self, java: str) -> subprocess.Popen[bytes]:
        xms = min(256, self.heap_mb)
        cmd = [java, f"-Xms{xms}m", f"-Xmx{self.heap_mb}m", *self._jvm_common(),
               KAFKA_MAIN, str(self.server_properties)]  # fmt: skip
        with open(self.logs_dir / "stdout.log", "wb") as out:
            # Own session: the broker must survive the short-lived CLI process (and its terminal's SIGHUP).
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=True,
            )  # fmt: skip
        return self._proc

    def _wait_ready(
        self, proc: subprocess.Popen[bytes] | None, timeout_s: float, pid: int | None = None
    ) -> None:
        """Block until the broker answers an admin request; raise (and stop it) if it dies or times out."""
        pid = proc.pid if proc is not None else pid
        assert pid is not None
        deadline = time.monotonic() + timeout_s
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            dead = proc.poll() is not None if proc is not None else not _pid_alive(pid)
            if dead:
                code = proc.returncode if proc is not None else "?"
                raise BrokerError(f"the Kafka broker exited on start-up (exit {code})\n{self._log_tails()}")
            try:
                self._ping(min(5.0, max(0.5, deadline - time.monotonic())))
                return
            except Exception as e:  # kafka-python raises many unrelated types while the broker starts
                last_error = f"{type(e).__name__}: {e}"
            time.sleep(0.25)
        if proc is not None:
            # We started it, so we also clean it up rather than leave a half-started JVM behind.
            self._stop_pid(pid, 10.0)
        what = "it was stopped" if proc is not None else "run `grpo-stream kafka down` and try again"
        raise BrokerError(
            f"the Kafka broker at {self.bootstrap} (pid {pid}) did not answer within {timeout_s:.0f}s "
            f"(last error: {last_error}); {what}.\n{self._log_tails()}"
        )

    def _ping(self, timeout_s: float) -> None:
        # A plain TCP probe first: until the listener is up, kafka-python would log connection errors
        # at ERROR level on every attempt and back off for seconds.
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s):
            pass
        # Imported lazily: kafka-python costs import time that `status`/`down` never need.
        from grpo_core.kafka_io import Admin

        ms = int(timeout_s * 1000)
        login = self.security.client_settings() if self.security else {}
        admin = Admin(bootstrap_servers=self.bootstrap, request_timeout_ms=ms, client_id="grpo-stream-broker-ping",
                      **login)
        try:
            admin.describe_cluster()
            admin.list_topics()
        finally:
            admin.close()

    def _log_tails(self) -> str:
        parts = []
        for name in ("stdout.log", "server.log"):
            tail = _tail(self.logs_dir / name)
            if tail:
                parts.append(f"--- {self.logs_dir / name} (tail) ---\n{tail}")
        return "\n".join(parts) or f"(no output in {self.logs_dir})"

    # ---- process bookkeeping -----------------------------------------------------------------------
    def _is_ours(self, pid: int) -> bool:
        """True if pid is a live Kafka JVM started with this data dir's server.properties."""
        if not _pid_alive(pid):
            return False
        args = _cmdline(pid)
        return KAFKA_MAIN in args and str(self.server_properties) in args

    def _running_pid(self, state: dict[str, Any]) -> int | None:
        pid = state.get("pid")
        if isinstance(pid, int) and self._is_ours(pid):
            return pid
        # broker.json may be stale or missing (e.g. `up` was killed right after the spawn).
        found = self._scan_pids()
        return found[0] if found else None

    def _scan_pids(self) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and self._is_ours(int(entry.name)):
                pids.append(int(entry.name))
        return sorted(pids)

    def _stop_pid(self, pid: int, timeout_s: float) -> None:
        def gone() -> bool:
            if _pid_alive(pid):
                return False
            _reap(pid)
            return True

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            # A SIGTERM lets Kafka flush and close its logs cleanly; SIGKILL only if that hangs.
            if _wait_until(gone, timeout_s if sig == signal.SIGTERM else 10.0):
                break
            log.warning("Kafka broker pid %d ignored %s for %.0fs", pid, sig.name, timeout_s)
        if self._proc is not None and self._proc.pid == pid:
            self._proc.poll()
            self._proc = None
        if not gone():
            raise BrokerError(f"could not stop the Kafka broker (pid {pid})")

    # ---- small file helpers ------------------------------------------------------------------------
    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, state: dict[str, Any]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    @staticmethod
    def _read_text(path: Path) -> str | None:
        try:
            return path.read_text().strip() or None
        except OSError:
            return None


def _read_properties(path: Path) -> dict[str, str]:
    """Minimal Java .properties reader: enough for Kafka's meta.properties (key=value, # comments)."""
    props: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        props[key.strip()] = value.strip()
    return props
