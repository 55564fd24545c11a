"""The configuration reference page (docs/configuration.md) is generated from the typed configs and kept current:
every key of every role, with its default and help text; a stale page fails the check that ops/test.sh runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_core.config import explain_rows
from grpo_learner.config import LearnerConfig
from grpo_stream import config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_what_the_configs_declare() -> None:
    assert (ROOT / config_reference.PAGE).read_text() == config_reference.render(), \
        "docs/configuration.md is stale: run `grpo-stream config reference`"


def test_every_learner_key_is_on_the_page_once_with_its_default_and_help() -> None:
    page = config_reference.render()
    learner = page.split("## Learner")[1].split("\n## ")[0]
    rows = [(k, d, h) for k, d, h in explain_rows(LearnerConfig) if not k.startswith(config_reference.SHARED)]
    assert rows and all(f"| `{k}` | `{d}` |" in learner for k, d, _ in rows)
    assert "| `checkpoint_every` |" in learner and "| `pipeline.group_size` |" not in learner  # shared: listed once
    assert page.count("| `pipeline.group_size` |") == 1 and page.count("| `kafka.bootstrap` |") == 1
    assert "&lt;run>" in page and "'<run>" not in page.split("`")[0]  # help text: '<' escaped outside code


def test_the_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "configuration.md"
    assert config_reference.main(check=True, page=page) == 1  # missing
    page.write_text(config_reference.render().replace("checkpoint_every", "checkpoint_evry"))
    assert config_reference.main(check=True, page=page) == 1
    assert "is stale" in capsys.readouterr().out
    assert config_reference.main(check=False, page=page) == 0
    assert config_reference.main(check=True, page=page) == 0
