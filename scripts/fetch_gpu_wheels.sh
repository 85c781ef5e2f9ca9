#!/usr/bin/env bash
# Download, on a machine with a package index, the Python 3.12 wheels that the GPU machine (no
# index; torch, transformers, CuPy already there) needs for `scripts/gpu_check.sh`: PyAV 19,
# soundfile + cffi, the server's web and gRPC stack, the test references. Into .whl/ (keep it out
# of git: `echo /.whl/ >> .git/info/exclude`), then carry it: the device tool's `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl)
"${PIP[@]}" 'av==19.*' soundfile==0.14.0 cffi pycparser fastapi==0.165.0 starlette==1.10.0 \
    uvicorn==0.54.0 websockets==17.4 python-multipart==0.0.34 pydantic pydantic-core annotated-types \
    typing-inspection grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    kaldi-native-fbank==1.23.0 more-itertools==11.2.1 zipformer==0.1.3
# FunASR (the Paraformer reference) and the modules its AutoModel imports for Paraformer; jinja2
# renders Qwen2-Audio chat templates where the machine lacks it
"${PIP[@]}" funasr==1.4.16 omegaconf==2.4.0 kaldiio==2.18.1 librosa==0.11.0 lazy_loader==0.6 \
    six==1.17.0 rapidfuzz==3.14.6 jinja2==3.1.6 markupsafe==3.0.2
# with librosa importable, transformers' audio_utils imports soxr (librosa's resampler) at once
"${PIP[@]}" soxr==1.0.0 decorator==5.2.1 joblib==1.6.0 audioread==3.1.0 msgpack==1.2.4 pooch==1.9.0 \
    platformdirs==4.14.9
# fastapi imports its telemetry hooks (opentelemetry-api) and annotated-doc at import
"${PIP[@]}" opentelemetry-api==1.45.2 annotated-doc importlib-metadata zipp
# tests/wfst and benchmarks/wfstbench: kaldifst builds the graphs, kaldi-decoder is the reference
"${PIP[@]}" kaldifst==1.8.3 kaldi-decoder==0.3.2
# the pocketsphinx wheel (29 MB) carries the US English trigram LM of the realistic WFST graph (the
# same file as Debian's pocketsphinx-en-us; 5.0.4 is the newest with a cp312 wheel). It goes to
# .whl-lm/: with PyAV, .whl/ and the tree already come close to the device tool's 64 MiB carry, so
# a call carries one or the other (gpu_check.sh installs every .whl*/ folder it is given)
mkdir -p .whl-lm
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl-lm pocketsphinx==5.0.4
# openai-whisper is published as a source archive only: build its wheel here
python3 -m pip wheel -q --no-deps openai-whisper==20250625 -w .whl
du -sh .whl .whl-lm
