"""``ASREngine`` with decode processes and a continuous executor: each input is queued into the
scheduler as the decode pool returns it (``ASREngine._stream_requests``), with the transcripts,
errors and order of decoding everything first."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oasr.audio import load_audio
from oasr.engine import ASREngine
from oasr.errors import AudioTooLongError, BadAudioError
from oasr.scheduler import BatchExecutor, Request
from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Transcript,
)

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
CLIPS = ["en_ls_2830-3980-0043.wav", "en_fleurs_000.ogg", "en_ls_1272-141231-0002.mp3",
         "en_ljspeech_LJ002-0020.wav"]  # fmt: skip


class EchoExecutor:
    """A continuous executor (not the batch executor): every admitted request finishes in the
    next step with its sample count and first sample as its text."""

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.held: list[Request] = []
        self.admitted_groups: list[int] = []

    @property
    def num_running(self) -> int:
        return len(self.held)

    def try_admit(self, request: Request) -> bool:
        if len(self.held) >= self.max_batch_size:
            return False
        self.held.append(request)
        return True

    def abort(self, request: Request) -> bool:
        if request in self.held:
            self.held.remove(request)
            return True
        return False

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        done, self.held = self.held, []
        if done:
            self.admitted_groups.append(len(done))
        return [(r, Transcript(text=f"{r.num_samples} {r.audio[0]:.6f}", language="en",
                               duration=r.num_samples / 16000)) for r in done]  # fmt: skip


class EchoModel:
    name = "echo"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
    feature_spec = FeatureSpec(kind="none", sample_rate=16000)

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: Any = None) -> list[Transcript]:  # fmt: skip
        raise AssertionError("the continuous executor runs every request")

    def make_executor(self, config: Any) -> EchoExecutor:
        return EchoExecutor(config.max_batch_size)


def _engine(processes: int, **kw: Any) -> ASREngine:
    return ASREngine(EngineConfig(decode_processes=processes, max_batch_size=4, **kw), model=EchoModel())


def _inputs() -> list[Any]:
    paths = [SPEECH / n for n in CLIPS]
    return [*paths, paths[1].read_bytes(), io.BytesIO(paths[2].read_bytes()),
            np.linspace(-0.5, 0.5, 8000, dtype=np.float32), b"not audio" * 30, *paths]  # fmt: skip


def _summary(outs: list[Any]) -> list[str]:
    return [o.transcript.text if o.ok else f"{type(o.error).__name__}: {o.error}" for o in outs]


def test_streamed_outputs_equal_decoding_first() -> None:
    serial, pooled = _engine(0), _engine(2)
    try:
        assert not isinstance(pooled.scheduler.executor, BatchExecutor)
        calls: list[Any] = []
        real = pooled._stream_requests
        pooled._stream_requests = lambda *a: calls.append(r := real(*a)) or r  # type: ignore[method-assign]
        want, got = serial.transcribe_outputs(_inputs()), pooled.transcribe_outputs(_inputs())
        assert calls and calls[0] is not None  # the pool streamed into the scheduler
        assert _summary(got) == _summary(want)
        assert isinstance(got[7].error, BadAudioError) and sum(not o.ok for o in got) == 1
        # more than one admission group: the executor's batch (4) is smaller than the inputs
        assert sum(pooled.scheduler.executor.admitted_groups) == len(_inputs()) - 1
        texts = [t.text for t in pooled.transcribe_offline(_inputs()[:7])]
        assert texts == _summary(want)[:7]
        with pytest.raises(BadAudioError):  # the first failing input raises, as decoding first
            pooled.transcribe_offline(_inputs())
    finally:
        serial.shutdown()
        pooled.shutdown()


def test_streamed_too_long_input_fails_alone() -> None:
    eng = _engine(2, max_audio_seconds=2.5)
    try:
        outs = eng.transcribe_outputs([SPEECH / CLIPS[0], SPEECH / CLIPS[1], SPEECH / CLIPS[3]])
    finally:
        eng.shutdown()
    assert outs[0].ok and outs[2].ok and isinstance(outs[1].error, AudioTooLongError)


@pytest.mark.slow
def test_whisper_texts_equal_with_decode_processes() -> None:
    """Real tiny.en on the CPU (the continuous executor): the streamed pool gives the
    transcripts of decoding in the caller."""
    pytest.importorskip("oasr_models_whisper")
    from oasr.defaults import default_checkpoint

    try:
        ckpt = str(default_checkpoint())
    except Exception as exc:  # noqa: BLE001 - no default model on this machine
        pytest.skip(f"default model unavailable: {exc}")
    options = DecodingOptions.build(beam_size=1, temperature=0.0, vad_gate=False)
    files = [SPEECH / CLIPS[3], SPEECH / CLIPS[0], SPEECH / CLIPS[3]]  # 1.5 s, 2.0 s, 1.5 s
    eng = ASREngine(EngineConfig(ckpt_dir=ckpt, num_threads=1, decode_processes=2))
    try:
        arrays = [load_audio(f, 16000) for f in files]
        want = [t.text for t in eng.transcribe_arrays(arrays, options)]  # decoded first
        got = [t.text for t in eng.transcribe_offline(files, options)]  # streamed
        assert eng._decode_pool is not None
    finally:
        eng.shutdown()
    assert got == want and all(want)
