"""CUDA parity (``pytest -m gpu tests/funasr`` on a machine with a GPU): OASR on CUDA against
OASR on the CPU and, when ``funasr`` is installed there, against FunASR's AutoModel on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

from .conftest import EN_CLIPS, ZH_CLIPS  # noqa: TID252

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("name", ["zh", "bicif", "seaco"])
def test_cuda_float32_matches_cpu(releases, clips, name, no_tf32) -> None:
    from oasr.checkpoint import load_model

    cpu = load_model(EngineConfig(ckpt_dir=str(releases[name])))
    gpu = load_model(EngineConfig(ckpt_dir=str(releases[name]), device="cuda", dtype="float32"))
    waves = [clips[n] for n in ZH_CLIPS + EN_CLIPS]
    f1, l1 = cpu.features(waves)
    f2, l2 = gpu.features(waves)
    assert torch.equal(l1, l2.cpu())
    e1, e2 = cpu.encode(f1, l1), gpu.encode(f2, l2).cpu()
    assert (e1 - e2).abs().max().item() < 1e-3 * max(1.0, e1.abs().max().item())
    hotwords = tuple(cpu.tokens[10:13]) if name == "seaco" else None
    opts = DecodingOptions(word_timestamps=True, hotwords=hotwords)
    a, b = cpu.transcribe(waves, opts), gpu.transcribe(waves, opts)
    assert [t.text for t in a] == [t.text for t in b]
    assert [[(w.word, w.start, w.end) for w in t.words] for t in a] == [
        [(w.word, w.start, w.end) for w in t.words] for t in b
    ]


def test_cuda_float16_text_close(releases, clips) -> None:
    from oasr.checkpoint import load_model

    cpu = load_model(EngineConfig(ckpt_dir=str(releases["zh"])))
    gpu = load_model(EngineConfig(ckpt_dir=str(releases["zh"]), device="cuda", dtype="float16"))
    waves = [clips[n] for n in ZH_CLIPS]
    a = cpu.transcribe(waves, DecodingOptions())
    b = gpu.transcribe(waves, DecodingOptions())
    # random weights have small argmax margins: fp16 may flip a few tokens, not the text
    import difflib

    ratio = [
        difflib.SequenceMatcher(None, x.text, y.text).ratio() for x, y in zip(a, b, strict=True)
    ]
    assert min(ratio) > 0.6 and sum(ratio) / len(ratio) > 0.8, ratio


@pytest.mark.skipif(importlib.util.find_spec("funasr") is None, reason="funasr not installed here")
@pytest.mark.parametrize("name", ["zh", "en", "bicif", "seaco"])
def test_cuda_matches_funasr_on_cuda(releases, clips, name, no_tf32) -> None:
    from funasr import AutoModel

    from oasr.checkpoint import load_model

    ref = AutoModel(model=str(releases[name]), device="cuda", disable_update=True,
                    disable_pbar=True, log_level="ERROR", ncpu=torch.get_num_threads())  # fmt: skip
    gpu = load_model(EngineConfig(ckpt_dir=str(releases[name]), device="cuda", dtype="float32"))
    names = ZH_CLIPS + EN_CLIPS
    got = gpu.transcribe([clips[n] for n in names], DecodingOptions(word_timestamps=True))
    for clip, t in zip(names, got, strict=True):
        r = ref.generate(input=clips[clip], output_timestamp=True, disable_pbar=True)[0]
        assert [w.word for w in t.words] == r["text"].split(), clip
        assert [[round(w.start * 1000), round(w.end * 1000)] for w in t.words] == [
            list(x) for x in r["timestamp"]
        ], clip


@pytest.mark.parametrize("name", ["zh", "bicif"])
def test_cuda_graphs_match_eager(releases, clips, name, no_tf32) -> None:
    """The graphed encoder + predictor and decoder (bucketed, padded shapes) give the eager
    path's text and timestamps; a shape is captured on its second use and replayed after."""
    from oasr.checkpoint import load_model

    gpu = load_model(EngineConfig(ckpt_dir=str(releases[name]), device="cuda", dtype="float32"))
    assert gpu.cuda_graphs  # the default on CUDA (unless OASR_FUNASR_GRAPHS=0)
    waves = [clips[n] for n in ZH_CLIPS + EN_CLIPS]
    opts = DecodingOptions(word_timestamps=True)

    def words(ts):  # noqa: ANN001, ANN202
        return [(t.text, [(w.word, w.start, w.end) for w in t.words]) for t in ts]

    gpu.cuda_graphs = False
    eager = words(gpu.transcribe(waves, opts))
    feats, lens = gpu.features(waves)
    enc_eager = gpu.encode_and_predict(feats, lens)
    gpu.cuda_graphs = True
    for _ in range(3):  # eager (first use), capture, replay
        assert words(gpu.transcribe(waves, opts)) == eager
    stats = gpu._graphs.stats
    assert gpu._graphs.disabled is None
    assert stats["captures"] == 2 and stats["replays"] == 4, stats
    enc_graph = gpu.encode_and_predict(feats, lens)  # a replay of the captured bucket
    for a, b in zip(enc_eager, enc_graph, strict=True):
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().max().item() < 1e-3 * max(1.0, a.abs().max().item())
    # fewer rows in the same batch bucket: padded rows never reach the real ones
    sub = waves[1:]
    gpu.cuda_graphs = False
    eager_sub = words(gpu.transcribe(sub, opts))
    gpu.cuda_graphs = True
    for _ in range(2):
        assert words(gpu.transcribe(sub, opts)) == eager_sub


def _words(ts):  # noqa: ANN001, ANN202
    return [(t.text, [(w.word, w.start, w.end) for w in t.words]) for t in ts]


def test_graphs_are_captured_in_the_thread_that_runs_the_model(releases, clips, no_tf32) -> None:
    """Captures happen lazily inside the model call (the engine worker's thread here), not ahead
    from another thread, and the replays give the eager text."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from oasr.checkpoint import load_model

    gpu = load_model(EngineConfig(ckpt_dir=str(releases["zh"]), device="cuda", dtype="float32"))
    waves = [clips[n] for n in ZH_CLIPS]
    opts = DecodingOptions(word_timestamps=True)
    gpu.cuda_graphs = False
    eager = _words(gpu.transcribe(waves, opts))
    gpu.cuda_graphs = True
    graphs = gpu._cuda_graphs()
    record, threads = graphs._record, []

    def spy(fn, static):  # noqa: ANN001, ANN202
        threads.append(threading.get_ident())
        return record(fn, static)

    graphs._record = spy
    with ThreadPoolExecutor(1) as worker:
        worker_id = worker.submit(threading.get_ident).result()
        for _ in range(3):  # eager (first use), capture, replay
            assert _words(worker.submit(gpu.transcribe, waves, opts).result()) == eager
    assert threads and set(threads) == {worker_id} != {threading.get_ident()}
    assert graphs.stats["captures"] == 2 and graphs.stats["replays"] == 4 and graphs.disabled is None


def test_capture_failing_inside_runs_the_call_eagerly(releases, clips, no_tf32) -> None:
    """A real capture that cannot finish (a host read inside it): that call runs eagerly on the
    caller's stream with the eager text, graphs turn off with a warning, later calls stay eager."""
    from oasr.checkpoint import load_model

    gpu = load_model(EngineConfig(ckpt_dir=str(releases["zh"]), device="cuda", dtype="float32"))
    waves = [clips[n] for n in ZH_CLIPS]
    opts = DecodingOptions(word_timestamps=True)
    gpu.cuda_graphs = False
    eager = _words(gpu.transcribe(waves, opts))
    gpu.cuda_graphs = True
    graphs = gpu._cuda_graphs()
    encode = graphs._encode_predict

    def failing(feats, lens):  # noqa: ANN001, ANN202
        out = encode(feats, lens)
        if torch.cuda.is_current_stream_capturing():
            out[3].sum().item()  # a read back to the host: not capturable
        return out

    graphs._encode_predict = failing
    stream = torch.cuda.current_stream()
    assert _words(gpu.transcribe(waves, opts)) == eager  # first use: eager
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert _words(gpu.transcribe(waves, opts)) == eager  # the capture fails: eager
    assert graphs.disabled is not None and graphs.stats["captures"] == 0
    assert torch.cuda.current_stream() == stream
    assert _words(gpu.transcribe(waves, opts)) == eager
