"""The wire schema: every record that crosses Kafka, its msgpack encoding and its validation.

Encoding: one msgpack map per record, ``{"_t": type tag, "_v": schema version, <field>: <value>, ...}``.
Token ids and logprobs travel as raw little-endian ``int32``/``float32`` bytes, not msgpack lists: decoding a
512-token completion is then one ``np.frombuffer`` instead of 512 Python objects, which is what keeps
decode+validate well above 200 MB/s on one core. Decoded arrays are read-only views of the message bytes.

Decoding validates everything a consumer relies on (types, required fields, token/logprob lengths, finite
floats, size caps, cross-field invariants) and raises exactly one error type, :class:`WireError`, whatever the
input bytes are. Consumers turn a ``WireError`` into a dead-letter record and move on.

**Schema evolution** (the usual Kafka rule): ``_v`` is the schema's *major* version. An additive change -- a new
optional field, omitted while empty -- keeps the major: older readers ignore fields they do not know, newer
readers default the ones a record lacks, so roles upgrade one at a time. A breaking change (a field removed,
renamed, retyped or made required) bumps :data:`SCHEMA_VERSION` and adds an entry to :data:`UPGRADES` that
turns a body of the older major into the current one: a reader decodes every major it ever wrote, so a recorded
``groups`` log stays trainable. A record of a newer major than the reader's is refused with a message that says
to upgrade the reader. ``tests/golden/`` holds one record of every type for every major (never rewritten) and
the tests decode (and train on) each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

SCHEMA_VERSION = 1  # the major version this code writes (see "Schema evolution" above)
# Every major this code ever wrote -> the function that turns such a body into the current major's (None: it is
# the current one). A bump adds the old major here; no entry is ever removed.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]] | None] = {1: None}

# Size caps: a record beyond these is garbage or an attack, never a legitimate rollout.
MAX_RECORD_BYTES = 64 * 1024 * 1024
MAX_TOKENS = 1 << 20
MAX_STR_CHARS = 4 * 1024 * 1024
MAX_GROUP_SIZE = 4096
MAX_MAP_ITEMS = 256
FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})
WEIGHT_STORES = frozenset({"fs", "kafka"})

_I32 = {"dtype": "<i4"}
_F32 = {"dtype": "<f4"}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Logprobs are <= 0 in exact arithmetic; float32 log-softmax can land a hair above 0.
_LOGPROB_SLACK = 1e-3


class WireError(ValueError):
    """A record could not be encoded or decoded: the message says which field and why."""


def _empty_i32() -> np.ndarray:
    return np.zeros(0, dtype="<i4")


def _empty_f32() -> np.ndarray:
    return np.zeros(0, dtype="<f4")


def make_group_id(prompt_id: str, epoch: int, sample_round: int = 0) -> str:
    """Group id = prompt id + epoch + sample round: unique per generated group (architecture: identity)."""
    return f"{prompt_id}@e{epoch}r{sample_round}"


class Record:
    """Base of all wire records: equality that understands numpy fields, encode/validate hooks."""

    TYPE: ClassVar[str] = ""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def validate(self) -> None:
        """Cross-field invariants; field types are checked by the decoder."""


@dataclass(slots=True, eq=False)
class PromptTask(Record):
    """One dataset item to generate a group for (topic ``prompts``, key = prompt id)."""

    TYPE: ClassVar[str] = "prompt"
    prompt_id: str
    prompt: str
    task: str
    epoch: int = 0
    sample_round: int = 0
    prompt_token_ids: np.ndarray = field(default_factory=_empty_i32, metadata=_I32)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def group_id(self) -> str:
        return make_group_id(self.prompt_id, self.epoch, self.sample_round)

    def validate(self) -> None:
        _require(bool(self.prompt_id), "prompt_id: must not be empty")
        _require(self.epoch >= 0 and self.sample_round >= 0, "epoch/sample_round: must be >= 0")


@dataclass(slots=True, eq=False)
class Completion(Record):
    """One sampled completion (topic ``completions``, key = group id; identity = (group_id, index))."""

    TYPE: ClassVar[str] = "completion"
    group_id: str
    index: int
    group_size: int
    prompt_id: str
    task: str
    prompt_token_ids: np.ndarray = field(metadata=_I32)
    completion_token_ids: np.ndarray = field(metadata=_I32)
    behaviour_logprobs: np.ndarray = field(metadata=_F32)
    policy_version: int
    producer_id: str
    finish_reason: str
    prompt: str = ""
    completion: str = ""
    epoch: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # The version span of a completion whose generation continued across a weight swap (partial rollout):
    # ``policy_version`` is the *oldest* version (the one staleness is measured from), and token
    # ``later_starts[k]`` onwards came from ``later_versions[k]``. Each token's behaviour logprob is from the
    # weights that sampled it, so per-token ratios stay exact. Empty: one version for every token. Added
    # without a schema bump (omitted while empty): a reader that ignores them still measures staleness from the
    # oldest version and uses the right logprobs; it only cannot show the span.
    later_versions: list[int] = field(default_factory=list, metadata={"omit_empty": True})
    later_starts: list[int] = field(default_factory=list, metadata={"omit_empty": True})
    # The temperature T of the distribution ``behaviour_logprobs`` are of: log_softmax(logits / T) (the
    # contract's ``logprobs: sampling``). 0: the raw distribution (T = 1), as before this field existed.
    logprob_temperature: float = field(default=0.0, metadata={"omit_empty": True})

    @property
    def newest_version(self) -> int:
        """The newest version that produced any of its tokens."""
        return self.later_versions[-1] if self.later_versions else self.policy_version

    def token_versions(self) -> np.ndarray:
        """The version of each completion token (int64 [n])."""
        out = np.full(len(self.completion_token_ids), self.policy_version, dtype=np.int64)
        for version, start in zip(self.later_versions, self.later_starts, strict=True):
            out[start:] = version
        return out

    def validate(self) -> None:
        # Plain ifs, not _require(f"..."): this runs per completion on the decode hot path.
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise WireError(f"group_size: {self.group_size} not in [1, {MAX_GROUP_SIZE}]")
        if not 0 <= self.index < self.group_size:
            raise WireError(f"index: {self.index} not in [0, group_size={self.group_size})")
        if self.policy_version < 0:
            raise WireError(f"policy_version: {self.policy_version} < 0")
        if self.finish_reason not in FINISH_REASONS:
            raise WireError(f"finish_reason: {self.finish_reason!r} not in {sorted(FINISH_REASONS)}")
        n_tok, n_lp = len(self.completion_token_ids), len(self.behaviour_logprobs)
        if n_tok != n_lp:
            raise WireError(f"behaviour_logprobs: {n_lp} values for {n_tok} completion tokens")
        if n_lp and self.behaviour_logprobs.max() > _LOGPROB_SLACK:
            raise WireError("behaviour_logprobs: values > 0")
        if self.later_versions or self.later_starts:
            self._validate_span(n_tok)
        if not self.logprob_temperature >= 0:  # also refuses NaN
            raise WireError(f"logprob_temperature: {self.logprob_temperature} < 0")

    def _validate_span(self, n_tok: int) -> None:
        versions, starts = self.later_versions, self.later_starts
        if len(versions) != len(starts):
            raise WireError(f"later_starts: {len(starts)} values for {len(versions)} later_versions")
        if any(b <= a for a, b in zip([self.policy_version, *versions], versions, strict=False)):
            raise WireError(f"later_versions: {versions[:8]} must increase from policy_version {self.policy_version}")
        if any(b <= a for a, b in zip([0, *starts], starts, strict=False)) or starts[-1] >= n_tok:
            raise WireError(f"later_starts: {starts[:8]} must increase within (0, {n_tok}) completion tokens")


@dataclass(slots=True, eq=False)
class ScoredGroup(Record):
    """The G completions of one prompt with rewards and group statistics (topic ``groups``: the rollout log)."""

    TYPE: ClassVar[str] = "scored_group"
    group_id: str
    prompt_id: str
    task: str
    policy_version: int
    completions: list[Completion]
    rewards: list[float]
    reward_mean: float
    reward_std: float
    verifier_id: str
    group_size: int
    partial: bool = False
    reward_info: dict[str, Any] = field(default_factory=dict)
    scored_at: float = 0.0
    # Positions (in ``completions``) whose reward could not be computed (a crashed, hung or broken reward: see
    # grpo_verifiers.rewards.failures). Their ``rewards`` entry is a 0 placeholder, not a score: the learner
    # leaves them out of the group statistics and the loss. Omitted on the wire when empty, so records without
    # failures stay readable by readers that predate the field.
    failed: list[int] = field(default_factory=list, metadata={"omit_empty": True})

    def validate(self) -> None:
        n = len(self.completions)
        _require(n == len(self.rewards), f"rewards: {len(self.rewards)} values for {n} completions")
        _require(len(set(self.failed)) == len(self.failed) and all(0 <= k < n for k in self.failed),
                 f"failed: {self.failed[:8]} must be distinct positions in [0, {n})")
        _require(1 <= self.group_size <= MAX_GROUP_SIZE, f"group_size: {self.group_size} not in [1, {MAX_GROUP_SIZE}]")
        _require(n == self.group_size or (self.partial and 0 < n < self.group_size),
                 f"completions: {n} members for group_size {self.group_size} (partial={self.partial})")
        _require(self.reward_std >= 0, f"reward_std: {self.reward_std} < 0")
        seen: set[int] = set()
        for c in self.completions:
            if c.group_id != self.group_id:
                raise WireError(f"completions: member of {c.group_id!r} in group {self.group_id!r}")
            if c.group_size != self.group_size:
                raise WireError(f"completions: index {c.index} says group_size {c.group_size}, "
                                f"group has {self.group_size}")
            if c.index in seen:
                raise WireError(f"completions: index {c.index} twice")
            if c.policy_version < self.policy_version:
                raise WireError(f"completions: index {c.index} has version {c.policy_version}, older than the "
                                f"group's {self.policy_version} (a group's version is its oldest member's)")
            seen.add(c.index)

    @property
    def newest_version(self) -> int:
        """The newest version behind any member's tokens (``policy_version`` is the oldest)."""
        return max((c.newest_version for c in self.completions), default=self.policy_version)

    def valid_part(self) -> ScoredGroup:
        """The group without its ``failed`` members (in memory: the learner trains this; never re-encoded)."""
        if not self.failed:
            return self
        bad = set(self.failed)
        keep = [k for k in range(len(self.completions)) if k not in bad]
        return dataclasses.replace(self, completions=[self.completions[k] for k in keep],
                                   rewards=[self.rewards[k] for k in keep], failed=[], partial=True)


@dataclass(slots=True, eq=False)
class WeightsAnnouncement(Record):
    """A new policy version is available (topic ``weights``, key = run name, compacted).

    The bytes live in a store: ``fs`` (``location`` is a path on a shared volume) or ``kafka`` (``location``
    is the weight-data topic; ``num_chunks`` :class:`WeightChunk` records keyed by ``run/version``).
    """

    TYPE: ClassVar[str] = "weights"
    run: str
    version: int
    store: str
    location: str
    sha256: str
    size_bytes: int
    format: str = "safetensors"
    num_chunks: int = 0
    chunk_bytes: int = 0
    published_at: float = 0.0
    contract: str = ""  # the publishing learner's pipeline-contract digest (grpo_core.contract); "" if unknown
    # The publishing learner's incarnation (its start count, grpo_learner.saving): a learner restarted from a
    # checkpoint older than versions it announced announces those version numbers again, with other weights, under
    # a higher incarnation. (version, incarnation) names one set of weights. Additive: 0 when absent.
    incarnation: int = field(default=0, metadata={"omit_empty": True})

    def validate(self) -> None:
        _require(self.version >= 0, f"version: {self.version} < 0")
        _require(self.incarnation >= 0, f"incarnation: {self.incarnation} < 0")
        _require(self.store in WEIGHT_STORES, f"store: {self.store!r} not in {sorted(WEIGHT_STORES)}")
        _require(len(self.sha256) == 64 and all(ch in "0123456789abcdef" for ch in self.sha256),
                 "sha256: must be 64 lowercase hex digits")
        for name in ("size_bytes", "num_chunks", "chunk_bytes"):
            _require(getattr(self, name) >= 0, f"sizes: {name} must be >= 0, got {getattr(self, name)}")
        _require(self.store != "kafka" or self.num_chunks > 0, "num_chunks: the kafka store needs >= 1 chunk")


@dataclass(slots=True, eq=False)
class WeightChunk(Record):
    """One slice of a weights file on the weight-data topic (the ``kafka`` weight store)."""

    TYPE: ClassVar[str] = "weight_chunk"
    run: str
    version: int
    index: int
    num_chunks: int
    data: bytes

    def validate(self) -> None:
        _require(0 <= self.index < self.num_chunks, f"index: {self.index} not in [0, num_chunks={self.num_chunks})")


@dataclass(slots=True, eq=False)
class DeadLetter(Record):
    """A record some service could not process (topic ``dlq``): why, where it came from, its exact bytes."""

    TYPE: ClassVar[str] = "dead_letter"
    source_topic: str
    partition: int
    offset: int
    reason: str
    raw: bytes
    service: str = ""
    key: bytes = b""
    at: float = 0.0
    # A record too large for the dlq keeps only a prefix in ``raw``; its full size and sha256 identify it.
    raw_size: int = -1  # -1: not recorded (``raw`` is complete)
    raw_sha256: str = ""
    truncated: bool = False


RECORD_TYPES: dict[str, type[Record]] = {
    c.TYPE: c for c in (PromptTask, Completion, ScoredGroup, WeightsAnnouncement, WeightChunk, DeadLetter)
}
R = TypeVar("R", bound=Record)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise WireError(message)


# --------------------------------------------------------------------------------------------- encoding


def _to_wire(record: Record) -> dict[str, Any]:
    """The msgpack-ready form of ``record``, checked by the same field checkers the decoder runs (so encode
    never writes what decode would reject), then the cross-field invariants on the arrays as packed."""
    out: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, spec in _specs(type(record)):  # type: ignore[arg-type]  # mypy: type[Record] unhashable (__hash__ = None)
        value = getattr(record, name)
        if spec.omit_empty and not value:
            continue
        try:
            if spec.dtype is not None:
                value = _pack_array(value, spec.dtype).tobytes()
                arrays[name] = spec.check(value)
            elif spec.record is not None:
                if type(value) is not list:
                    raise _type_error("a list", value)
                value = [_to_wire(v) for v in value]
            else:
                value = spec.check(value)
        except WireError as exc:
            raise WireError(f"{record.TYPE}.{name}: {exc}") from None
        out[name] = value
    (dataclasses.replace(record, **arrays) if arrays else record).validate()  # type: ignore[type-var]
    return out


def _pack_array(value: Any, dtype: str) -> np.ndarray:
    """A 1-D array as the wire dtype, refusing values the cast would silently change (int64 wrap-around)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise WireError(f"expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if dtype == "<i4":
        if arr.dtype.kind not in "iu":
            raise WireError(f"expected integer token ids, got dtype {arr.dtype}")
        if arr.max() > np.iinfo(np.int32).max:
            raise WireError(f"token id {arr.max()} does not fit int32")
    elif arr.dtype.kind not in "fiu":
        raise WireError(f"expected numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def encode(record: Record) -> bytes:
    """Serialise a record (validating its invariants first: bad records fail at the source)."""
    body = _to_wire(record)
    body["_t"], body["_v"] = record.TYPE, SCHEMA_VERSION
    try:
        data: bytes = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"{record.TYPE}: cannot encode: {exc}") from exc
    _require(len(data) <= MAX_RECORD_BYTES, f"{record.TYPE}: {len(data)} bytes > cap {MAX_RECORD_BYTES}")
    return data


# --------------------------------------------------------------------------------------------- decoding


def decode(data: bytes, expected: type[R] | None = None) -> R:
    """Parse and validate one record; ``expected`` pins the type. Raises only :class:`WireError`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    _require(len(data) <= MAX_RECORD_BYTES, f"record of {len(data)} bytes > cap {MAX_RECORD_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean "not a record"
        raise WireError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    _require(isinstance(body, dict), f"expected a msgpack map, got {type(body).__name__}")
    version, tag = body.pop("_v", None), body.pop("_t", None)
    body = _upgraded(body, version)
    cls = RECORD_TYPES.get(tag) if isinstance(tag, str) else None
    _require(cls is not None, f"unknown record type {tag!r}")
    if expected is not None:
        _require(cls is expected, f"expected a {expected.TYPE} record, got {tag!r}")
    return typing.cast(R, _from_wire(cls, body, tag))  # type: ignore[arg-type]


def _upgraded(body: dict[str, Any], version: Any) -> dict[str, Any]:
    """The body in the current major's shape (see "Schema evolution" above)."""
    _require(type(version) is int, f"schema version {version!r} not supported: expected an int major version")
    _require(version <= SCHEMA_VERSION, f"schema version {version} is newer than this reader's "
                                        f"({SCHEMA_VERSION}): upgrade grpo-stream where this record is read")
    _require(version in UPGRADES, f"schema version {version} not supported: this reader decodes majors "
                                  f"{sorted(UPGRADES)}")
    upgrade = UPGRADES[version]
    return body if upgrade is None else upgrade(body)


def _from_wire(cls: type[R], body: Any, where: str) -> R:
    if not isinstance(body, dict):
        raise WireError(f"{where}: expected a map, got {type(body).__name__}")
    kwargs: dict[str, Any] = {}
    # Checkers raise short messages; the field path is prefixed here, only on failure (the hot path
    # formats no strings).
    for name, spec in _specs(cls):  # type: ignore[arg-type]  # mypy: type[R] unhashable (__hash__ = None)
        if name in body:
            try:
                kwargs[name] = spec.check(body[name])
            except WireError as exc:
                raise WireError(f"{where}.{name}: {exc}") from None
        elif spec.required:
            raise WireError(f"{where}.{name}: required field missing")
    # Fields this reader does not know are ignored: a newer writer's additive fields (see "Schema evolution").
    record = cls(**kwargs)
    try:
        record.validate()
    except WireError as exc:
        raise WireError(f"{where}: {exc}") from None
    return record


@dataclass(frozen=True, slots=True)
class _Spec:
    check: Callable[[Any], Any]
    required: bool
    dtype: str | None = None
    record: type[Record] | None = None
    omit_empty: bool = False  # an optional field left out of the encoding while empty (added without a bump)


@functools.cache
def _specs(cls: type[Record]) -> tuple[tuple[str, _Spec], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        dtype = f.metadata.get("dtype")
        if dtype is not None:
            check = _check_f32 if dtype == "<f4" else _check_i32
            out.append((f.name, _Spec(check, required, dtype=dtype)))
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is list and typing.get_args(hint)[0] in RECORD_TYPES.values():
            sub = typing.get_args(hint)[0]
            out.append((f.name, _Spec(functools.partial(_check_records, cls=sub), required, record=sub)))
        else:
            out.append((f.name, _Spec(_SCALAR_CHECKS[hint], required, omit_empty=f.metadata.get("omit_empty", False))))
    return tuple(out)


def _type_error(expected: str, v: Any) -> WireError:
    return WireError(f"expected {expected}, got {type(v).__name__}")


def _check_str(v: Any) -> str:
    if type(v) is not str:
        raise _type_error("str", v)
    if len(v) > MAX_STR_CHARS:
        raise WireError(f"string of {len(v)} chars > cap {MAX_STR_CHARS}")
    return v


def _check_int(v: Any) -> int:
    if type(v) is not int:
        raise _type_error("int", v)
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise WireError(f"{v} out of int64 range")
    return v


def _check_float(v: Any) -> float:
    if type(v) is float:
        if not math.isfinite(v):
            raise WireError(f"{v} is not finite")
        return v
    if type(v) is int:
        return float(v)
    raise _type_error("a number", v)


def _check_bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _type_error("bool", v)
    return v


def _check_bytes(v: Any) -> bytes:
    if type(v) is not bytes:
        raise _type_error("bytes", v)
    return v


def _as_array(v: Any, dtype: str) -> np.ndarray:
    if type(v) is not bytes:
        raise _type_error(f"packed {dtype} bytes", v)
    if len(v) % 4:
        raise WireError(f"{len(v)} bytes is not a whole number of 4-byte values")
    if len(v) > 4 * MAX_TOKENS:
        raise WireError(f"{len(v) // 4} values > cap {MAX_TOKENS}")
    return np.frombuffer(v, dtype=dtype)


def _check_f32(v: Any) -> np.ndarray:
    arr = _as_array(v, "<f4")
    if not np.isfinite(arr).all():
        raise WireError("contains NaN or inf")
    return arr


def _check_i32(v: Any) -> np.ndarray:
    arr = _as_array(v, "<i4")
    if len(arr) and arr.min() < 0:
        raise WireError("negative token id")
    return arr


def _check_scalar_value(v: Any) -> Any:
    if v is None or type(v) in (bool, int):
        return v
    if type(v) is str:
        return _check_str(v)
    if type(v) is float:
        return _check_float(v)
    if type(v) is list:
        if len(v) > MAX_MAP_ITEMS:
            raise WireError(f"list of {len(v)} items > cap {MAX_MAP_ITEMS}")
        for item in v:
            if type(item) in (list, dict):
                raise WireError("nested containers not allowed")
            _check_scalar_value(item)
        return v
    raise WireError(f"unsupported value type {type(v).__name__}")


def _check_map(v: Any, check_value: Callable[[Any], Any]) -> dict[str, Any]:
    if type(v) is not dict:
        raise _type_error("a map", v)
    if len(v) > MAX_MAP_ITEMS:
        raise WireError(f"{len(v)} entries > cap {MAX_MAP_ITEMS}")
    out = {}
    for k, item in v.items():
        if type(k) is not str:
            raise WireError(f"key {k!r} is not a str")
        try:
            out[k] = check_value(item)
        except WireError as exc:
            raise WireError(f"[{k!r}]: {exc}") from None
    return out


def _check_metadata(v: Any) -> dict[str, Any]:
    """Free-form task metadata: str keys, scalar or flat-list values (e.g. a gold answer, tags)."""
    return _check_map(v, _check_scalar_value)


def _check_float_map(v: Any) -> dict[str, float]:
    return _check_map(v, _check_float)


def _check_list(v: Any, check_item: Callable[[Any], Any]) -> list[Any]:
    if type(v) is not list:
        raise _type_error("a list", v)
    if len(v) > MAX_GROUP_SIZE:
        raise WireError(f"{len(v)} values > cap {MAX_GROUP_SIZE}")
    return [check_item(x) for x in v]


def _check_float_list(v: Any) -> list[float]:
    return _check_list(v, _check_float)


def _check_int_list(v: Any) -> list[int]:
    return _check_list(v, _check_int)


def _check_records(v: Any, cls: type[Record]) -> list[Record]:
    if type(v) is not list:
        raise _type_error("a list", v)
    if len(v) > MAX_GROUP_SIZE:
        raise WireError(f"{len(v)} items > cap {MAX_GROUP_SIZE}")
    return [_from_wire(cls, item, f"[{i}]") for i, item in enumerate(v)]


_SCALAR_CHECKS: dict[Any, Callable[[Any], Any]] = {
    str: _check_str,
    int: _check_int,
    float: _check_float,
    bool: _check_bool,
    bytes: _check_bytes,
    dict[str, Any]: _check_metadata,
    dict[str, float]: _check_float_map,
    list[float]: _check_float_list,
    list[int]: _check_int_list,
}


def now() -> float:
    """Wall-clock seconds, the one clock stamped into records (created_at, scored_at, timings)."""
    return time.time()
