"""Golden wire records: the bytes of every released schema major (``tests/golden/wire-v*/``, written once by
``tests/golden/write.py`` and never rewritten) still decode, and the recorded scored groups still train. A
schema change that breaks an old record fails here, not on somebody's recorded ``groups`` log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_core import wire
from grpo_core.config import load_config
from grpo_learner.config import LearnerConfig
from grpo_learner.trainer import Trainer
from grpo_stream.tiny_model import build_tiny_model

GOLDEN = Path(__file__).parent / "golden"
FILES = sorted(GOLDEN.glob("wire-v*/*.msgpack"))


def _type_of(path: Path) -> type[wire.Record]:
    return wire.RECORD_TYPES[path.stem.split("-")[0]]


def test_every_record_type_of_every_major_has_a_golden_record() -> None:
    majors = sorted(int(d.name.removeprefix("wire-v")) for d in GOLDEN.glob("wire-v*"))
    assert majors == sorted(wire.UPGRADES), "a golden directory per major this code ever wrote (write.py)"
    current = {p.stem.split("-")[0] for p in (GOLDEN / f"wire-v{wire.SCHEMA_VERSION}").glob("*.msgpack")}
    assert current == set(wire.RECORD_TYPES), "a record type without a golden record: run tests/golden/write.py"


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_golden_record_still_decodes(path: Path) -> None:
    record = wire.decode(path.read_bytes(), _type_of(path))
    assert wire.decode(wire.encode(record), type(record)) == record  # and this code can write it again


def test_the_first_release_group_and_the_spanned_one_decode_as_recorded() -> None:
    first = wire.decode((GOLDEN / "wire-v1/scored_group-first-release.msgpack").read_bytes(), wire.ScoredGroup)
    spanned = wire.decode((GOLDEN / "wire-v1/scored_group.msgpack").read_bytes(), wire.ScoredGroup)
    assert [c.later_versions for c in first.completions] == [[], [], [], []]
    assert all(c.logprob_temperature == 0.0 for c in first.completions) and first.failed == []  # 0: raw
    assert spanned.completions[1].later_versions == [8] and spanned.completions[1].later_starts == [3]
    assert first.policy_version == spanned.policy_version == 7 and first.rewards == [0.0, 0.5, 1.0, 0.25]


def test_the_golden_groups_still_train(tmp_path: Path) -> None:
    groups = [wire.decode(p.read_bytes(), wire.ScoredGroup) for p in FILES if _type_of(p) is wire.ScoredGroup]
    assert len(groups) >= 2
    model_dir = build_tiny_model(tmp_path / "tiny")
    cfg = load_config(LearnerConfig, None, [f"model.path={model_dir}", "pipeline.group_size=4", "optim.lr=1e-2"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    stats = Trainer(cfg, model).train_step(groups)
    assert stats.skipped_updates == 0 and np.isfinite(stats.metrics["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
