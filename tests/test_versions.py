"""The learner's incarnations as ``grpo-stream audit`` reports them, from synthetic run files (no broker): how
many incarnations the lineage holds, the restarts, and the version numbers announced again after a restart. They
are figures beside the exactly-once promises, never one of them."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_stream.audit import Audit, add_incarnations, format_audit
from grpo_stream.versions import describe_again, read_incarnations


def write_lines(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def announced(version: int, incarnation: int, sha: str) -> dict:
    return {"version": version, "incarnation": incarnation, "sha256": sha * 64, "size_bytes": 8, "store": "fs",
            "published_at": 0.0}


def test_the_audit_names_the_restarts_and_the_versions_announced_again(tmp_path: Path) -> None:
    write_lines(tmp_path / "lineage.jsonl", [{"step": s, "incarnation": i, "trained": [], "dropped": []}
                                             for s, i in ((10, 0), (11, 1), (12, 1))])
    write_lines(tmp_path / "versions.jsonl", [announced(10, 0, "a"), announced(11, 0, "b"), announced(12, 0, "c"),
                                              announced(10, 1, "a"), announced(11, 1, "d"), announced(12, 1, "e")])
    (tmp_path / "incarnation").write_text("1\n")
    a = add_incarnations(Audit(), tmp_path)
    assert (a.incarnations, a.restarts, a.announced_other_weights) == ([0, 1], 1, 2)
    assert a.announced_again == {10: [0, 1], 11: [0, 1], 12: [0, 1]}
    assert a.broken() == []  # a restart that announces versions again breaks no promise
    rows = dict(line.split("  ", 1) for line in format_audit(a).splitlines())
    assert rows["learner incarnations in the lineage"].strip() == "2 (0, 1)"
    assert rows["learner restarts"].strip() == "1"
    assert rows["versions announced again after a restart"].strip() == "v10-v12 (incarnations 0 -> 1)"
    assert rows["versions announced with other weights"].strip() == "2"


def test_a_run_from_before_incarnations_audits_as_before(tmp_path: Path) -> None:
    write_lines(tmp_path / "lineage.jsonl", [{"step": 1, "trained": [], "dropped": []}])
    a = add_incarnations(Audit(), tmp_path)
    assert (a.incarnations, a.restarts, a.announced_again) == ([], None, None)
    assert format_audit(a) == format_audit(Audit())


def test_the_restarts_count_starts_that_left_no_lineage(tmp_path: Path) -> None:
    """An incarnation that died before its first checkpoint leaves no lineage lines: the start count tells."""
    write_lines(tmp_path / "lineage.jsonl", [{"step": 3, "incarnation": 0, "trained": [], "dropped": []}])
    write_lines(tmp_path / "versions.jsonl", [announced(2, 0, "a")])
    (tmp_path / "incarnation").write_text("3\n")
    found = read_incarnations(tmp_path)
    assert (found.in_lineage, found.restarts, found.again()) == ([0], 3, {})
    assert add_incarnations(Audit(), tmp_path).announced_again == {}  # recorded: "none", not silence
    (tmp_path / "incarnation").unlink()
    assert read_incarnations(tmp_path).restarts == 0


def test_versions_announced_again_read_as_runs_of_neighbours() -> None:
    again = {10: [0, 1], 20: [0, 1], 30: [0, 1, 2], 40: [1, 2], 50: [1, 2]}
    assert describe_again(again) == ("v10-v20 (incarnations 0 -> 1), v30 (incarnations 0 -> 1 -> 2), "
                                     "v40-v50 (incarnations 1 -> 2)")
    assert describe_again({}) == ""
