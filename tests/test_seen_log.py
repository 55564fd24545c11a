"""The learner's dedup log (``grpo_learner.seen_log``): appended per checkpoint, cut back at restore, compacted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_learner.seen_log import SeenLog, SeenLogError


def lines(path: Path) -> list[str]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_checkpoint_appends_only_the_ids_trained_since_the_last(tmp_path: Path) -> None:
    log = SeenLog(tmp_path, window=100)
    log.start([])
    assert log.append(["a", "b"], ["a", "b"]) == {"file": "seen-00000001.jsonl", "count": 2}
    assert log.append([], ["a", "b"]) == {"file": "seen-00000001.jsonl", "count": 2}  # a step that trained none
    odd = 'id with "quotes", a\nnewline and ü'
    ref = log.append(["c", odd], ["a", "b", "c", odd])
    log.close()
    assert ref == {"file": "seen-00000001.jsonl", "count": 4}
    assert lines(tmp_path / ref["file"]) == ["a", "b", "c", odd]  # once each: nothing is written twice
    assert SeenLog(tmp_path, window=100).restore(ref) == ["a", "b", "c", odd]
    assert SeenLog(tmp_path, window=3).restore(ref) == ["b", "c", odd]  # the newest window


def test_restore_cuts_the_lines_of_a_checkpoint_that_was_never_committed(tmp_path: Path) -> None:
    log = SeenLog(tmp_path, window=100)
    log.start([])
    ref = log.append(["a", "b"], ["a", "b"])
    log.append(["c"], ["a", "b", "c"])  # fsynced, then the process died before its checkpoint's rename
    log.close()
    again = SeenLog(tmp_path, window=100)
    assert again.restore(ref) == ["a", "b"]
    assert again.append(["d"], ["a", "b", "d"]) == {"file": "seen-00000001.jsonl", "count": 3}
    again.close()
    assert lines(tmp_path / "seen-00000001.jsonl") == ["a", "b", "d"]


def test_a_full_file_is_compacted_into_the_next_and_the_old_one_goes_once_no_checkpoint_names_it(
        tmp_path: Path) -> None:
    log = SeenLog(tmp_path, window=3)
    log.start([])
    first = log.append(["a", "b", "c"], ["a", "b", "c"])
    second = log.append(["d", "e", "f"], ["d", "e", "f"])  # two windows: still one file
    assert second == {"file": "seen-00000001.jsonl", "count": 6}
    third = log.append(["g"], ["e", "f", "g"])
    assert third == {"file": "seen-00000002.jsonl", "count": 3}
    assert lines(tmp_path / "seen-00000002.jsonl") == ["e", "f", "g"]
    kept = tmp_path / "step-00000002"  # the older kept checkpoint still names the first file
    kept.mkdir()
    (kept / "meta.json").write_text(json.dumps({"seen_log": second}))
    log.gc([kept])
    assert (tmp_path / "seen-00000001.jsonl").exists()
    (kept / "meta.json").write_text(json.dumps({"seen_log": third}))
    log.gc([kept])
    assert not (tmp_path / "seen-00000001.jsonl").exists()
    assert SeenLog(tmp_path, window=3).restore(third) == ["e", "f", "g"]
    with pytest.raises(SeenLogError, match="seen-00000001.jsonl: the checkpoint's dedup log is missing"):
        SeenLog(tmp_path, window=3).restore(first)


def test_restore_drops_a_copy_made_for_a_checkpoint_that_was_never_committed(tmp_path: Path) -> None:
    log = SeenLog(tmp_path, window=2)
    log.start([])
    ref = log.append(["a", "b", "c", "d"], ["c", "d"])
    log.append(["e"], ["d", "e"])  # compacted into the second file, then the process died
    log.close()
    assert (tmp_path / "seen-00000002.jsonl").exists()
    again = SeenLog(tmp_path, window=2)
    assert again.restore(ref) == ["c", "d"]
    assert not (tmp_path / "seen-00000002.jsonl").exists()
    assert again.append(["f"], ["d", "f"]) == {"file": "seen-00000002.jsonl", "count": 2}


def test_a_file_shorter_than_its_checkpoint_says_is_an_error_not_a_smaller_dedup_set(tmp_path: Path) -> None:
    log = SeenLog(tmp_path, window=100)
    log.start([])
    log.append(["a", "b"], ["a", "b"])
    log.close()
    with pytest.raises(SeenLogError, match="the checkpoint counts 3 trained ids, the file holds 2"):
        SeenLog(tmp_path, window=100).restore({"file": "seen-00000001.jsonl", "count": 3})


def test_a_start_from_an_older_checkpoint_writes_its_set_into_a_new_file(tmp_path: Path) -> None:
    (tmp_path / "seen-00000004.jsonl").write_text('"stale"\n')  # left by an attempt no checkpoint names
    log = SeenLog(tmp_path, window=2)
    log.start(["x", "y", "z"])
    assert log.ref() == {"file": "seen-00000005.jsonl", "count": 2}
    log.gc([])
    log.close()
    assert [p.name for p in tmp_path.glob("seen-*")] == ["seen-00000005.jsonl"]
    assert lines(tmp_path / "seen-00000005.jsonl") == ["y", "z"]


def test_the_checkpoint_benchmark_compares_both_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_stream.bench import checkpoint_cost
    from grpo_stream.tiny_model import build_tiny_model

    rows = checkpoint_cost.report(build_tiny_model(tmp_path / "model"), windows=(5_000,), repeats=2)
    [row] = rows
    assert row["window"] == 5_000 and row["whole_ms"] > 0 and row["log_ms"] > 0
    # Bytes, not time: the whole set is ~0.1 MB of ids in trainer.pt; the log adds 16 lines.
    assert row["whole_mb"] - row["log_mb"] > 0.05
    assert "window     5,000 ids: whole set in trainer.pt" in capsys.readouterr().out
