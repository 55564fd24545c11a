"""The shipped configs, installed as ``grpo_stream.configs`` (package data): found the same way from a checkout
and from an installed wheel."""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path


def shipped_config(name: str) -> Path:
    """The path of a shipped config, e.g. ``shipped_config("demo.yaml")`` or ``"paper/gsm8k-v1-i1.yaml"``."""
    with as_file(files(__name__).joinpath(name)) as path:  # a real file for a wheel install and a checkout alike
        return Path(path)
