"""Typed configuration: one dataclass tree per process, loaded from YAML plus ``key=value`` overrides.

Every field is declared with :func:`opt`, which carries its documentation (``grpo-stream config explain``
prints it). Loading is strict: unknown keys, wrong types and failed ``validate()`` checks raise
:class:`ConfigError` naming the dotted key and what would be accepted, before the process does any work.
Loading needs no heavy imports (no torch, transformers or vLLM): the CLI loads a role's config before it
imports the role, so a mistyped key is rejected in well under a second.

``validate()`` checks a config on its own (it must hold on any machine: ``k8s check`` validates the configs of
pods); ``check_paths()`` methods (:func:`check_paths`) check it against this machine (a model directory that
must exist) and run where a process is about to start.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

C = TypeVar("C")


class InputError(Exception):
    """Bad input the user has to fix (a setting, a path, an address nothing answers at): the CLI prints its
    message, one line naming the cause, and exits 2 without a traceback."""


class ConfigError(InputError, ValueError):
    """A configuration problem, phrased so the user knows which key to change and how."""


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A documented config field (``help`` is shown by ``grpo-stream config explain``)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def require(ok: bool, message: str) -> None:
    """For ``validate()`` methods: raise a ConfigError with an actionable message unless ``ok``."""
    if not ok:
        raise ConfigError(message)


# ------------------------------------------------------------------------------------------ shared parts


@dataclass
class KafkaConfig:
    """How every client reaches the cluster; security settings pass through to all clients."""

    bootstrap: str | None = opt(None, "host:port[,host:port]. Empty: $KAFKA_BOOTSTRAP, else the local broker.")
    client_id: str = opt("grpo-stream", "client.id prefix; the role and a process id are appended.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = opt("PLAINTEXT", "")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = opt(
        None, "SASL mechanism when security_protocol is SASL_*.")
    sasl_username: str | None = opt(None, "SASL user name.")
    sasl_password_env: str | None = opt(
        None, "Name of the environment variable holding the SASL password (never put the secret in YAML).")
    ssl_cafile: str | None = opt(None, "CA bundle to verify the brokers.")
    ssl_certfile: str | None = opt(None, "Client certificate (mutual TLS).")
    ssl_keyfile: str | None = opt(None, "Client private key (mutual TLS).")
    compression: Literal["lz4", "gzip", "none"] = opt(
        "lz4", "Producer compression. lz4: cheapest CPU per byte; logprob floats barely compress anyway.")
    request_timeout_ms: int = opt(30_000, "Client request timeout.")
    connect_timeout_s: float = opt(
        50.0, "How long a new client waits for a broker to answer at kafka.bootstrap before the process exits "
              "(code 2) with one line naming the address; a broker down at start-up is waited for this long.")
    max_record_bytes: int = opt(
        16 * 1024 * 1024, "Largest record any client sends or fetches; must not exceed the topics' max.message.bytes.")

    def validate(self) -> None:
        if self.security_protocol.startswith("SASL"):
            require(self.sasl_mechanism is not None, "kafka.sasl_mechanism: required with SASL_* security_protocol")
        if self.sasl_password_env:
            require(self.sasl_password_env in os.environ,
                    f"kafka.sasl_password_env: environment variable {self.sasl_password_env} is not set")
        require(1024 <= self.max_record_bytes <= 1 << 30, "kafka.max_record_bytes: must be in [1 KiB, 1 GiB]")
        require(self.connect_timeout_s > 0, f"kafka.connect_timeout_s: must be > 0, got {self.connect_timeout_s}")

    def resolved_bootstrap(self) -> str:
        return self.bootstrap or os.environ.get("KAFKA_BOOTSTRAP") or "127.0.0.1:9092"

    def sasl_password(self) -> str | None:
        return os.environ.get(self.sasl_password_env) if self.sasl_password_env else None


@dataclass
class TopicSpec:
    """One topic of the plan: name and the broker-side settings it is created with."""

    name: str = opt(help="Topic name.")
    partitions: int = opt(4, "Partitions: upper bound on the consumers of one group that share the topic.")
    replication_factor: int = opt(1, "Replicas (3 in production clusters).")
    retention_ms: int = opt(7 * 24 * 3600 * 1000, "retention.ms; -1 keeps records forever.")
    max_message_bytes: int = opt(16 * 1024 * 1024, "max.message.bytes (largest record batch the broker accepts).")
    cleanup_policy: Literal["delete", "compact"] = opt("delete", "cleanup.policy.")

    def validate(self) -> None:
        require(bool(self.name), "topics.*.name: must not be empty")
        require(self.partitions >= 1, f"topics.{self.name}.partitions: must be >= 1")
        require(self.replication_factor >= 1, f"topics.{self.name}.replication_factor: must be >= 1")
        require(self.retention_ms == -1 or self.retention_ms > 0, f"topics.{self.name}.retention_ms: -1 or > 0")


@dataclass
class TopicsConfig:
    """The topic plan: settings and names before the run's prefix (:class:`grpo_core.contract.PipelineContract`
    adds it). ``grpo-stream topics create`` and the k8s manifests use it."""

    prompts: TopicSpec = opt(factory=lambda: TopicSpec("prompts", retention_ms=30 * 24 * 3600 * 1000))
    completions: TopicSpec = opt(factory=lambda: TopicSpec("completions"))
    groups: TopicSpec = opt(factory=lambda: TopicSpec("groups", retention_ms=30 * 24 * 3600 * 1000))
    weights: TopicSpec = opt(factory=lambda: TopicSpec(
        "weights", partitions=1, retention_ms=-1, max_message_bytes=1024 * 1024, cleanup_policy="compact"))
    weight_data: TopicSpec = opt(factory=lambda: TopicSpec(
        "weight-data", partitions=1, retention_ms=6 * 3600 * 1000, max_message_bytes=16 * 1024 * 1024))
    dlq: TopicSpec = opt(factory=lambda: TopicSpec("dlq", partitions=1, retention_ms=30 * 24 * 3600 * 1000))

    def all(self) -> list[TopicSpec]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def validate(self) -> None:
        names = [t.name for t in self.all()]
        require(len(set(names)) == len(names), f"topics: names must be distinct, got {names}")
        require(self.weights.cleanup_policy == "compact",
                "topics.weights.cleanup_policy: must be compact (a new producer must always find the latest version)")


@dataclass
class MetricsConfig:
    """The per-process HTTP endpoint serving ``/metrics`` (Prometheus) and ``/health``."""

    host: str = opt("127.0.0.1", "Bind address; 0.0.0.0 inside containers.")
    port: int = opt(0, "Port; 0 picks a free one (logged at start-up); -1 disables the endpoint.")
    stall_s: float = opt(
        600.0, "/health turns 503 when work is waiting (lag on the partitions held) but nothing progressed for this "
               "long; a k8s liveness probe then restarts the process (0: off).")

    def validate(self) -> None:
        require(-1 <= self.port <= 65535, "metrics.port: must be -1 (off), 0 (any) or a port number")
        require(self.stall_s >= 0, "metrics.stall_s: must be >= 0 (0: off)")


# ------------------------------------------------------------------------------------------ this machine

# A Hugging Face hub id: "name" or "org/name" (no leading dot or slash, at most one slash).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_TRUE = ("1", "true", "yes", "on")


def check_model_path(value: str, key: str, need: str | None = "config.json") -> None:
    """A model setting (``model.path``, ``backend.model``): an existing local directory (holding ``need``), or a
    hub id. A value that is not an existing directory is taken as a hub id only in the hub's form (``org/name``
    or ``name``); anything else (an absolute or ``./`` path, two slashes or more) is a local path that is missing.
    With the hub switched off (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``) a hub id must be in the local cache,
    since nothing can be downloaded."""
    path = Path(value).expanduser()
    if path.is_dir():
        require(need is None or (path / need).is_file(),
                f"{key}: {value} has no {need}: not a Hugging Face model directory")
        return
    require(not path.exists(), f"{key}: {value} is a file; expected a model directory or a hub id")
    require(bool(_HUB_ID.fullmatch(value)) and ".." not in value,
            f"{key}: {value}: no such directory (a hub id has the form org/name)")
    offline = any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        cache = _hub_cache()
        require((cache / f"models--{value.replace('/', '--')}").is_dir(),
                f"{key}: {value}: no such directory, and as a hub id it is not in the local cache {cache} "
                f"(HF_HUB_OFFLINE is set: nothing is downloaded)")


def _hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded models (its own rule, without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def check_paths(cfg: Any) -> None:
    """Call ``check_paths()`` of a loaded config, if it has one: what it names must exist on this machine. Run
    by the CLI before a role starts and by ``grpo-stream run`` before anything starts; not part of
    :func:`load_config`, so a config for another machine still validates here."""
    check = getattr(cfg, "check_paths", None)
    if callable(check):
        check()


# ------------------------------------------------------------------------------------------ loading


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = (),
                *, ignore_unknown_top: bool = False, pipeline_file: str | Path | None = None) -> C:
    """Build ``cls`` from a YAML file and ``key.sub=value`` overrides (values parsed as YAML), then validate.

    ``ignore_unknown_top`` lets a tool read its own sections out of a larger file (e.g. a whole-run config).
    ``pipeline_file`` is the shared pipeline contract (one file every role loads): it becomes the ``pipeline``
    section, which the config file itself must then not have; overrides still apply on top.
    """
    raw = read_yaml(path) if path is not None else {}
    if pipeline_file is not None:
        if "pipeline" in raw:
            raise ConfigError(f"{path}: has a pipeline section and --pipeline {pipeline_file} was given; keep the "
                              f"contract in one place")
        raw["pipeline"] = read_yaml(pipeline_file)
    for item in overrides:
        _apply_override(raw, item)
    if ignore_unknown_top:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        raw = {k: v for k, v in raw.items() if k in names}
    cfg = build(cls, raw, "")
    validate_tree(cfg)
    return cfg


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is ``{}``), or a ConfigError saying why not."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key.sub=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = nxt
    node[parts[-1]] = parsed


def build(cls: type[C], raw: Any, where: str, base: C | None = None) -> C:
    """Recursively turn plain YAML data into the dataclass ``cls``, checking keys and types.

    Keys absent from ``raw`` keep their value from ``base`` (a field's default instance), so a YAML file
    can change one setting of a nested section (``topics.groups.partitions: 8``) without restating the rest.
    """
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a mapping for {cls.__name__}, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"{where}{key}: unknown key{hint}")
        kwargs[key] = _coerce(hints[key], value, f"{where}{key}", _default_of(fields[key], base))
    if base is not None:
        kwargs = {f: getattr(base, f) for f in fields if f not in kwargs} | kwargs
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: missing required keys {missing}")
    return cls(**kwargs)


def _default_of(f: dataclasses.Field[Any], base: Any) -> Any:
    if base is not None:
        return getattr(base, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(hint: Any, value: Any, where: str, default: Any = None) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {errors}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(typing.cast(type, hint)):  # a class; the cast keeps `hint` from narrowing
        return build(hint, value, f"{where}.", default if isinstance(default, hint) else None)
    return _coerce_scalar(hint, value, where)


def _coerce_scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads 3e-3 (no dot) as a string; every user writes learning rates that way.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def validate_tree(cfg: Any) -> None:
    """Call ``validate()`` on every nested config, children first, so messages name the deepest culprit."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value)
        elif isinstance(value, list):
            for v in value:
                if dataclasses.is_dataclass(v):
                    validate_tree(v)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()


def explain_rows(cls: type, prefix: str = "", base: Any = None) -> Iterator[tuple[str, str, str]]:
    """(dotted name, default, help text) per leaf key: what ``config explain`` prints and the configuration
    reference page (``grpo_stream.config_reference``) tabulates."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = _default_of(f, base)
        required = base is None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if dataclasses.is_dataclass(hints[f.name]):
            yield from explain_rows(hints[f.name], f"{prefix}{f.name}.", default)
            continue
        yield f"{prefix}{f.name}", "<required>" if required else repr(default), f.metadata.get("help", "")


def explain(cls: type, prefix: str = "", base: Any = None) -> Iterator[str]:
    """One line per leaf key: dotted name, default and help text (``grpo-stream config explain``)."""
    for key, shown, text in explain_rows(cls, prefix, base):
        yield f"{key} = {shown}  # {text}"


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (written next to a run's outputs)."""
    return dataclasses.asdict(cfg)
