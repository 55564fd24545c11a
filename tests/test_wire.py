"""Wire schema: property round trips for every record type, a decoder that never fails any way but
``WireError`` whatever the bytes, and one test per validation rule (each checking that the message
names the cause)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from grpo_core import wire
from grpo_stream.bench.wire import make_completion, make_group

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# --------------------------------------------------------------------------------------------- strategies

int64s = st.integers(INT64_MIN, INT64_MAX)
nonneg64 = st.integers(0, INT64_MAX)
finite = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=40)  # any unicode, surrogates excluded (they are not UTF-8 encodable)
ids = st.text(min_size=1, max_size=30)
scalars = st.none() | st.booleans() | int64s | finite | texts
metadata = st.dictionaries(st.text(max_size=12), scalars | st.lists(scalars, max_size=6), max_size=6)
timings = st.dictionaries(st.text(max_size=12), finite, max_size=6)
sha256s = st.binary(min_size=32, max_size=32).map(bytes.hex)
token_ids = st.integers(0, (1 << 31) - 1)
logprob_values = st.floats(max_value=0.0, width=32, allow_nan=False, allow_infinity=False)


def token_arrays(n: int | st.SearchStrategy[int]) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.int32, n, elements=token_ids)


def logprob_arrays(n: int) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, n, elements=logprob_values)


@st.composite
def prompt_tasks(draw: st.DrawFn) -> wire.PromptTask:
    return wire.PromptTask(
        prompt_id=draw(ids), prompt=draw(texts), task=draw(texts), epoch=draw(nonneg64),
        sample_round=draw(nonneg64), prompt_token_ids=draw(token_arrays(st.integers(0, 48))),
        metadata=draw(metadata), created_at=draw(finite))


@st.composite
def completions(draw: st.DrawFn, group_id: str | None = None, index: int | None = None,
                group_size: int | None = None, version: int | None = None) -> wire.Completion:
    if group_size is None:
        group_size = draw(st.integers(1, 64))
    if index is None:
        index = draw(st.integers(0, group_size - 1))
    n = draw(st.integers(0, 48))
    return wire.Completion(
        group_id=draw(ids) if group_id is None else group_id, index=index, group_size=group_size,
        prompt_id=draw(ids), task=draw(texts), prompt_token_ids=draw(token_arrays(st.integers(0, 32))),
        completion_token_ids=draw(token_arrays(n)), behaviour_logprobs=draw(logprob_arrays(n)),
        policy_version=draw(nonneg64) if version is None else version, producer_id=draw(texts),
        finish_reason=draw(st.sampled_from(sorted(wire.FINISH_REASONS))), prompt=draw(texts),
        completion=draw(texts), epoch=draw(int64s), metadata=draw(metadata), timings=draw(timings))


@st.composite
def scored_groups(draw: st.DrawFn) -> wire.ScoredGroup:
    group_size = draw(st.integers(1, 8))
    partial = draw(st.booleans())
    n = draw(st.integers(1, group_size)) if partial else group_size
    indices = draw(st.permutations(range(group_size)))[:n]
    group_id, version = draw(ids), draw(nonneg64)
    members = [draw(completions(group_id=group_id, index=i, group_size=group_size, version=version))
               for i in indices]
    return wire.ScoredGroup(
        group_id=group_id, prompt_id=draw(ids), task=draw(texts), policy_version=version, completions=members,
        rewards=draw(st.lists(finite, min_size=n, max_size=n)), reward_mean=draw(finite),
        reward_std=draw(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)),
        verifier_id=draw(texts), group_size=group_size, partial=partial, reward_info=draw(metadata),
        scored_at=draw(finite), failed=draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)))


@st.composite
def weights_announcements(draw: st.DrawFn) -> wire.WeightsAnnouncement:
    store = draw(st.sampled_from(sorted(wire.WEIGHT_STORES)))
    return wire.WeightsAnnouncement(
        run=draw(texts), version=draw(nonneg64), store=store, location=draw(texts), sha256=draw(sha256s),
        size_bytes=draw(nonneg64), format=draw(texts),
        num_chunks=draw(st.integers(1 if store == "kafka" else 0, INT64_MAX)), chunk_bytes=draw(nonneg64),
        published_at=draw(finite))


@st.composite
def weight_chunks(draw: st.DrawFn) -> wire.WeightChunk:
    num_chunks = draw(st.integers(1, INT64_MAX))
    return wire.WeightChunk(run=draw(texts), version=draw(int64s), index=draw(st.integers(0, num_chunks - 1)),
                            num_chunks=num_chunks, data=draw(st.binary(max_size=256)))


@st.composite
def dead_letters(draw: st.DrawFn) -> wire.DeadLetter:
    return wire.DeadLetter(source_topic=draw(texts), partition=draw(int64s), offset=draw(int64s),
                           reason=draw(texts), raw=draw(st.binary(max_size=256)), service=draw(texts),
                           key=draw(st.binary(max_size=32)), at=draw(finite))


RECORD_STRATEGIES: dict[type[wire.Record], st.SearchStrategy[Any]] = {
    wire.PromptTask: prompt_tasks(),
    wire.Completion: completions(),
    wire.ScoredGroup: scored_groups(),
    wire.WeightsAnnouncement: weights_announcements(),
    wire.WeightChunk: weight_chunks(),
    wire.DeadLetter: dead_letters(),
}
any_record = st.one_of(*RECORD_STRATEGIES.values())

# Anything msgpack can pack: the raw material of garbage.
msgpack_leaves = (st.none() | st.booleans() | st.integers(INT64_MIN, (1 << 64) - 1) | st.floats()
                  | st.text(max_size=20) | st.binary(max_size=20))
msgpack_objects = st.recursive(
    msgpack_leaves,
    lambda kids: st.lists(kids, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8) | st.integers(-5, 5), kids, max_size=5),
    max_leaves=20)

# --------------------------------------------------------------------------------------------- helpers


def to_dict(record: wire.Record) -> dict[str, Any]:
    """The msgpack map of a valid record, ready to be tampered with."""
    body = msgpack.unpackb(wire.encode(record), raw=False)
    assert isinstance(body, dict)
    return body


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def assert_rejected(data: bytes | dict[str, Any], *fragments: str,
                    expected: type[wire.Record] | None = None) -> wire.WireError:
    """``decode`` raises WireError whose message contains every fragment."""
    raw = pack(data) if isinstance(data, dict) else data
    with pytest.raises(wire.WireError) as info:
        wire.decode(raw, expected)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return info.value


def decode_or_wire_error(data: bytes) -> wire.Record | None:
    """The decoder's contract on arbitrary input: a valid record or WireError, nothing else.

    A record it accepts must also be one the encoder accepts, and must round trip."""
    try:
        record = wire.decode(data)
    except wire.WireError as exc:
        assert str(exc), "WireError without a message"
        return None
    assert isinstance(record, wire.Record)
    assert wire.decode(wire.encode(record), type(record)) == record
    return record


def assert_arrays_typed(record: wire.Record) -> None:
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, f.name)
        dtype = f.metadata.get("dtype")
        if dtype is not None:
            assert isinstance(value, np.ndarray), f.name
            assert value.dtype == (np.float32 if dtype == "<f4" else np.int32), (f.name, value.dtype)
            assert value.ndim == 1
        elif isinstance(value, list) and value and isinstance(value[0], wire.Record):
            for sub in value:
                assert_arrays_typed(sub)


def small_completion(index: int = 1, group_size: int = 4, group_id: str = "gsm8k-1@e0r0") -> wire.Completion:
    return make_completion(group_id, index, group_size, tokens=8, prompt_tokens=4)


def small_group(group_size: int = 4, version: int = 3) -> wire.ScoredGroup:
    return make_group("gsm8k-1@e0r0", group_size=group_size, tokens=8, version=version)


def sample_records() -> list[wire.Record]:
    """One small valid record of every type."""
    return [
        wire.PromptTask(prompt_id="gsm8k-1", prompt="2+2?", task="math", epoch=1, sample_round=2,
                        prompt_token_ids=np.arange(5, dtype=np.int32),
                        metadata={"answer": "4", "tags": [1, "a", None, 2.5, True]}),
        small_completion(),
        small_group(),
        wire.WeightsAnnouncement(run="r", version=2, store="kafka", location="weight-data", sha256="ab" * 32,
                                 size_bytes=100, num_chunks=2, chunk_bytes=64),
        wire.WeightChunk(run="r", version=2, index=1, num_chunks=2, data=b"\x00\x01"),
        wire.DeadLetter(source_topic="groups", partition=0, offset=7, reason="bad", raw=b"\xc1", key=b"k"),
    ]


SAMPLES = {type(r): r for r in sample_records()}


def required_fields() -> list[tuple[type[wire.Record], str]]:
    return [(cls, f.name) for cls in RECORD_STRATEGIES for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def field_names(cls: type[wire.Record]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- 1. round trips


def test_sample_records_round_trip_and_carry_tag_and_version() -> None:
    assert set(SAMPLES) == set(wire.RECORD_TYPES.values())
    for record in SAMPLES.values():
        body = to_dict(record)
        assert body["_t"] == record.TYPE and body["_v"] == wire.SCHEMA_VERSION
        omitted = {f.name for f in dataclasses.fields(record) if f.metadata.get("omit_empty")}  # type: ignore
        assert set(body) == {"_t", "_v", *field_names(type(record))} - omitted
        back = wire.decode(wire.encode(record), type(record))
        assert back == record and type(back) is type(record)
        assert wire.decode(wire.encode(record)) == record  # no expected= is fine too
        assert_arrays_typed(back)


def test_arrays_travel_as_raw_little_endian_bytes_and_decode_read_only() -> None:
    c = small_completion()
    body = to_dict(c)
    assert body["completion_token_ids"] == c.completion_token_ids.astype("<i4").tobytes()
    assert body["behaviour_logprobs"] == c.behaviour_logprobs.astype("<f4").tobytes()
    back = wire.decode(wire.encode(c), wire.Completion)
    assert not back.completion_token_ids.flags.writeable
    assert not back.behaviour_logprobs.flags.writeable


@pytest.mark.parametrize("cls", list(RECORD_STRATEGIES), ids=lambda c: c.__name__)
@PROPS
@given(data=st.data())
def test_round_trip_property(cls: type[wire.Record], data: st.DataObject) -> None:
    record = data.draw(RECORD_STRATEGIES[cls])
    encoded = wire.encode(record)
    assert isinstance(encoded, bytes)
    back = wire.decode(encoded, cls)
    assert type(back) is cls
    assert back == record
    assert_arrays_typed(back)
    assert wire.encode(back) == encoded  # canonical: re-encoding a decoded record is byte-identical


@PROPS
@given(group=scored_groups())
def test_scored_group_round_trip_keeps_members_in_order(group: wire.ScoredGroup) -> None:
    back = wire.decode(wire.encode(group), wire.ScoredGroup)
    assert [c.index for c in back.completions] == [c.index for c in group.completions]
    assert all(type(c) is wire.Completion for c in back.completions)
    for mine, theirs in zip(group.completions, back.completions, strict=True):
        assert np.array_equal(mine.completion_token_ids, theirs.completion_token_ids)
        assert theirs.behaviour_logprobs.dtype == np.float32
    assert back.rewards == group.rewards and back.partial == group.partial


@PROPS
@given(tokens=hnp.arrays(st.sampled_from([np.int64, np.int16, np.uint16]), st.integers(0, 32),
                         elements=st.integers(0, 30_000)))
def test_token_arrays_of_other_int_dtypes_decode_as_int32(tokens: np.ndarray) -> None:
    c = small_completion()
    c.prompt_token_ids = tokens
    back = wire.decode(wire.encode(c), wire.Completion)
    assert back.prompt_token_ids.dtype == np.int32
    assert back.prompt_token_ids.tolist() == tokens.tolist()


def test_memoryview_and_bytearray_inputs_decode() -> None:
    data = wire.encode(small_group())
    assert wire.decode(bytearray(data), wire.ScoredGroup) == small_group()
    assert wire.decode(memoryview(data), wire.ScoredGroup) == small_group()


def test_record_equality_sees_array_and_type_differences() -> None:
    a, b = small_completion(), small_completion()
    assert a == b
    b.completion_token_ids = b.completion_token_ids.copy()
    b.completion_token_ids[0] += 1
    assert a != b
    assert a != small_group()


# --------------------------------------------------------------------------------------------- 2. garbage


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_only_wire_error(data: bytes) -> None:
    decode_or_wire_error(data)


VALID_GROUP_BYTES = wire.encode(make_group("gsm8k-9@e1r2", group_size=3, tokens=4, version=1))


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID_GROUP_BYTES) - 1), st.integers(0, 255)),
                      min_size=1, max_size=8))
def test_byte_flips_of_valid_group_only_wire_error(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID_GROUP_BYTES)
    for pos, value in flips:
        data[pos] = value
    decode_or_wire_error(bytes(data))


@FUZZ
@given(cut=st.integers(0, len(VALID_GROUP_BYTES) - 1))
def test_truncations_of_valid_group_are_wire_errors(cut: int) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(VALID_GROUP_BYTES[:cut])


@FUZZ
@given(tail=st.binary(min_size=1, max_size=64))
def test_appended_bytes_to_valid_group_are_wire_errors(tail: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(VALID_GROUP_BYTES + tail)


@FUZZ
@given(obj=msgpack_objects)
def test_arbitrary_msgpack_objects_only_wire_error(obj: Any) -> None:
    decode_or_wire_error(pack(obj))


@FUZZ
@given(tag=st.sampled_from(sorted(wire.RECORD_TYPES)), data=st.data())
def test_maps_with_valid_header_and_random_fields_only_wire_error(tag: str, data: st.DataObject) -> None:
    """Past the header check: random values under the real field names exercise every field checker."""
    names = field_names(wire.RECORD_TYPES[tag])
    body = data.draw(st.dictionaries(st.sampled_from(names), msgpack_objects, max_size=len(names)))
    decode_or_wire_error(pack({"_t": tag, "_v": wire.SCHEMA_VERSION, **body}))


@FUZZ
@given(cls=st.sampled_from(list(SAMPLES)), data=st.data())
def test_one_field_of_valid_record_replaced_only_wire_error(cls: type[wire.Record],
                                                            data: st.DataObject) -> None:
    body = to_dict(SAMPLES[cls])
    target = body
    if cls is wire.ScoredGroup and data.draw(st.booleans(), label="tamper a member"):
        target = body["completions"][data.draw(st.integers(0, len(body["completions"]) - 1))]
    name = data.draw(st.sampled_from(sorted(target)))
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        target[name] = data.draw(msgpack_objects, label="value")
    elif action == "delete":
        del target[name]
    else:
        target[data.draw(st.text(max_size=8), label="new key")] = data.draw(msgpack_objects, label="value")
    decode_or_wire_error(pack(body))


@PROPS
@given(record=any_record, data=st.data())
def test_mutated_encodings_of_any_record_only_wire_error(record: wire.Record, data: st.DataObject) -> None:
    encoded = bytearray(wire.encode(record))
    for _ in range(data.draw(st.integers(1, 4))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    decode_or_wire_error(bytes(encoded))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x90", b"\x01", pack("text"), pack([1, 2]), pack(None),
                                  pack({1: 2}), b"\x81\xa1a" * 3, b"\xdd\xff\xff\xff\xff"],
                         ids=["empty", "reserved-byte", "empty-array", "int", "str", "list", "nil",
                              "int-key", "junk", "huge-array-header"])
def test_specific_garbage_is_wire_error(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(data)


@pytest.mark.parametrize("data", ["a str", None, 123, [b"\x80"]], ids=["str", "none", "int", "list"])
def test_non_bytes_input_is_wire_error(data: Any) -> None:
    with pytest.raises(wire.WireError, match="expected bytes"):
        wire.decode(data)


# --------------------------------------------------------------------------------------------- 3. validation


@pytest.mark.parametrize("version", [2, 0, -1, "1", None, [1]])
def test_wrong_schema_version(version: Any) -> None:
    body = to_dict(small_completion())
    body["_v"] = version
    assert_rejected(body, "schema version")


def test_missing_schema_version() -> None:
    body = to_dict(small_completion())
    del body["_v"]
    assert_rejected(body, "schema version")


@pytest.mark.parametrize("version", [True, 1.0], ids=["bool", "float"])
def test_schema_version_must_be_the_int(version: Any) -> None:
    body = to_dict(small_completion())
    body["_v"] = version
    assert_rejected(body, "schema version")


@pytest.mark.parametrize("tag", ["bogus", "Completion", "", 5, None, b"completion"])
def test_unknown_type_tag(tag: Any) -> None:
    body = to_dict(small_completion())
    body["_t"] = tag
    assert_rejected(body, "unknown record type")


def test_missing_type_tag() -> None:
    body = to_dict(small_completion())
    del body["_t"]
    assert_rejected(body, "unknown record type")


@pytest.mark.parametrize(("cls", "name"), required_fields(), ids=lambda x: getattr(x, "__name__", x))
def test_missing_required_field(cls: type[wire.Record], name: str) -> None:
    body = to_dict(SAMPLES[cls])
    del body[name]
    assert_rejected(body, name, "required field missing")


def test_missing_required_field_in_group_member_names_path() -> None:
    body = to_dict(small_group())
    del body["completions"][2]["behaviour_logprobs"]
    assert_rejected(body, "[2].behaviour_logprobs", "required field missing")


def test_optional_fields_may_be_omitted() -> None:
    body = to_dict(small_completion())
    for name in ("prompt", "completion", "epoch", "metadata", "timings"):
        del body[name]
    c = wire.decode(pack(body), wire.Completion)
    assert (c.prompt, c.completion, c.epoch, c.metadata, c.timings) == ("", "", 0, {}, {})
    body = to_dict(SAMPLES[wire.PromptTask])
    del body["prompt_token_ids"]
    task = wire.decode(pack(body), wire.PromptTask)
    assert task.prompt_token_ids.dtype == np.int32 and len(task.prompt_token_ids) == 0


WRONG_TYPES: list[tuple[type[wire.Record], str, Any, str]] = [
    (wire.Completion, "index", "1", "expected int"),
    (wire.Completion, "index", 1.0, "expected int"),
    (wire.Completion, "index", True, "expected int"),
    (wire.Completion, "group_id", 7, "expected str"),
    (wire.Completion, "group_id", b"bytes", "expected str"),
    (wire.Completion, "completion_token_ids", [1, 2, 3], "packed"),
    (wire.Completion, "behaviour_logprobs", "abc", "packed"),
    (wire.Completion, "metadata", [1, 2], "expected a map"),
    (wire.Completion, "timings", {"t": "slow"}, "expected a number"),
    (wire.Completion, "timings", {"t": True}, "expected a number"),
    (wire.ScoredGroup, "reward_mean", "0.5", "expected a number"),
    (wire.ScoredGroup, "rewards", {"a": 1.0}, "expected a list"),
    (wire.ScoredGroup, "partial", 1, "expected bool"),
    (wire.ScoredGroup, "completions", {"0": {}}, "expected a list"),
    (wire.ScoredGroup, "completions", [1, 2, 3, 4], "expected a map"),
    (wire.WeightChunk, "data", "text", "expected bytes"),
    (wire.DeadLetter, "raw", None, "expected bytes"),
    (wire.WeightsAnnouncement, "version", None, "expected int"),
    (wire.PromptTask, "prompt", ["a"], "expected str"),
]


@pytest.mark.parametrize(("cls", "name", "value", "fragment"), WRONG_TYPES,
                         ids=[f"{c.__name__}.{n}={v!r}" for c, n, v, _ in WRONG_TYPES])
def test_wrong_field_type(cls: type[wire.Record], name: str, value: Any, fragment: str) -> None:
    body = to_dict(SAMPLES[cls])
    body[name] = value
    assert_rejected(body, name, fragment)


@pytest.mark.parametrize("value", [1 << 63, (1 << 64) - 1])  # msgpack cannot pack below int64
def test_int_out_of_int64_range(value: int) -> None:
    body = to_dict(small_completion())
    body["epoch"] = value
    assert_rejected(body, "epoch", "int64")


def test_int64_bounds_accepted() -> None:
    for value in (INT64_MIN, INT64_MAX):
        body = to_dict(small_completion())
        body["epoch"] = value
        assert wire.decode(pack(body), wire.Completion).epoch == value


def test_tokens_logprobs_length_mismatch() -> None:
    body = to_dict(small_completion())
    body["behaviour_logprobs"] = body["behaviour_logprobs"][:-4]
    assert_rejected(body, "behaviour_logprobs", "7 values for 8 completion tokens")
    body = to_dict(small_completion())
    body["completion_token_ids"] += np.int32(5).tobytes()
    assert_rejected(body, "behaviour_logprobs", "8 values for 9 completion tokens")


@pytest.mark.parametrize("name", ["completion_token_ids", "behaviour_logprobs", "prompt_token_ids"])
def test_array_bytes_not_multiple_of_four(name: str) -> None:
    body = to_dict(small_completion())
    body[name] = body[name][:-1]
    assert_rejected(body, name, "4-byte")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_logprobs(bad: float) -> None:
    c = small_completion()
    lp = c.behaviour_logprobs.copy()
    lp[3] = bad
    body = to_dict(c)
    body["behaviour_logprobs"] = lp.astype("<f4").tobytes()
    assert_rejected(body, "behaviour_logprobs", "NaN or inf")


def test_non_finite_logprobs_in_group_member_names_path() -> None:
    body = to_dict(small_group())
    lp = np.frombuffer(body["completions"][1]["behaviour_logprobs"], dtype="<f4").copy()
    lp[0] = np.nan
    body["completions"][1]["behaviour_logprobs"] = lp.tobytes()
    assert_rejected(body, "[1].behaviour_logprobs", "NaN or inf", expected=wire.ScoredGroup)


def test_positive_logprobs() -> None:
    body = to_dict(small_completion())
    lp = np.frombuffer(body["behaviour_logprobs"], dtype="<f4").copy()
    lp[0] = 0.5
    body["behaviour_logprobs"] = lp.tobytes()
    assert_rejected(body, "behaviour_logprobs", "> 0")


def test_float32_noise_just_above_zero_logprob_tolerated() -> None:
    body = to_dict(small_completion())
    lp = np.frombuffer(body["behaviour_logprobs"], dtype="<f4").copy()
    lp[0] = 1e-5
    body["behaviour_logprobs"] = lp.tobytes()
    assert wire.decode(pack(body), wire.Completion).behaviour_logprobs[0] == np.float32(1e-5)


@pytest.mark.parametrize("name", ["rewards", "reward_mean", "reward_std", "scored_at"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_group_floats(name: str, bad: float) -> None:
    body = to_dict(small_group())
    if name == "rewards":
        body[name][2] = bad
    else:
        body[name] = bad
    assert_rejected(body, name, "not finite")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_float_in_metadata_and_timings(bad: float) -> None:
    body = to_dict(small_completion())
    body["metadata"] = {"score": bad}
    assert_rejected(body, "metadata", "score", "not finite")
    body = to_dict(small_completion())
    body["timings"] = {"generate_s": bad}
    assert_rejected(body, "timings", "generate_s", "not finite")


@pytest.mark.parametrize(("index", "group_size", "fragment"),
                         [(4, 4, "index"), (9, 4, "index"), (-1, 4, "index"), (0, 0, "group_size"),
                          (0, wire.MAX_GROUP_SIZE + 1, "group_size")])
def test_index_and_group_size_bounds(index: int, group_size: int, fragment: str) -> None:
    body = to_dict(small_completion())
    body["index"], body["group_size"] = index, group_size
    assert_rejected(body, fragment)


def test_index_at_group_size_names_both() -> None:
    body = to_dict(small_completion())
    body["index"] = 4
    assert_rejected(body, "index: 4", "group_size=4")


def test_negative_policy_version_and_unknown_finish_reason() -> None:
    body = to_dict(small_completion())
    body["policy_version"] = -1
    assert_rejected(body, "policy_version")
    body = to_dict(small_completion())
    body["finish_reason"] = "timeout"
    assert_rejected(body, "finish_reason", "timeout")


def test_a_group_has_its_oldest_members_version() -> None:
    # A member that had sampled nothing when an in-flight swap came starts at the newer version.
    body = to_dict(small_group(version=3))
    body["completions"][2]["policy_version"] = 4
    back = wire.decode(pack(body), wire.ScoredGroup)
    assert (back.policy_version, back.newest_version) == (3, 4)
    body = to_dict(small_group(version=3))
    body["completions"][2]["policy_version"] = 2
    assert_rejected(body, "version 2", "older than the group's 3", expected=wire.ScoredGroup)


def test_group_with_duplicate_index() -> None:
    body = to_dict(small_group())
    body["completions"][3]["index"] = 1
    assert_rejected(body, "index 1 twice")


def test_group_with_member_of_another_group() -> None:
    body = to_dict(small_group())
    body["completions"][0]["group_id"] = "gsm8k-2@e0r0"
    assert_rejected(body, "member of", "gsm8k-2@e0r0")


def test_group_with_too_few_members_needs_partial() -> None:
    body = to_dict(small_group(group_size=4))
    body["completions"] = body["completions"][:3]
    body["rewards"] = body["rewards"][:3]
    assert_rejected(body, "3 members for group_size 4", "partial=False")
    body["partial"] = True
    group = wire.decode(pack(body), wire.ScoredGroup)
    assert group.partial and len(group.completions) == 3 and group.group_size == 4


def test_group_partial_but_empty_or_oversized() -> None:
    body = to_dict(small_group(group_size=4))
    body["partial"], body["completions"], body["rewards"] = True, [], []
    assert_rejected(body, "0 members")
    body = to_dict(small_group(group_size=4))
    body["completions"].append(body["completions"][0])
    body["rewards"].append(0.0)
    assert_rejected(body, "5 members for group_size 4")


def test_a_completion_carries_the_versions_of_its_tokens() -> None:
    """Partial rollout: tokens 0-1 from v3, 2-5 from v5, 6-7 from v6; the span is omitted when there is none."""
    plain = make_completion("g@e0r0", 0, 4, tokens=8, version=3)
    assert "later_versions" not in msgpack.unpackb(wire.encode(plain), raw=False) and plain.newest_version == 3
    spanned = dataclasses.replace(plain, later_versions=[5, 6], later_starts=[2, 6])
    back = wire.decode(wire.encode(spanned), wire.Completion)
    assert (back.policy_version, back.newest_version, back.later_starts) == (3, 6, [2, 6])
    assert back.token_versions().tolist() == [3, 3, 5, 5, 5, 5, 6, 6]
    for bad, fragment in (({"later_versions": [3], "later_starts": [2]}, "must increase from policy_version"),
                          ({"later_versions": [5, 4], "later_starts": [2, 3]}, "must increase from policy_version"),
                          ({"later_versions": [5], "later_starts": [0]}, "within \\(0, 8\\)"),
                          ({"later_versions": [5], "later_starts": [8]}, "within \\(0, 8\\)"),
                          ({"later_versions": [5, 6], "later_starts": [2]}, "1 values for 2")):
        with pytest.raises(wire.WireError, match=fragment):
            wire.encode(dataclasses.replace(plain, **bad))


def test_a_completion_says_which_temperature_its_logprobs_are_at() -> None:
    plain = make_completion("g@e0r0", 0, 4, tokens=8)
    assert "logprob_temperature" not in msgpack.unpackb(wire.encode(plain), raw=False)  # 0: raw, as before
    tempered = wire.decode(wire.encode(dataclasses.replace(plain, logprob_temperature=0.7)), wire.Completion)
    assert tempered.logprob_temperature == 0.7
    with pytest.raises(wire.WireError, match="logprob_temperature"):
        wire.encode(dataclasses.replace(plain, logprob_temperature=-1.0))


def test_failed_members_travel_only_when_there_are_some() -> None:
    """``failed`` was added without a schema bump: left out while empty, so records without failures are the same
    bytes a reader predating it accepts, and its records still decode here."""
    group = make_group(group_size=4, tokens=8)
    body = msgpack.unpackb(wire.encode(group), raw=False)
    assert "failed" not in body
    assert wire.decode(msgpack.packb(body, use_bin_type=True), wire.ScoredGroup).failed == []
    marked = dataclasses.replace(group, failed=[2, 0])
    assert msgpack.unpackb(wire.encode(marked), raw=False)["failed"] == [2, 0]
    assert wire.decode(wire.encode(marked), wire.ScoredGroup).failed == [2, 0]
    for bad in ([4], [-1], [1, 1]):
        with pytest.raises(wire.WireError, match="failed"):
            wire.encode(dataclasses.replace(group, failed=bad))


def test_the_valid_part_of_a_group_leaves_out_its_failed_members() -> None:
    group = dataclasses.replace(make_group(group_size=4, tokens=8), rewards=[1.0, 0.0, 0.5, 0.0], failed=[1, 3])
    part = group.valid_part()
    assert [c.index for c in part.completions] == [group.completions[0].index, group.completions[2].index]
    assert (part.rewards, part.failed, part.partial) == ([1.0, 0.5], [], True)
    assert make_group(group_size=4, tokens=8).valid_part().partial is False


def test_group_rewards_count_and_std_sign() -> None:
    body = to_dict(small_group())
    body["rewards"] = body["rewards"][:-1]
    assert_rejected(body, "rewards", "3 values for 4 completions")
    body = to_dict(small_group())
    body["reward_std"] = -0.1
    assert_rejected(body, "reward_std")


def test_group_members_must_share_group_size() -> None:
    body = to_dict(small_group(group_size=2))
    for member, index in zip(body["completions"], (5, 7), strict=True):
        member["group_size"], member["index"] = 8, index
    assert_rejected(body, "group_size")


def test_a_newer_writers_additive_fields_are_ignored() -> None:
    """Schema evolution: a field this reader does not know (a newer writer's optional one) is ignored, at the
    top and inside nested records, so roles upgrade one at a time."""
    body = to_dict(small_completion())
    body["surprise"] = {"any": [1, 2]}
    assert wire.decode(pack(body), wire.Completion) == small_completion()
    body = to_dict(small_group())
    body["completions"][0]["also_surprise"] = "x"
    assert wire.decode(pack(body), wire.ScoredGroup) == small_group()


@pytest.mark.parametrize(("version", "fragment"), [(2, "newer than this reader's (1): upgrade"),
                                                   (99, "newer than this reader's"),
                                                   (0, "this reader decodes majors [1]")])
def test_a_major_version_is_read_only_if_this_reader_ever_wrote_it(version: int, fragment: str) -> None:
    body = to_dict(small_completion())
    body["_v"] = version
    assert_rejected(body, "schema version", fragment)


def test_an_older_major_is_upgraded_on_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """How a breaking change is carried: major 2 renames a field; a major-1 body is upgraded, not refused."""
    monkeypatch.setattr(wire, "UPGRADES", {0: lambda b: {**b, "task": b.pop("kind")}, 1: None})
    body = to_dict(small_completion())
    body["_v"], body["kind"] = 0, body.pop("task")
    assert wire.decode(pack(body), wire.Completion) == small_completion()


def test_non_str_map_key_in_metadata() -> None:
    body = to_dict(small_completion())
    body["metadata"] = {b"raw": 1}
    assert_rejected(body, "metadata", "not a str")


def test_nested_containers_in_metadata() -> None:
    body = to_dict(small_completion())
    body["metadata"] = {"deep": [[1]]}
    assert_rejected(body, "metadata", "nested")
    body["metadata"] = {"deep": {"a": 1}}
    assert_rejected(body, "metadata", "unsupported value type")
    body["metadata"] = {"b": b"bytes"}
    assert_rejected(body, "metadata", "unsupported value type")


def test_metadata_size_caps() -> None:
    body = to_dict(small_completion())
    body["metadata"] = {str(i): i for i in range(wire.MAX_MAP_ITEMS + 1)}
    assert_rejected(body, "metadata", "cap")
    body["metadata"] = {"tags": list(range(wire.MAX_MAP_ITEMS + 1))}
    assert_rejected(body, "metadata", "cap")


def test_record_bigger_than_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    data = wire.encode(small_group())
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", len(data) - 1)
    assert_rejected(data, str(len(data)), "cap")
    with pytest.raises(wire.WireError, match="cap"):
        wire.encode(small_group())
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", len(data))
    assert wire.decode(data, wire.ScoredGroup) == small_group()


def test_token_count_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    data = wire.encode(small_completion())  # encode enforces the caps too: patch them afterwards
    monkeypatch.setattr(wire, "MAX_TOKENS", 7)
    assert_rejected(data, "completion_token_ids", "cap")


def test_string_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    data = wire.encode(small_completion())
    monkeypatch.setattr(wire, "MAX_STR_CHARS", 10)
    assert_rejected(data, "group_id", "string of 12 chars", "cap")


@pytest.mark.parametrize("actual", list(SAMPLES), ids=lambda c: c.__name__)
def test_expected_type_mismatch(actual: type[wire.Record]) -> None:
    other = wire.ScoredGroup if actual is not wire.ScoredGroup else wire.Completion
    assert_rejected(wire.encode(SAMPLES[actual]), f"expected a {other.TYPE} record", repr(actual.TYPE),
                    expected=other)


@pytest.mark.parametrize("name", ["completion_token_ids", "prompt_token_ids"])
def test_negative_token_id(name: str) -> None:
    body = to_dict(small_completion())
    ids_ = np.frombuffer(body[name], dtype="<i4").copy()
    ids_[-1] = -3
    body[name] = ids_.tobytes()
    assert_rejected(body, name, "negative token id")


@pytest.mark.parametrize("sha", ["AB" * 32, "ab" * 31, "ab" * 33, "zz" * 32, "", "ab" * 31 + "a "])
def test_bad_sha256(sha: str) -> None:
    body = to_dict(SAMPLES[wire.WeightsAnnouncement])
    body["sha256"] = sha
    assert_rejected(body, "sha256", "64 lowercase hex")


def test_kafka_store_needs_chunks_and_store_must_be_known() -> None:
    body = to_dict(SAMPLES[wire.WeightsAnnouncement])
    body["num_chunks"] = 0
    assert_rejected(body, "num_chunks", "kafka")
    body["store"] = "fs"
    assert wire.decode(pack(body), wire.WeightsAnnouncement).num_chunks == 0
    body["store"] = "s3"
    assert_rejected(body, "store", "s3")


@pytest.mark.parametrize(("name", "fragment"), [("size_bytes", "sizes"), ("num_chunks", "sizes"),
                                               ("chunk_bytes", "sizes"), ("version", "version")])
def test_negative_weight_sizes(name: str, fragment: str) -> None:
    body = to_dict(SAMPLES[wire.WeightsAnnouncement])
    body[name] = -1
    assert_rejected(body, fragment, ">= 0" if fragment == "sizes" else "< 0")


@pytest.mark.parametrize(("index", "num_chunks"), [(2, 2), (-1, 2), (0, 0)])
def test_weight_chunk_index_bounds(index: int, num_chunks: int) -> None:
    body = to_dict(SAMPLES[wire.WeightChunk])
    body["index"], body["num_chunks"] = index, num_chunks
    assert_rejected(body, "index")


def test_prompt_task_invariants() -> None:
    body = to_dict(SAMPLES[wire.PromptTask])
    body["prompt_id"] = ""
    assert_rejected(body, "prompt_id")
    for name in ("epoch", "sample_round"):
        body = to_dict(SAMPLES[wire.PromptTask])
        body[name] = -1
        assert_rejected(body, "epoch/sample_round")


def test_top_level_not_a_map() -> None:
    assert_rejected(pack([1, 2, 3]), "expected a msgpack map", "list")
    assert_rejected(b"\xc1", "not msgpack")


# --------------------------------------------------------------------------------------------- 4. encode


def _tamper(record: wire.Record, mutate: Callable[[Any], None]) -> wire.Record:
    mutate(record)
    return record


def _set(name: str, value: Any) -> Callable[[Any], None]:
    return lambda r: setattr(r, name, value)


INVALID_AT_SOURCE: list[Any] = [
    pytest.param(small_completion, _set("behaviour_logprobs", np.zeros(3, np.float32)), id="length-mismatch"),
    pytest.param(small_completion, _set("index", 4), id="index>=group_size"),
    pytest.param(small_completion, _set("finish_reason", "nope"), id="finish-reason"),
    pytest.param(small_completion, _set("behaviour_logprobs", np.full(8, 0.5, np.float32)), id="positive-lp"),
    pytest.param(small_group, lambda g: setattr(g.completions[1], "policy_version", 2), id="member-older-than-group"),
    pytest.param(small_group, lambda g: g.completions.pop(), id="too-few-members"),
    pytest.param(small_group, _set("rewards", [1.0]), id="rewards-count"),
    pytest.param(lambda: SAMPLES[wire.WeightsAnnouncement], _set("sha256", "x"), id="bad-sha"),
    pytest.param(lambda: wire.WeightChunk(run="r", version=0, index=0, num_chunks=1, data=b""),
                 _set("index", 1), id="chunk-index"),
    pytest.param(lambda: wire.PromptTask(prompt_id="p", prompt="", task=""), _set("prompt_id", ""),
                 id="empty-prompt-id"),
    pytest.param(small_completion, _set("metadata", {"x": object()}), id="unpackable-metadata"),
    pytest.param(small_completion, _set("prompt", "\ud800"), id="lone-surrogate"),
    pytest.param(small_completion, _set("epoch", 1 << 64), id="int-beyond-uint64"),
]


@pytest.mark.parametrize(("factory", "mutate"), INVALID_AT_SOURCE)
def test_encode_rejects_invalid_record(factory: Callable[[], wire.Record],
                                       mutate: Callable[[Any], None]) -> None:
    record = _tamper(factory(), mutate)
    with pytest.raises(wire.WireError):
        wire.encode(record)


def test_encode_length_mismatch_message() -> None:
    c = small_completion()
    c.behaviour_logprobs = c.behaviour_logprobs[:5]
    with pytest.raises(wire.WireError, match="5 values for 8 completion tokens"):
        wire.encode(c)


ENCODER_BLIND_SPOTS: list[Any] = [
    pytest.param(_set("behaviour_logprobs", np.array([np.nan] * 8, np.float32)), id="nan-logprobs"),
    pytest.param(_set("completion_token_ids", np.full(8, -1, np.int32)), id="negative-token-id"),
    pytest.param(_set("completion_token_ids", np.full(8, (1 << 32) + 5, np.int64)), id="int64-token-wraps"),
    pytest.param(_set("epoch", 1 << 63), id="epoch-beyond-int64"),
    pytest.param(_set("group_id", 12), id="int-group-id"),
]


@pytest.mark.parametrize("mutate", ENCODER_BLIND_SPOTS)
def test_encode_rejects_what_decode_would_reject(mutate: Callable[[Any], None]) -> None:
    record = _tamper(small_completion(), mutate)
    with pytest.raises(wire.WireError):
        wire.encode(record)


def test_encode_packs_list_logprobs_and_rejects_bad_lists_with_wire_error() -> None:
    c = small_completion()
    c.behaviour_logprobs = [-1.0] * 8  # type: ignore[assignment]
    back = wire.decode(wire.encode(c), wire.Completion)
    assert back.behaviour_logprobs.dtype == np.float32 and back.behaviour_logprobs.tolist() == [-1.0] * 8
    c.behaviour_logprobs = ["x"] * 8  # type: ignore[assignment]
    with pytest.raises(wire.WireError):
        wire.encode(c)


# --------------------------------------------------------------------------------------------- 5. group ids


def test_make_group_id_is_stable() -> None:
    assert wire.make_group_id("gsm8k-1", 0) == wire.make_group_id("gsm8k-1", 0, 0) == "gsm8k-1@e0r0"
    assert wire.make_group_id("gsm8k-1", 3, 2) == "gsm8k-1@e3r2"
    task = wire.PromptTask(prompt_id="gsm8k-1", prompt="", task="math", epoch=3, sample_round=2)
    assert task.group_id == wire.make_group_id("gsm8k-1", 3, 2)


def test_make_group_id_distinct_across_epoch_and_round() -> None:
    got = {wire.make_group_id("p", e, r) for e in range(12) for r in range(12)}
    assert len(got) == 144
    assert wire.make_group_id("p", 1, 12) != wire.make_group_id("p", 11, 2)


@PROPS
@given(a=st.tuples(ids, st.integers(0, 10**6), st.integers(0, 10**6)),
       b=st.tuples(ids, st.integers(0, 10**6), st.integers(0, 10**6)))
def test_make_group_id_injective(a: tuple[str, int, int], b: tuple[str, int, int]) -> None:
    assume(a != b)
    assert wire.make_group_id(*a) != wire.make_group_id(*b)
    assert wire.make_group_id(*a) == f"{a[0]}@e{a[1]}r{a[2]}"
