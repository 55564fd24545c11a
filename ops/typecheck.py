"""Type-check the project with mypy: ``python ops/typecheck.py`` from the repository root (extra arguments go to mypy).

What is checked and how strictly is [tool.mypy] in pyproject.toml; this script only fixes the module names. mypy
names a file by its folders (``producers/service.py`` is ``producers.service``) and cannot follow the finder hook of
setuptools' editable install, so the services' ``grpo_producers`` / ``grpo_verifiers`` / ``grpo_learner`` imports
would not resolve under a bare ``mypy``. Here every source under a folder of [tool.setuptools.package-dir] is handed to
mypy under the name the code imports it by (``grpo_producers.service``), which is how those imports then resolve;
errors still name the real files. Exit status as mypy's: 0 clean, 1 type errors, 2 a blocking error.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build, util
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]


def renames(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Top-level folder -> the package it installs as (``producers`` -> ``grpo_producers``, ``configs`` ->
    ``grpo_stream.configs``); folders below them keep their names."""
    package_dir: dict[str, str] = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {folder: name for name, folder in package_dir.items() if "/" not in folder}


def renamed(source: BuildSource, folders: dict[str, str]) -> BuildSource:
    if source.module is None:
        return source
    top, dot, rest = source.module.partition(".")
    if top not in folders:
        return source
    return BuildSource(source.path, folders[top] + dot + rest, source.text, source.base_dir, source.followed)


def main(argv: list[str] | None = None) -> int:
    fscache = FileSystemCache()
    sources, options = process_options(sys.argv[1:] if argv is None else argv, fscache=fscache)
    folders = renames()
    sources = [renamed(s, folders) for s in sources]
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    messages: list[str] = []

    def flush_errors(filename: str | None, new_messages: list[str], serious: bool) -> None:
        messages.extend(new_messages)
        for line in new_messages:
            line = formatter.colorize(line) if options.color_output else line
            print(line, file=sys.stderr if serious else sys.stdout)

    blockers = False
    try:
        build.build(sources, options, None, flush_errors, fscache, sys.stdout, sys.stderr)
    except CompileError:
        blockers = True
    n_errors, n_notes, n_files = util.count_stats(messages)
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers,
                                     use_color=options.color_output))
    else:
        print(formatter.format_success(len(sources), options.color_output))
    return 0 if not messages or n_notes == len(messages) else 2 if blockers else 1


if __name__ == "__main__":
    sys.exit(main())
