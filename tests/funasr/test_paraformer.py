"""FunASR Paraformer / BiCifParaformer against FunASR itself (PyPI ``funasr``, CPU), run in the
test on random-weight releases in FunASR's published layout and real Mandarin / English speech:
LFR + CMVN features, encoder output, text and token timestamps (ms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr.errors import CheckpointError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig

from .conftest import EN_CLIPS, ZH_CLIPS  # noqa: TID252

_MODELS: dict = {}


def load(releases, name: str):  # noqa: ANN001, ANN201
    from oasr.checkpoint import load_model

    if name not in _MODELS:
        _MODELS[name] = load_model(EngineConfig(ckpt_dir=str(releases[name])))
    return _MODELS[name]


def test_release_is_detected_and_registered(releases) -> None:
    from oasr.plugins import get_registry

    spec = get_registry("architecture").get("paraformer")
    assert spec.distribution == "oasr-models-funasr"
    m = load(releases, "zh")
    assert type(m).__name__ == "ParaformerASR" and m.source_format == "funasr"
    assert m.capabilities.decode_family.value == "cif" and not m.capabilities.hotwords


def test_weights_load_into_funasr_exactly(releases, funasr_ref) -> None:
    """The release's model.pt is FunASR's own: every tensor of its Paraformer matches by name."""
    for name in ("zh", "bicif", "seaco"):
        ref = funasr_ref.model(name).model.state_dict()
        ours = load(releases, name).net.state_dict()
        ref = {k: v for k, v in ref.items() if not k.startswith("ctc.")}
        assert set(ref) == set(ours), name
        for k, v in ref.items():
            assert torch.equal(v.float(), ours[k].float()), k


def test_features_and_encoder_match_funasr(releases, funasr_ref, clips) -> None:
    m = load(releases, "zh")
    ref = funasr_ref.model("zh")
    frontend = ref.kwargs["frontend"]
    waves = [clips[n] for n in ZH_CLIPS + EN_CLIPS[:1]]
    feats, lens = m.features(waves)
    enc = m.encode(feats, lens)
    for i, w in enumerate(waves):
        x = torch.from_numpy(w)[None]
        rf, rl = frontend(x, torch.tensor([len(w)]))
        n = int(rl[0])
        assert int(lens[i]) == n
        scale = rf.abs().max().item()
        assert (feats[i, :n] - rf[0]).abs().max().item() < 2e-4 * scale
        with torch.no_grad():
            re, rel = ref.model.encode(rf, rl)
        assert int(rel[0]) == n
        assert (enc[i, :n] - re[0]).abs().max().item() < 1e-4 * max(1.0, re.abs().max().item())
        assert enc[i, n:].abs().max().item() == 0 if n < enc.shape[1] else True


@pytest.mark.parametrize("name", ["zh", "en", "bicif", "seaco", "bicif_cnn"])
def test_text_and_timestamps_match_funasr(releases, funasr_ref, clips, name) -> None:
    """All clips in one batch (padded, different lengths) against FunASR one clip at a time."""
    m = load(releases, name)
    names = ZH_CLIPS + EN_CLIPS
    got = m.transcribe([clips[n] for n in names], DecodingOptions(word_timestamps=True))
    n_tokens = 0
    for clip, t in zip(names, got, strict=True):
        plain = funasr_ref.generate(name, clips[clip])
        timed = funasr_ref.generate(name, clips[clip], output_timestamp=True)
        if name != "zh" and name != "en":  # FunASR joins these models' words with spaces
            assert t.text == plain["text"].replace(" ", ""), clip
        else:
            assert t.text == plain["text"], clip
        words = [w.word for w in t.words]
        ms = [[round(w.start * 1000), round(w.end * 1000)] for w in t.words]
        assert words == timed["text"].split(), clip
        assert ms == [list(x) for x in timed["timestamp"]], clip
        n_tokens += len(t.segments[0].tokens) if t.segments else 0
    # the random models say something varied (else parity would prove little)
    assert n_tokens > 10 * len(names)
    assert len({w.word for t in got for w in t.words}) >= 30


@pytest.mark.parametrize("count", [3, 60])
def test_seaco_hotwords_match_funasr(releases, funasr_ref, clips, count) -> None:
    """SeACo's bias path with FunASR's hotword string (60 hotwords: past FunASR's filter of 50,
    which keeps those the bias decoder attends to most)."""
    m = load(releases, "seaco")
    assert m.capabilities.hotwords
    toks = m.tokens[3:-1]
    words = ["".join(toks[(7 * i) % 150 : (7 * i) % 150 + 2 + i % 3]) for i in range(count)]
    names = ZH_CLIPS + EN_CLIPS[:1]
    opts = DecodingOptions(word_timestamps=True, hotwords=tuple(words))
    got = m.transcribe([clips[n] for n in names], opts)
    plain = m.transcribe([clips[n] for n in names], DecodingOptions())
    for clip, t in zip(names, got, strict=True):
        ref = funasr_ref.generate("seaco", clips[clip], hotword=" ".join(words))
        assert t.text == ref["text"].replace(" ", ""), clip
        assert [[round(w.start * 1000), round(w.end * 1000)] for w in t.words] == [
            list(x) for x in ref["timestamp"]
        ], clip
    # the hotwords change the output, but not everywhere (the no-bias class still wins)
    changed = [a.text != b.text for a, b in zip(got, plain, strict=True)]
    assert any(changed)
    assert any(
        sum(x == y for x, y in zip(a.text, b.text, strict=False)) > len(b.text) // 2
        for a, b in zip(got, plain, strict=True)
    )


def test_seaco_filter_attention_matches_funasr(releases, funasr_ref) -> None:
    """The weights SeACo's hotword filter ranks by: FunASR's ``seaco_decoder.forward_asf6``
    (sixth-layer cross-attention) against OASR's, and the bias LSTM's hotword states."""
    ref = funasr_ref.model("seaco").model
    m = load(releases, "seaco")
    g = torch.Generator().manual_seed(0)
    d = m.config.encoder.output_size
    ctx, hid = torch.randn(1, 9, d, generator=g), torch.randn(1, 12, d, generator=g)
    with torch.no_grad():
        want = ref.seaco_decoder.forward_asf6(ctx, torch.tensor([9]), hid, torch.tensor([12]))
        got = m.net.seaco_decoder.cross_attention_weights(
            ctx, torch.tensor([9]), hid, torch.tensor([12]), 5
        )
        assert torch.allclose(want, got, atol=1e-6)
        hotwords = [[5, 9, 11], [7], [20, 21], [m.config.sos]]
        states = ref._hotword_representation(
            torch.tensor([[5, 9, 11], [7, 0, 0], [20, 21, 0], [m.config.sos, 0, 0]]),
            torch.tensor([3, 1, 2, 1]).int(),
        )
        assert torch.allclose(states, m.net.hotword_states(hotwords), atol=1e-6)


def test_batch_does_not_change_results(releases, clips) -> None:
    m = load(releases, "zh")
    waves = [clips[n] for n in ZH_CLIPS]
    opts = DecodingOptions(word_timestamps=True)
    batch = m.transcribe(waves, opts)
    alone = [m.transcribe([w], opts)[0] for w in waves]
    for a, b in zip(batch, alone, strict=True):
        assert a.text == b.text
        assert [(w.word, w.start, w.end) for w in a.words] == [
            (w.word, w.start, w.end) for w in b.words
        ]


def test_engine_batches_requests(releases, clips) -> None:
    from oasr.engine import ASREngine

    waves = [clips[n] for n in ZH_CLIPS]
    ref = load(releases, "zh").transcribe(waves, DecodingOptions())
    engine = ASREngine(EngineConfig(ckpt_dir=str(releases["zh"]), max_batch_size=8))
    try:
        futs = [engine.submit(w, DecodingOptions()) for w in waves]
        assert [f.result(timeout=120).text for f in futs] == [t.text for t in ref]
    finally:
        engine.shutdown()


def test_cli_transcribe(releases, clips) -> None:
    from typer.testing import CliRunner

    from oasr.cli.main import app

    from .conftest import SPEECH  # noqa: TID252

    clip = ZH_CLIPS[0]
    out = CliRunner().invoke(app, ["transcribe", "--threads", "1", "--ckpt-dir", str(releases["zh"]),
                                   "-f", "json", str(SPEECH / clip)])  # fmt: skip
    assert out.exit_code == 0, out.output
    ref = load(releases, "zh").transcribe([clips[clip]], DecodingOptions())
    assert ref[0].text in out.output


def test_refusals(releases, clips, tmp_path) -> None:
    m = load(releases, "zh")
    with pytest.raises(UnsupportedOptionError, match="hotwords"):
        m.transcribe([clips[ZH_CLIPS[0]]], DecodingOptions(hotwords=("阿里巴巴",)))
    with pytest.raises(UnsupportedOptionError, match="beam_size"):
        m.transcribe([clips[ZH_CLIPS[0]]], DecodingOptions(beam_size=4))
    import shutil

    from oasr_models_funasr.model import ParaformerASR

    bad = tmp_path / "seaco"
    shutil.copytree(releases["zh"], bad)
    cfg = (bad / "config.yaml").read_text(encoding="utf-8")
    (bad / "config.yaml").write_text(
        cfg.replace("model: Paraformer", "model: MyParaformerX"), encoding="utf-8"
    )
    with pytest.raises(CheckpointError, match="MyParaformerX"):
        ParaformerASR.from_release(bad)
    (bad / "tokens.json").unlink()
    with pytest.raises(CheckpointError, match="tokens.json"):
        ParaformerASR.from_release(bad)


def test_tokens_txt_release(releases, clips, tmp_path) -> None:
    """Releases with ``tokens.txt`` (one token per line) load like ``tokens.json`` ones."""
    import json
    import shutil

    from oasr_models_funasr.model import ParaformerASR

    d = tmp_path / "txt"
    shutil.copytree(releases["zh"], d)
    tokens = json.loads((d / "tokens.json").read_text(encoding="utf-8"))
    (d / "tokens.json").unlink()
    (d / "tokens.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    conf = json.loads((d / "configuration.json").read_text(encoding="utf-8"))
    conf["file_path_metas"]["tokenizer_conf"]["token_list"] = "tokens.txt"
    (d / "configuration.json").write_text(json.dumps(conf), encoding="utf-8")
    m = ParaformerASR.from_release(d)
    assert m.tokens == tokens
    wave = clips[ZH_CLIPS[1]]
    assert (
        m.transcribe([wave], DecodingOptions())[0].text
        == load(releases, "zh").transcribe([wave], DecodingOptions())[0].text
    )


def test_convert_to_native_and_back(releases, clips, tmp_path) -> None:
    """``oasr convert`` of a SeACo release: the native checkpoint gives the same transcripts,
    hotwords and timestamps included, and every tensor bit for bit."""
    from typer.testing import CliRunner

    from oasr.checkpoint import load_model
    from oasr.cli.main import app

    dst = tmp_path / "native"
    out = CliRunner().invoke(app, ["convert", str(releases["seaco"]), str(dst)])
    assert out.exit_code == 0, out.output
    native = load_model(EngineConfig(ckpt_dir=str(dst)))
    orig = load(releases, "seaco")
    assert native.source_format == "oasr" and native.capabilities.hotwords
    for k, v in orig.net.state_dict().items():
        assert torch.equal(v, native.net.state_dict()[k]), k
    waves = [clips[n] for n in ZH_CLIPS]
    opts = DecodingOptions(word_timestamps=True, hotwords=tuple(orig.tokens[20:23]))
    a, b = orig.transcribe(waves, opts), native.transcribe(waves, opts)
    assert [t.text for t in a] == [t.text for t in b]
    assert [[(w.word, w.start, w.end) for w in t.words] for t in a] == [
        [(w.word, w.start, w.end) for w in t.words] for t in b
    ]


def test_empty_and_short_inputs(releases) -> None:
    m = load(releases, "zh")
    got = m.transcribe([np.zeros(100, np.float32), np.zeros(16000, np.float32)], DecodingOptions())
    assert got[0].text == "" and got[0].segments == []
    assert got[1].duration == 1.0


@pytest.mark.slow
def test_ten_minutes_via_vad(releases, clips) -> None:
    """A 10-minute input is cut at VAD speech segments and decoded as one batch; each segment's
    text is the text of that span decoded alone, with its times shifted to the segment."""
    m = load(releases, "zh")
    rng = np.random.default_rng(0)
    parts = []
    while sum(len(p) for p in parts) < 600 * 16000:
        parts.append(clips[ZH_CLIPS[len(parts) % 3]])
        parts.append(np.zeros(int(rng.uniform(0.5, 2.0) * 16000), np.float32))
    long = np.concatenate(parts)[: 600 * 16000]
    got = m.transcribe([long], DecodingOptions(word_timestamps=True))[0]
    assert got.duration == 600.0
    assert len(got.segments) >= 100
    for seg in got.segments[:: max(1, len(got.segments) // 5)]:
        s, e = round(seg.start * 16000), round(seg.end * 16000)
        alone = m.transcribe([long[s:e]], DecodingOptions(word_timestamps=True))[0]
        assert alone.text == seg.text
        assert [round(w.start + seg.start, 3) for w in alone.words] == [w.start for w in seg.words]
    assert all(seg.end - seg.start <= 30.0 + 1e-6 for seg in got.segments)
