"""The streaming API of ASREngine over StreamingScheduler, with a fake streaming model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from oasr.engine import ASREngine, ServiceModeError
from oasr.model import StreamingUpdate
from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Transcript,
)


@dataclass
class _State:
    samples_needed: int = 1600
    total: int = 0


class CountingModel:
    """Streams 0.1 s chunks; the hypothesis is the number of samples seen."""

    name = "counting"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC, streaming=True)
    feature_spec = FeatureSpec(kind="none")

    def transcribe(self, audios, options, progress=None):
        return [Transcript(text=f"whole {a.size}", language=None, duration=a.size / 16000) for a in audios]

    def new_stream(self, options):
        return _State()

    def stream_step(self, states, chunks, is_last):
        out = []
        for s, c, last in zip(states, chunks, is_last, strict=True):
            s.total += c.size
            t = Transcript(text=str(s.total), language=None, duration=s.total / 16000) if last else None
            out.append(StreamingUpdate(str(s.total), bool(last), t))
        return out


def test_streaming_api():
    eng = ASREngine(EngineConfig(service_mode="streaming", max_batch_size=4), model=CountingModel())
    a = eng.add_streaming_request()
    b = eng.add_streaming_request(DecodingOptions())
    eng.feed_chunk(a, np.zeros(3200, np.float32))
    eng.feed_chunk(b, np.zeros(1600, np.float32), is_last=True)
    outs = eng.step()
    assert {(o.request_id, o.is_final) for o in outs} == {(a, False), (b, True)}
    partial = [o for o in eng.step() if o.request_id == a]
    assert partial and partial[0].text == "3200" and not partial[0].is_final
    eng.feed_chunk(a, np.zeros(100, np.float32), is_last=True)
    finals = eng.run()
    assert finals[a].text == "3300"
    c = eng.add_streaming_request()
    assert eng.abort(c)
    outs = eng.transcribe_outputs([np.zeros(8000, np.float32)], streaming=True)
    assert outs[0].ok and outs[0].transcript.text == "8000"


def test_streaming_engine_also_takes_whole_utterances():
    """A streaming engine answers whole inputs with its model's offline ``transcribe`` through
    the request scheduler (the server's uploads in streaming mode)."""
    eng = ASREngine(EngineConfig(service_mode="streaming", max_batch_size=4), model=CountingModel())
    assert eng.submit(np.zeros(16000, np.float32)).result(timeout=10).text == "whole 16000"
    (out,) = eng.transcribe_outputs([np.zeros(800, np.float32)])
    assert out.ok and out.transcript.text == "whole 800"
    assert eng.transcribe_offline(np.zeros(320, np.float32)).text == "whole 320"
    eng.shutdown()


def test_transcribe_on_a_streaming_engine_streams_each_input():
    """``engine.transcribe([...])`` attaches each input as a stream, feeds it chunk by chunk
    through the streaming scheduler and returns the finals in input order (one in, one out)."""
    eng = ASREngine(EngineConfig(service_mode="streaming", max_batch_size=2), model=CountingModel())
    lengths = [4000, 1600, 8000]
    outs = eng.transcribe([np.zeros(n, np.float32) for n in lengths])
    assert [t.text for t in outs] == [str(n) for n in lengths]  # the streamed count, not "whole"
    one = eng.transcribe(np.zeros(2400, np.float32))
    assert one.text == "2400" and str(one) == "2400"
    assert not eng.streaming._streams  # every stream was released


def test_transcribe_on_an_offline_engine_is_transcribe_offline():
    eng = ASREngine(EngineConfig(max_batch_size=2), model=CountingModel())
    audio = np.zeros(1600, np.float32)
    assert eng.transcribe(audio).text == eng.transcribe_offline(audio).text == "whole 1600"
    assert [t.text for t in eng.transcribe([audio, audio[:800]])] == ["whole 1600", "whole 800"]
    with pytest.raises(ServiceModeError):
        eng.add_streaming_request()
