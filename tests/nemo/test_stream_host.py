"""The host side of a Nemotron stream's audio (``oasr_models_nemo.streaming``): what a step hands
over is held by reference (``_accept``), copied once into the step's row (``_copy_span``) and
only the rest kept (``_settle``); against the plain concatenation of everything received."""

from __future__ import annotations

import numpy as np

from oasr_models_nemo.streaming import NemotronStreamState, _accept, _copy_span, _settle


def test_spans_and_settling_equal_the_concatenated_audio() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        st = NemotronStreamState(options=None, lookahead=2, search=None, hop=160, n_fft=512,
                                 window_extra=96, subsampling=8, buf=np.zeros(257, np.float32), fill=257)
        ref = np.zeros(257, np.float32)  # everything kept so far, as one array
        received = 0
        for _ in range(int(rng.integers(1, 6))):
            for _ in range(int(rng.integers(0, 4))):  # pieces of one step, some empty
                a = rng.standard_normal(int(rng.choice([0, 1, 7, 160, 1500]))).astype(np.float32)
                _accept(st, a)
                ref = np.concatenate([ref, a])
                received += a.size
            assert st.samples_received == received
            assert np.array_equal(st.audio, ref)
            for _ in range(3):  # any span, also past the end (fewer samples)
                start = int(rng.integers(0, ref.size + 5))
                stop = start + int(rng.integers(0, ref.size + 5))
                out = np.full(stop - start + 3, np.nan, np.float32)
                n = _copy_span(st, start, stop, out)
                assert n == max(0, min(stop, ref.size) - start)
                assert np.array_equal(out[:n], ref[start: start + n]) and np.isnan(out[n:]).all()
            drop = int(rng.integers(0, ref.size + 1))
            _settle(st, drop)
            ref = ref[drop:]
            assert not st.pending and st.fill == ref.size and np.array_equal(st.buf[: st.fill], ref)


def test_any_lookahead_fits_the_ring_when_none_is_declared(hf_checkpoints, waves) -> None:
    """A model that names no trained lookaheads streams with any lookahead up to its left
    context (the ring holds the history and a chunk of up to that many frames): its frames wrap
    around the ring many times and the result equals offline decoding; more is refused."""
    import dataclasses

    import pytest

    from oasr.errors import InvalidRequestError
    from oasr.types import DecodingOptions
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    model.config = dataclasses.replace(model.config, lookaheads=())
    left = model.config.att_context[0]
    assert model.stream_runtime.ring == 2 * left
    opts = DecodingOptions(model_options={"lookahead": left - 1})
    st = model.new_stream(opts)
    wave = waves[0]
    ups = model.stream_step([st], [wave], [True])  # all at once: several chunks in one step
    assert ups[0].text and ups[0].text == model.transcribe([wave], opts)[0].text
    with pytest.raises(InvalidRequestError, match="lookahead"):
        model.new_stream(DecodingOptions(model_options={"lookahead": left}))


def test_the_collector_is_paused_during_a_step_and_restored(hf_checkpoints, waves) -> None:
    """The cyclic garbage collector is off while a step runs (its transient per-stream objects
    die by reference counting first) and as it was afterwards: on again, or left off when the
    caller had it off; also when the step raises."""
    import gc

    import pytest

    from oasr.errors import InvalidRequestError
    from oasr.types import DecodingOptions
    from oasr_models_nemo.model import NemoASR

    seen: list[bool] = []

    class Probe:  # a StepProfile's interface, recording the collector's state at each lap
        steps = rows = calls = 0

        def start(self) -> None:
            seen.append(gc.isenabled())

        def lap(self, phase: str) -> None:
            seen.append(gc.isenabled())

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    model.stream_profile = Probe()
    st = model.new_stream(DecodingOptions())
    assert gc.isenabled()
    model.stream_step([st], [waves[1][:8000]], [False])
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        model.stream_step([st], [waves[1][8000:]], [True])
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(InvalidRequestError, match="finished"):
        model.stream_step([st], [waves[1][:100]], [False])
    assert gc.isenabled()
    model.stream_runtime.defer_gc = False
    seen.clear()
    model.stream_step([model.new_stream(DecodingOptions())], [waves[1][:8000]], [True])
    assert all(seen)


def test_a_failed_step_changes_no_stream_and_keeps_no_reference(hf_checkpoints, waves, monkeypatch) -> None:
    """A step with a finished stream (or a bad chunk) in its batch fails before any stream
    changes; audio a step was handed before it failed later (here: the encoder raising) is
    copied into the stream's buffer, so the caller may reuse its array."""
    import numpy as np
    import pytest

    from oasr.errors import InvalidRequestError
    from oasr.types import DecodingOptions
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    done = model.new_stream(DecodingOptions())
    model.stream_step([done], [waves[2][:100]], [True])
    st = model.new_stream(DecodingOptions())
    wave = waves[1]
    with pytest.raises(InvalidRequestError, match="finished"):
        model.stream_step([st, done], [wave[:9000], None], [False, False])
    with pytest.raises(Exception):  # noqa: B017, PT011 - as_mono_waveform's error for a 3-D chunk
        model.stream_step([st, model.new_stream(DecodingOptions())], [wave[:9000], np.zeros((2, 2, 2))],
                          [False, False])
    assert st.samples_received == 0 and not st.pending and st.chunks == 0
    rt = model.stream_runtime

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("device lost")

    monkeypatch.setattr(rt, "compute", broken)
    mine = wave[:9000].copy()
    with pytest.raises(RuntimeError, match="device lost"):
        model.stream_step([st], [mine], [False])
    assert not st.pending and np.array_equal(st.audio[-9000:], wave[:9000])
    mine[:] = 0.0  # the caller reuses its buffer: the stream's copy stays
    assert np.array_equal(st.audio[-9000:], wave[:9000])
