"""``ops/gpu-check.sh --smoke``: the GPU check's code path on CPU, started the way the GPU machine starts it (the
script's own path set-up, not the installed package) and without the packages that machine lacks."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_stream.bench import gpu_check
from grpo_stream.tiny_model import param_count

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["device", "model", "learner config", "generation", "generation tokens/s", "generation peak memory",
          "ratio |r-1| mean", "ratio |r-1| max", "ratio control (1-token shift)", "train batch", "imports", "wall time",
          "preset tiny step", "saving snapshot", "saving step alone", "saving step async publish",
          "saving step sync publish",
          *(f"i={i} {what}" for i in (1, 10) for what in ("step time", "split", "tokens/s", "peak memory", "MFU"))]
CHECKS = ["generation", "on-policy ratio", "ratio control", "i=1 train steps", "i=10 train steps", "imports", "time",
          "preset tiny train steps"]
# Not installed on the GPU machine (kafka-python is, as a carried wheel; here the venv's copy stands in for it).
BLOCKER = """import sys
ABSENT = {"lz4", "crc32c", "math_verify", "datasets", "vllm"}
class Absent:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, Absent)
"""


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_the_smoke_mode_prints_every_field_and_passes_its_checks(tmp_path: Path) -> None:
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_SMOKE": "1", "TMPDIR": str(tmp_path),
           "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), "PYTHONPATH": str(tmp_path / "blocker")}
    command = [str(ROOT / "ops" / "gpu-check.sh"), "--peak-tflops", "1", "--json", str(tmp_path / "gc.json")]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    table = out.stdout.split("== GPU check ==\n", 1)[1]
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in table.splitlines()
            if "  " in line and not line.startswith(("PASS", "FAIL"))}
    assert set(FIELDS) <= set(rows), sorted(set(FIELDS) - set(rows))
    for name in CHECKS:
        assert f"PASS  {name}: " in table
    assert "FAIL" not in table and "\ngpu-check: PASS (8/8 checks passed)\n" in table
    assert re.search(r"\ngpu-check: \d+ s in all \(set-up and imports included\)\n$", table)
    # The services came from the script's links in its temporary directory, not from the editable install.
    assert f"grpo_learner {tmp_path}/gpu-check-site." in rows["imports"]
    assert f"grpo_producers {tmp_path}/gpu-check-site." in rows["imports"]
    assert re.match(r"\d+\.\d%: .* over 1 TFLOP/s \(--peak-tflops\)$", rows["i=10 MFU"]), rows["i=10 MFU"]
    data = json.loads((tmp_path / "gc.json").read_text())
    assert data["ratio"]["mean_abs"] < gpu_check.RATIO_BOUND < data["ratio"]["control_mean_abs"]
    assert data["i=10"]["tokens_completion"] == 4 * 4 * 16 and data["i=10"]["mfu"] > 0
    # bench throughput's learner side: 2 prompts x G 8 with drawn lengths (each in [1, 512]) on the tiny preset
    tiny = data["presets"]["tiny"]
    assert 16 <= tiny["completion_tokens"] <= 16 * 512 and tiny["step_s"] > 0
    assert tiny["params"] == param_count("tiny")
    # the saving section: a measurement (no check), every figure a positive number, every publish written
    saving = data["saving"]
    assert saving["publish_dtype"] == "bfloat16" and saving["i"] == 1 and not saving["snapshot"]["pinned"]
    with torch.device("meta"):  # the smoke model's parameters, the tied embedding once, as the snapshot has them
        model = Qwen2ForCausalLM(Qwen2Config(**gpu_check.SMOKE_SHAPE, tie_word_embeddings=True))
    assert saving["snapshot"]["bytes"] == 2 * sum(p.numel() for p in model.parameters())  # bf16
    figures = [saving["snapshot"][k] for k in ("s", "first_s", "gb_per_s")] + [saving["alone"]["step_s"]]
    for mode in ("async", "sync"):
        m = saving[mode]
        assert m["publishes"] == saving["warmup"] + m["steps"]  # every version written
        assert m["bytes"] > saving["snapshot"]["bytes"]  # the weights and the safetensors header
        figures += [m[k] for k in ("step_s", "ratio", "loop_s", "write_s")]
        assert m["wait_s"] >= 0 and math.isfinite(m["wait_s"])
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert "GB/s" in rows["saving snapshot"] and "x alone" in rows["saving step async publish"]
    assert not list(tmp_path.glob("gpu-check-saving-*")), "the saving section leaves its stores behind"
    assert not list(tmp_path.glob("gpu-check-site.*")), "the script leaves its temporary directory behind"


def test_model_flops_count_the_body_on_every_token_and_the_head_on_completions() -> None:
    # 10 parameters of which 4 are the (tied) embedding; i = 10 grad steps (3 passes each) + 1 no-grad forward.
    assert gpu_check.step_flops(10, 4, 100, 50, 10, 1) == 31 * (2 * 6 * 100 + 2 * 4 * 50)
    assert gpu_check.bf16_peak("cpu", None)[0] is None
    assert gpu_check.bf16_peak("cpu", 2.0)[0] == pytest.approx(2e12)


def test_a_failing_section_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["--smoke", "--paper-config", str(tmp_path / "missing.yaml")]) == 1
    out = capsys.readouterr().out
    assert "FAIL  set-up: ConfigError" in out and "gpu-check: FAIL" in out
