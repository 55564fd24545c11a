#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. The tests' session fixture starts a real Kafka broker on free
# loopback ports in a temporary directory, unless KAFKA_BOOTSTRAP points at an external cluster.
# Extra arguments go to pytest, e.g. ./ops/test.sh -k wire
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./ops/setup.sh --ops  # what running needs, plus the dev extras and the ops tests' validators
TMP="$ROOT/.cache/pytest-tmp"
# Whatever happens to pytest (failure, Ctrl-C, a timeout), no test broker outlives this script.
cleanup() { pkill -TERM -f "kafka.Kafka .*$TMP" 2>/dev/null || true; sleep 1; pkill -KILL -f "kafka.Kafka .*$TMP" 2>/dev/null || true; }
trap cleanup EXIT
.venv/bin/ruff check .
# The import contract (pyproject.toml [tool.importlinter]): the layers, the Kafka seam, a torch-free verifier.
.venv/bin/lint-imports
set +e
.venv/bin/python -m pytest --basetemp="$TMP" -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
