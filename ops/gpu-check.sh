#!/usr/bin/env bash
# The GPU check (issue #12, section 4; grpo_stream/bench/gpu_check.py): the learner's train step on CUDA in bf16
# (i = 1 and i = 10, Qwen2.5-0.5B's shape with random weights, 28 groups x G = 16 x 200-token completions), the HF
# backend generating on CUDA, the on-policy ratio check, and `bench throughput`'s learner side: one learner step
# per model preset (tiny, 50m, qwen2.5-0.5b) on its batch shape (grpo_stream/bench/gpu_presets.py); and what a
# publish at every step (v = 1) costs the learner's step loop: the device-to-host snapshot into pinned buffers (s,
# GB/s) and the i = 1 step alone, with asynchronous publishing and with the step loop writing, to an fs store in a
# temporary directory, not announced (grpo_stream/bench/gpu_saving.py). Prints a summary table; exits non-zero
# when a check fails (the saving figures have no threshold). Under 5 minutes on an H200.
#
#   ./ops/gpu-check.sh [--json FILE] [--peak-tflops N]    on a GPU machine, from anywhere
#   ./ops/gpu-check.sh --smoke                             the same code on CPU with a tiny model (seconds)
#   GPU_CHECK_SMOKE=1 ./ops/gpu-check.sh                   the same as --smoke
#
# What the machine needs: Python >= 3.11 (GPU_CHECK_PYTHON, default python3) with torch, transformers, tokenizers,
# safetensors, numpy, msgpack, pyyaml and prometheus-client (the learner's metrics) -- and kafka-python, although nothing here talks to a broker: the learner's
# config imports grpo_core.weights.config, whose package __init__ imports grpo_core.kafka_io, which imports kafka
# at module level (grpo_learner.trainer -> grpo_learner.config -> grpo_core.weights -> grpo_core.kafka_io -> kafka).
# Not needed: vLLM, Java, Kafka, datasets, math-verify; lz4 and crc32c (kafka-python imports them only if present).
# Nothing is pip-installed: the services' folders are linked under their import names (grpo_learner -> learner/,
# ...) in a temporary directory put on PYTHONPATH with the checkout.
#
# Carrying what is missing (no network there): put wheels in .cache/gpu-check/wheels/ (or $GPU_CHECK_WHEELS) and
# bring that folder along; pure-Python wheels are unpacked into the temporary directory, nothing is installed.
# kafka-python is the only one needed (pure Python, 0.6 MB):
#   .venv/bin/pip download --no-deps --only-binary=:all: -d .cache/gpu-check/wheels kafka-python==3.0.12
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${GPU_CHECK_PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.cache/gpu-check/wheels}"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT

ln -s "$ROOT/learner" "$SITE/grpo_learner"
ln -s "$ROOT/producers" "$SITE/grpo_producers"
ln -s "$ROOT/verifiers" "$SITE/grpo_verifiers"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
    print(f"gpu-check: unpacked {w}", file=sys.stderr)' "$SITE" "${wheels[@]}"
fi
# The temporary directory first: its links must win over an installed grpo-stream (a venv's editable install).
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

missing="$("$PY" -c 'import importlib.util as u
def absent(name):
    try:
        return u.find_spec(name) is None
    except ImportError:
        return True
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "msgpack", "yaml", "prometheus_client",
        "kafka"]
print(" ".join(n for n in need if absent(n)))')"
if [ -n "$missing" ]; then
  echo "gpu-check: $PY lacks: $missing (kafka = kafka-python; see this script's header for carrying wheels)" >&2
  exit 2
fi

args=()
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then args+=(--smoke); fi
cd "$ROOT"
set +e
"$PY" -m grpo_stream.bench.gpu_check --paper-config "$ROOT/configs/paper/gsm8k-v1-i1.yaml" \
  --bench-config "$ROOT/configs/bench-throughput.yaml" "${args[@]}" "$@"
rc=$?
set -e
echo "gpu-check: ${SECONDS} s in all (set-up and imports included)"
exit "$rc"
