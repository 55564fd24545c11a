#!/usr/bin/env bash
# Set up (idempotent) and run the end-to-end demo. Arguments go to `grpo-stream demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./ops/setup.sh
exec .venv/bin/grpo-stream demo "$@"
