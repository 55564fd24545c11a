"""grpo-stream installs as a wheel (not editable) and works from anywhere, beside PyPI's ``verifiers``.

The wheel is built from this checkout and installed into a fresh virtual environment whose dependencies come from
the project's own venv (added to its path, not installed again). Everything then runs from a directory outside the
checkout, so nothing can be found through the source tree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from grpo_stream.broker import free_port

REPO = Path(__file__).resolve().parents[1]
VERIFIERS_WHEEL = "verifiers-0.4.0-py3-none-any.whl"  # PyPI's RL environments library (ops/setup.sh fetches it)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(venv, a working directory outside the checkout) with our wheel and PyPI's verifiers installed."""
    base = tmp_path_factory.mktemp("wheel")
    dist, src = base / "dist", base / "src"
    # Built from a copy: setuptools leaves a build/ directory in the tree it builds.
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "build", "*.egg-info",
                                                             "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, cwd=base)
    (wheel,) = dist.glob("grpo_stream-*.whl")
    theirs = REPO / ".cache" / "wheels" / VERIFIERS_WHEEL
    assert theirs.is_file(), f"{theirs} is missing: run ./ops/setup.sh --ops (it downloads verifiers==0.4.0)"
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel), str(theirs)], check=True)
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=True, capture_output=True,
                          text=True).stdout.strip()
    # The dependencies (torch, kafka-python, ...) from our venv, behind the new venv's own packages. A .pth line
    # only adds the path: the editable install's finder in that directory is not activated.
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = base / "elsewhere"
    work.mkdir()
    return venv, work


def _run(venv: Path, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "grpo-stream"), *args], cwd=work, capture_output=True, text=True,
                          timeout=120)


def test_the_wheel_carries_every_package_and_the_shipped_configs(installed: tuple[Path, Path]) -> None:
    (wheel,) = (installed[0].parent / "dist").glob("grpo_stream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("grpo_stream-")}
    assert tops == {"grpo_core", "grpo_producers", "grpo_verifiers", "grpo_learner", "grpo_stream"}
    assert "grpo_stream/configs/demo.yaml" in names and "grpo_stream/configs/pipeline.yaml" in names
    assert "grpo_stream/configs/paper/gsm8k-v10-i1.yaml" in names


def test_config_explain_runs_from_the_installed_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    out = _run(venv, work, "config", "explain", "learner")
    assert out.returncode == 0, out.stderr
    assert "pipeline.group_size = 16" in out.stdout and "publish_every = 1" in out.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import grpo_stream, grpo_learner, grpo_stream.configs as c; "
                            "print(grpo_stream.__file__); print(grpo_learner.__file__); "
                            "print(c.shipped_config('demo.yaml'))"],
                           cwd=work, check=True, capture_output=True, text=True).stdout.split()
    assert all(str(venv) in line for line in where), f"imported from outside the venv: {where}"


def test_kafka_up_and_down_from_the_installed_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    port, data = free_port(), work / "kafka-data"
    jars = str(REPO / ".cache" / "kafka" / "libs")  # the jar directory is an explicit option
    up = _run(venv, work, "kafka", "up", "--port", str(port), "--controller-port", str(free_port()),
              "--data-dir", str(data), "--jars", jars)
    try:
        assert up.returncode == 0, up.stderr
        status = json.loads(_run(venv, work, "kafka", "status", "--data-dir", str(data), "--jars", jars).stdout)
        assert status["running"] and status["bootstrap"] == f"127.0.0.1:{port}"
    finally:
        down = _run(venv, work, "kafka", "down", "--data-dir", str(data))
    assert down.returncode == 0 and "kafka stopped" in down.stdout
    missing = _run(venv, work, "kafka", "up", "--port", str(free_port()), "--data-dir", str(work / "d2"))
    assert missing.returncode == 2 and "jars are missing" in missing.stderr  # no checkout to find them in


def test_pypi_verifiers_installs_beside_ours(installed: tuple[Path, Path]) -> None:
    """Our verifier service is grpo_verifiers; the name ``verifiers`` stays PyPI's library's."""
    venv, work = installed
    probe = ("import importlib.util, grpo_verifiers.service; "
             "spec = importlib.util.find_spec('verifiers'); "
             "print(spec.origin); print(grpo_verifiers.service.__file__)")
    theirs, ours = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=work, check=True,
                                  capture_output=True, text=True).stdout.split()
    assert Path(theirs).parent.name == "verifiers" and str(venv) in theirs
    assert Path(ours).parent.name == "grpo_verifiers"
    assert "grpo" not in Path(theirs).read_text()  # PyPI's package, not ours under its name
    records = {}
    for dist in Path(theirs).parents[1].glob("*.dist-info"):
        records[dist.name.split("-")[0]] = {line.split(",")[0] for line in (dist / "RECORD").read_text().splitlines()
                                            if not line.startswith(dist.name)}
    assert records["verifiers"].isdisjoint(records["grpo_stream"]), "the two distributions share files"
