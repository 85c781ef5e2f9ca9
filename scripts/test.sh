#!/usr/bin/env bash
# Everything CI checks: set-up (idempotent), lint, then the whole test suite on the CPU.
#   scripts/test.sh              # all of it (CI: .ci/run)
#   scripts/test.sh --fast       # the local loop: skips the tests marked `slow` (parity, WER,
#                                # benchmarks, real server processes)
#   scripts/test.sh tests/engine -x   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
marks=()
if [ "${1:-}" = "--fast" ]; then
    shift
    marks=(-m "not gpu and not slow")  # replaces pyproject's -m 'not gpu'
fi
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q ${marks[@]+"${marks[@]}"} "$@"
