"""``ops/setup.sh`` refuses to start on a disk without room, before it touches .venv or pip.

A CI run once died half-way through pip with ``OSError: [Errno 28] No space left on device``; the check turns that
into one line that names the directory, the space free and the space needed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_setup(min_free_gb: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GRPO_STREAM_MIN_FREE_GB": min_free_gb}
    return subprocess.run([str(REPO / "ops" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)


def test_setup_stops_with_the_space_needed_when_the_disk_is_too_full() -> None:
    venv_before = (REPO / ".venv" / "pyvenv.cfg").stat().st_mtime
    proc = run_setup("1000000")  # more than any disk here holds
    assert proc.returncode == 1
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"[setup] ERROR: {REPO} has ") and "GB free" in error
    assert "needs about 1000000 GB" in error and "GRPO_STREAM_MIN_FREE_GB" in error
    assert "installing" not in proc.stdout  # nothing was installed or fetched before the check
    assert (REPO / ".venv" / "pyvenv.cfg").stat().st_mtime == venv_before


def test_a_malformed_space_setting_is_refused_by_name() -> None:
    proc = run_setup("ten")
    assert proc.returncode == 1
    assert "GRPO_STREAM_MIN_FREE_GB must be a whole number of GB (got 'ten')" in proc.stderr
