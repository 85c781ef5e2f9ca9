"""Issue #26 item 4, the unit under the server test: :class:`GateScan`, Whisper's VAD gate a
bounded slice per scheduler step. Each advance scans at most its budget (summed over the inputs,
at least one detector window each), a short clip beside long inputs is decided in the first
advance, and every decision equals ``has_speech`` on the whole input."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("oasr_vad_silero")
pytest.importorskip("oasr_models_whisper")

SR = 16000


class Counting:
    """The default detector, counting the samples each call is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sample_rates = inner.sample_rates
        self.fed = 0

    def window_size(self, rate: int = SR) -> int:
        return self.inner.window_size(rate)

    def new_state(self, rate: int = SR):
        return self.inner.new_state(rate)

    def step(self, state, chunk, *, final=False):
        self.fed += len(chunk)
        return self.inner.step(state, chunk, final=final)

    def step_batch(self, states, chunks, *, final=False):
        self.fed += sum(len(c) for c in chunks)
        return self.inner.step_batch(states, chunks, final=final)

    def speech_probs(self, audio, rate: int = SR):
        return self.inner.speech_probs(audio, rate)

    def speech_probs_batch(self, audios, rate: int = SR):
        self.fed += sum(len(a) for a in audios)
        return self.inner.speech_probs_batch(audios, rate)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: Silero's window-by-window LSTM slows down a lot with two threads on a
    busy 2-core machine (as tests/whisper/test_speech_gate.py)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("whole_batch", [False, True], ids=["stepped", "whole_batch"])
def test_gate_scan_is_bounded_fair_and_exact(whole_batch: bool) -> None:
    """``whole_batch``: inputs scanned whole in one advance go through the stateless batched
    forward (what a GPU detector does), the rest through the stateful step."""
    from oasr.audio import load_audio
    from oasr.vad import default_detector
    from oasr_models_whisper.speech_gate import GateScan, has_speech
    from tests.server.test_realtime import FIRST

    clip = load_audio(str(FIRST), SR)
    rng = np.random.default_rng(0)
    noise = lambda s: (0.003 * rng.standard_normal(int(s * SR))).astype(np.float32)  # noqa: E731
    cases = {
        "short_speech": clip,
        "short_noise": noise(1.5),
        "long_noise_a": noise(60),
        "long_noise_b": noise(40),
        "speech_after_30s": np.concatenate([noise(30), clip]),
        "speech_then_silence": np.concatenate([clip, np.zeros(30 * SR, np.float32)]),
        "empty": np.zeros(0, np.float32),
    }
    det = Counting(default_detector())
    batched = []
    det.speech_probs_batch = lambda audios, rate=SR: batched.append(len(audios)) or (  # noqa: E731
        Counting.speech_probs_batch(det, audios, rate))
    want = {k: has_speech(a, det.inner) for k, a in cases.items()}
    assert want == {"short_speech": True, "short_noise": False, "long_noise_a": False, "long_noise_b": False,
                    "speech_after_30s": True, "speech_then_silence": True, "empty": False}  # fmt: skip

    budget = 15 * SR
    gate = GateScan(det, budget)
    gate._whole_batch = whole_batch
    for k, a in cases.items():
        gate.add(k, a)
    got: dict[str, bool] = {}
    rounds: dict[str, int] = {}
    n = 0
    while len(gate):
        det.fed = 0
        decided = gate.advance()
        n += 1
        assert det.fed <= budget + len(cases) * gate.window, det.fed  # the step's bound
        got.update(decided)
        rounds.update(dict.fromkeys(decided, n))
        if n == 1:
            gate.remove("long_noise_b")  # an abort between steps: dropped from the scan
    assert got == {k: v for k, v in want.items() if k != "long_noise_b"}
    assert bool(batched) == whole_batch  # the two short inputs went through one batched call
    # the short clip and the empty input are decided in the first step beside 130 s of others
    assert rounds["short_speech"] == rounds["short_noise"] == rounds["empty"] == 1
    assert rounds["speech_then_silence"] == 1  # speech found: the 30 s of silence not scanned
    assert rounds["long_noise_a"] >= 60 * SR // budget  # the long scan spread over steps


@pytest.mark.gpu
def test_gate_scan_on_cuda_equals_the_cpu_decisions() -> None:
    """On the device: a batch (32 inputs of up to 22 s, speech and noise) is decided in one
    advance of the CUDA default budget with one batched forward, as the former whole-batch
    gate; a budget of 60 s spreads it over steps through the stateful step. Decisions equal
    ``has_speech`` on the CPU."""
    import time

    import torch

    pytest.importorskip("silero_vad", reason="the default detector's weights come from silero-vad")

    from oasr.audio import load_audio
    from oasr.vad import default_detector
    from oasr_models_whisper.engine_adapter import GATE_SECONDS_CUDA
    from oasr_models_whisper.speech_gate import GateScan, has_speech
    from oasr_models_whisper.vad_longform import detector_for
    from tests.server.test_realtime import FIRST

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    clip = load_audio(str(FIRST), SR)
    rng = np.random.default_rng(0)
    inputs = []
    for k in range(32):
        pad = np.zeros(int(rng.integers(0, 20 * SR)), np.float32)
        noise = (0.003 * rng.standard_normal(len(pad) + len(clip))).astype(np.float32)
        inputs.append(np.concatenate([pad, clip]) if k % 3 == 0 else noise)
    want = [has_speech(a, default_detector()) for a in inputs]
    gpu = Counting(detector_for("cuda"))
    calls = []
    gpu.speech_probs_batch = lambda audios, rate=SR: calls.append(len(audios)) or (  # noqa: E731
        Counting.speech_probs_batch(gpu, audios, rate))
    for seconds in (GATE_SECONDS_CUDA, 60.0):
        gate = GateScan(gpu, int(seconds * SR))
        for k, a in enumerate(inputs):
            gate.add(k, a)
        got: dict = {}
        steps = 0
        t0 = time.perf_counter()
        while len(gate):
            got.update(gate.advance())
            steps += 1
        took = time.perf_counter() - t0
        print(f"budget {seconds:g} s: {steps} steps, {took * 1000:.1f} ms")
        assert [got[k] for k in range(32)] == want
        if seconds == GATE_SECONDS_CUDA:
            assert steps == 1 and calls == [32]
        else:
            assert steps > 1
