"""SileroVAD (rebuilt on oasr.layers) against the silero-vad package's own TorchScript model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _vad_helpers import FILE_8K, FILES_16K, TOL, read

from oasr.errors import CheckpointError, InvalidRequestError

ALL = [*FILES_16K, FILE_8K]


def _chunked(vad, x: np.ndarray, sr: int, sizes: list[int]) -> np.ndarray:
    state = vad.new_state(sr)
    out, i, k = [], 0, 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        out.append(vad.step(state, x[i : i + n]))
        i, k = i + n, k + 1
    out.append(vad.step(state, x[:0], final=True))
    assert state.finished and state.samples == len(x)
    return np.concatenate(out)


@pytest.mark.parametrize("name", ALL)
def test_offline_matches_jit(vad, ref_probs, name):
    x, sr, ref = ref_probs(name)
    probs = vad.speech_probs(x, sr)
    assert probs.dtype == np.float32 and probs.shape == ref.shape
    assert len(ref) == -(-len(x) // vad.window_size(sr))
    assert np.abs(probs - ref).max() < TOL
    assert ref.max() > 0.9 and ref.min() < 0.1  # real speech and real silence in the clip


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(
    "sizes", [[512], [256], [1, 7, 1000, 3333, 160], [16000], [511, 513]], ids=str
)
def test_streaming_matches_jit(vad, ref_probs, name, sizes):
    x, sr, ref = ref_probs(name)
    probs = _chunked(vad, x, sr, sizes)
    assert probs.shape == ref.shape
    assert np.abs(probs - ref).max() < TOL


def test_offline_batch_matches_jit(vad, ref_probs):
    items = [ref_probs(n) for n in FILES_16K]
    xs = [items[0][0], items[1][0], items[0][0][:1234]]
    refs = [items[0][2], items[1][2], None]
    out = vad.speech_probs_batch(xs, 16000)
    assert [len(o) for o in out] == [-(-len(x) // 512) for x in xs]
    for o, r in zip(out[:2], refs[:2], strict=False):
        assert np.abs(o - r).max() < TOL
    alone = vad.speech_probs(xs[2], 16000)
    assert np.abs(out[2] - alone).max() < 1e-5


def test_step_batch_many_streams_mixed_rates(vad, ref_probs):
    """Streams of both rates and uneven chunks advanced together, one forward per rate."""
    names = [*FILES_16K, FILE_8K, FILES_16K[0]]
    data = [ref_probs(n) for n in names]
    states = [vad.new_state(sr) for _, sr, _ in data]
    rng = np.random.default_rng(0)
    pos = [0] * len(data)
    outs: list[list[np.ndarray]] = [[] for _ in data]
    while any(p < len(d[0]) for p, d in zip(pos, data, strict=False)):
        chunks = []
        for i, (x, _, _) in enumerate(data):
            n = int(rng.integers(0, 4000))
            chunks.append(x[pos[i] : pos[i] + n])
            pos[i] += n
        for i, p in enumerate(vad.step_batch(states, chunks)):
            outs[i].append(p)
    finals = vad.step_batch(states, [x[:0] for x, _, _ in data], final=True)
    for i, (_, _, ref) in enumerate(data):
        got = np.concatenate([*outs[i], finals[i]])
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() < TOL


def test_state_is_per_stream_and_resettable(vad):
    x, sr = read(FILES_16K[0])
    a = vad.new_state(sr)
    b = vad.new_state(sr)
    pa = vad.step(a, x[:8000])
    vad.step(b, x[8000:16000])  # another stream in between must not disturb ``a``
    pa2 = vad.step(a, x[8000:16000])
    whole = vad.step(vad.new_state(sr), x[:16000])
    assert np.abs(np.concatenate([pa, pa2]) - whole).max() < 1e-5
    assert a.context.shape == (1, 64) and a.h.shape == (1, 128) and a.c.shape == (1, 128)
    assert vad.new_state(8000).context.shape == (1, 32)
    vad.step(a, x[:10], final=True)
    with pytest.raises(ValueError):
        vad.step(a, x[:10])


def test_windows_and_errors(vad):
    assert vad.sample_rates == (8000, 16000)
    assert vad.window_size(16000) == 512 and vad.window_size(8000) == 256
    assert vad.context_size(16000) == 64 and vad.context_size(8000) == 32
    assert len(vad.speech_probs(np.zeros(0, np.float32), 16000)) == 0
    assert len(vad.speech_probs(np.zeros(513, np.float32), 16000)) == 2
    with pytest.raises(InvalidRequestError):
        vad.speech_probs(np.zeros(1000, np.float32), 44100)
    with pytest.raises(CheckpointError):
        type(vad)("/nonexistent/silero.jit")


def test_explicit_jit_path_and_oasr_export_roundtrip(vad, tmp_path):
    from oasr_vad_silero import SileroVAD
    from oasr_vad_silero.weights import package_data_file

    x, sr = read(FILES_16K[0])
    x8, sr8 = read(FILE_8K)
    base16, base8 = vad.speech_probs(x, sr), vad.speech_probs(x8[:40000], sr8)
    from_jit = SileroVAD(package_data_file("silero_vad.jit"))
    assert np.array_equal(from_jit.speech_probs(x, sr), base16)
    path = vad.export(tmp_path / "silero.safetensors")
    back = SileroVAD(path)
    assert back.sample_rates == (8000, 16000)
    assert np.array_equal(back.speech_probs(x, sr), base16)
    assert np.array_equal(back.speech_probs(x8[:40000], sr8), base8)
    as_dir = vad.export(tmp_path / "exported")
    assert as_dir.name == "model.safetensors"
    assert np.array_equal(SileroVAD(tmp_path / "exported").speech_probs(x, sr), base16)


def _plain_torch_silero(sd: dict[str, torch.Tensor], x: np.ndarray) -> np.ndarray:
    """An independent 16 kHz reference in plain torch (nn.LSTMCell, F.conv1d), reading the
    package's flat safetensors names."""
    import torch.nn.functional as F

    cell = torch.nn.LSTMCell(128, 128)
    cell.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith("lstm_cell.")})
    xp = np.pad(x, (0, (-len(x)) % 512))
    ctx = torch.zeros(1, 64)
    state = None
    out = []
    with torch.no_grad():
        for i in range(0, len(xp), 512):
            inp = torch.cat([ctx, torch.from_numpy(xp[None, i : i + 512])], 1)
            ctx = inp[:, -64:]
            y = F.conv1d(F.pad(inp, (0, 64), mode="reflect")[:, None], sd["stft_conv.weight"], stride=128)
            y = (y[:, :129] ** 2 + y[:, 129:] ** 2).sqrt()
            for j, s in enumerate([1, 2, 2, 1], 1):
                y = F.relu(F.conv1d(y, sd[f"conv{j}.weight"], sd[f"conv{j}.bias"], stride=s, padding=1))
            state = cell(y[..., 0], state)
            p = torch.sigmoid(F.conv1d(F.relu(state[0][..., None]), sd["final_conv.weight"], sd["final_conv.bias"]))
            out.append(float(p.mean()))
    return np.asarray(out)


def test_package_safetensors_loads_its_own_weights(vad):
    """silero_vad_16k.safetensors holds different (16 kHz only) weights than the .jit."""
    from safetensors.torch import load_file

    from oasr_vad_silero import SileroVAD
    from oasr_vad_silero.weights import package_data_file

    path = package_data_file("silero_vad_16k.safetensors")
    st_vad = SileroVAD(path)
    assert st_vad.sample_rates == (16000,)
    x, sr = read(FILES_16K[0])
    x = x[:48000]
    got = st_vad.speech_probs(x, sr)
    ref = _plain_torch_silero(load_file(str(path)), x)
    assert np.abs(got - ref).max() < TOL
    assert np.abs(got - vad.speech_probs(x, sr)).max() > 1e-3  # really other weights
    with pytest.raises(InvalidRequestError):
        st_vad.new_state(8000)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_cuda_matches_cpu(vad, name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from oasr_vad_silero import SileroVAD

    x, sr = read(name)
    cpu = vad.speech_probs(x, sr)
    gpu = SileroVAD(device="cuda")
    assert np.abs(gpu.speech_probs(x, sr) - cpu).max() < TOL
    assert np.abs(_chunked(gpu, x, sr, [1000, 4096, 17]) - cpu).max() < TOL
    states = [gpu.new_state(sr) for _ in range(3)]
    outs = gpu.step_batch(states, [x, x[: len(x) // 2], x[:5000]], final=True)
    assert np.abs(outs[0] - cpu).max() < TOL
    assert gpu.nets[sr].stft.weight.device.type == "cuda"
