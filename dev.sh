#!/usr/bin/env bash
# The project's one entry point. Each command sets up everything it needs on a fresh machine:
#   ./dev.sh demo    the main job on its embedded default (see README)
#   ./dev.sh test    the test suite (what CI runs first)
#   ./dev.sh slow    the tests marked slow: the fault soak, kills during training, long builds (CI runs them next)
# Set-up: a virtual environment in .venv (TIERED_VENV overrides), torch (the CPU build unless a
# torch is already importable there; TIERED_TORCH_SPEC overrides, e.g. for a CUDA build), then
# this project with its test extras, editable. Re-running is cheap: set-up is skipped when done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=${TIERED_VENV:-.venv}
PY="$VENV/bin/python"
# One cache for the native kernels, built once by setup() and reused by demo and test alike.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.tiered-setup"
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then return; fi
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" 2>/dev/null; then
    # The CPU build keeps CI fast; a GPU machine sets TIERED_TORCH_SPEC to its CUDA build.
    "$PY" -m pip install -q ${TIERED_TORCH_SPEC:-torch==2.13.0}
  fi
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
}

build_kernels() {
  # Cached after the first build (rebuilt when sources or torch change); a failed build is
  # reported here and the pure-torch reference runs, with a warning (tests cover that path).
  "$PY" -m tiered_ext.build --quiet || true
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo)
    setup
    build_kernels
    exec "$PY" -m tiered.cli.main demo "$@"
    ;;
  test)
    setup
    build_kernels
    # Cheapest first: lint, format, types, then the tests (the layer contracts are one of them).
    "$PY" -m ruff check --quiet . || { echo "ruff found problems (above)" >&2; exit 1; }
    "$PY" -m ruff format --check --quiet . || { echo "unformatted files (above): run ruff format ." >&2; exit 1; }
    "$PY" -m mypy || { echo "mypy found type errors (above)" >&2; exit 1; }
    # Default run: everything except tests marked slow; cuda tests skip (with a reason) off-GPU.
    exec "$PY" -m pytest -m "not slow" "$@"
    ;;
  slow)
    setup
    build_kernels
    # Minutes each: the 1,000-step fault soak and the kill -9 / SIGTERM runs resumed bit-exactly.
    exec "$PY" -m pytest -m slow "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | test [pytest args] | slow [pytest args]" >&2
    exit 2
    ;;
esac
