#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. The tests' session fixture starts a real Kafka broker on free
# loopback ports in a temporary directory, unless KAFKA_BOOTSTRAP points at an external cluster.
# Extra arguments go to pytest, e.g. ./ops/test.sh -k wire; --fast is the fast lane (-m "not slow", under 5 min).
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
# Its banner and report only when a contract breaks; otherwise the one summary line.
if out="$(.venv/bin/lint-imports 2>&1)"; then echo "$out" | tail -n 1; else echo "$out"; exit 1; fi
# mypy: strict on the core and the services, basic on the application ([tool.mypy] in pyproject.toml).
.venv/bin/python ops/typecheck.py
# The docs: the configuration reference matches the typed configs, and the site builds with no broken link.
.venv/bin/grpo-stream config reference --check
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "$ROOT/.cache/site"
set +e
args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
.venv/bin/python -m pytest --basetemp="$TMP" -p no:cacheprovider "${args[@]}"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
