#!/usr/bin/env bash
# The project's one entry point. Each command sets up everything it needs on a fresh machine:
#   ./dev.sh demo    the main job on its embedded default (see README)
#   ./dev.sh test    the test suite (what CI runs first)
#   ./dev.sh slow    the tests marked slow: the fault soak, kills during training, long builds (CI runs them next)
# Set-up: a virtual environment in .venv (TIERED_VENV overrides), torch (the CPU build unless a
# torch is already importable there; TIERED_TORCH_SPEC overrides, e.g. for a CUDA build), then
# this project with its test extras, editable, then the native kernels (`tiered build-ext`, into
# the environment's own kernel cache, where every later run finds them: no run builds them in its
# first step). Re-running is cheap: set-up is skipped when done. Each part says how long it took.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=${TIERED_VENV:-.venv}
PY="$VENV/bin/python"

now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }

setup() {
  local t0
  t0=$(now)
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.tiered-setup"
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then return; fi
  echo "dev.sh: installing torch and tiered into $VENV (once)" >&2
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" 2>/dev/null; then
    # The CPU build keeps CI fast; a GPU machine sets TIERED_TORCH_SPEC to its CUDA build.
    "$PY" -m pip install -q ${TIERED_TORCH_SPEC:-torch==2.13.0}
  fi
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
  echo "dev.sh: set-up: install $(took "$t0") s" >&2
}

build_kernels() {
  # Cached per environment after the first build (rebuilt when sources, torch or the compiler
  # change; tiered_ext/_cache.py); a failed build is reported here and the pure-torch reference
  # runs, with a warning (tests cover that path).
  local t0
  t0=$(now)
  "$PY" -m tiered.cli.main build-ext || true
  echo "dev.sh: set-up: kernel build (or cache check) $(took "$t0") s" >&2
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo)
    setup
    build_kernels
    t0=$(now)
    status=0
    "$PY" -m tiered.cli.main demo "$@" || status=$?
    echo "dev.sh: demo $(took "$t0") s" >&2
    exit "$status"
    ;;
  test)
    setup
    build_kernels
    # Cheapest first: lint, format, types, then the tests (the layer contracts are one of them).
    "$PY" -m ruff check --quiet . || { echo "ruff found problems (above)" >&2; exit 1; }
    "$PY" -m ruff format --check --quiet . || { echo "unformatted files (above): run ruff format ." >&2; exit 1; }
    "$PY" -m mypy || { echo "mypy found type errors (above)" >&2; exit 1; }
    # Default run: everything except tests marked slow; cuda tests skip (with a reason) off-GPU.
    # --durations: the slowest tests named in every run, so the 15-minute budget can be kept
    exec "$PY" -m pytest -m "not slow" --durations=25 "$@"
    ;;
  slow)
    setup
    build_kernels
    # Minutes each: the 1,000-step fault soak and the kill -9 / SIGTERM runs resumed bit-exactly.
    exec "$PY" -m pytest -m slow --durations=15 "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | test [pytest args] | slow [pytest args]" >&2
    exit 2
    ;;
esac
