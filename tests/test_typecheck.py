"""ops/typecheck.py: mypy gets each file of a service's folder under the name the code imports it by.

The folders ``producers/``, ``verifiers/``, ``learner/`` install as ``grpo_producers`` ... (pyproject.toml's
[tool.setuptools.package-dir]); a bare ``mypy`` would name their files ``producers.service`` and find no
``grpo_producers`` to resolve the imports against. The type check itself is ``python ops/typecheck.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("mypy")
from mypy.modulefinder import BuildSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _typecheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("typecheck", REPO / "ops" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_folders_are_renamed_as_setuptools_installs_them() -> None:
    assert _typecheck().renames() == {"producers": "grpo_producers", "verifiers": "grpo_verifiers",
                                      "learner": "grpo_learner", "configs": "grpo_stream.configs"}


def test_a_source_gets_its_import_name_and_keeps_its_path() -> None:
    tc = _typecheck()
    folders = tc.renames()
    got = tc.renamed(BuildSource("producers/backends/hf.py", "producers.backends.hf", None, str(REPO)), folders)
    assert (got.module, got.path, got.base_dir) == ("grpo_producers.backends.hf", "producers/backends/hf.py", str(REPO))
    assert tc.renamed(BuildSource("learner/__init__.py", "learner"), folders).module == "grpo_learner"
    for module in ("grpo_core.wire", "grpo_stream.run", "producersx.y"):  # other packages keep their names
        assert tc.renamed(BuildSource(None, module), folders).module == module
