#!/usr/bin/env bash
# Everything CI checks: set-up (idempotent), lint, then the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
