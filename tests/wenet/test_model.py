"""Checkpoint detection / loading / native conversion, offline transcription, timestamps,
the ctc_blank VAD detector, registrations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.checkpoint import convert_checkpoint, detect_format, load_model
from oasr.errors import CheckpointError
from oasr.types import DecodingOptions, EngineConfig

from .conftest import DATA, Golden  # noqa: TID252

CLIP = "zh_aishell_BAC009S0764W0121.wav"


def test_registrations() -> None:
    from oasr.plugins import get_registry

    arch = get_registry("architecture").get("conformer")
    assert get_registry("architecture").get("wenet_conformer") is arch  # the key before 0.2
    assert arch.distribution == "oasr-models-wenet"
    assert arch.capabilities.decode_family == "ctc" and arch.capabilities.streaming is True
    assert list(arch.metadata["source_formats"]) == ["wenet", "oasr"]
    assert get_registry("checkpoint_format").get("wenet").metadata["architecture"] == "conformer"
    assert get_registry("vad_detector").get("ctc_blank").distribution == "oasr-models-wenet"
    dec = get_registry("decoder")
    for key in ("ctc_greedy", "ctc_prefix_beam", "attention_rescoring"):
        assert dec.get(key).metadata["decode_family"] == "ctc"
        assert callable(dec.resolve(key))


def test_detect(tmp_path: Path) -> None:
    from oasr_models_wenet.formats import WenetFormat

    for v in ("u2pp_conformer", "u2_conformer_conv2d6"):
        assert detect_format(DATA / v) == "wenet"
    assert WenetFormat.detect(DATA / "u2_conformer_conv2d6" / "avg_5.pt")
    d = tmp_path / "m"
    shutil.copytree(DATA / "u2pp_conformer", d)
    (d / "units.txt").rename(d / "words.txt")
    assert WenetFormat.detect(d)
    (d / "final.pt").unlink()
    assert not WenetFormat.detect(d)
    assert not WenetFormat.detect(tmp_path)


def test_native_roundtrip(tmp_path: Path, u2pp, speech) -> None:
    dst = tmp_path / "native"
    assert convert_checkpoint(DATA / "u2pp_conformer", dst) == "conformer"
    assert detect_format(dst) == "oasr"
    m2 = load_model(EngineConfig(ckpt_dir=str(dst)))
    assert m2.source_format == "oasr"
    s1, s2 = u2pp.net.state_dict(), m2.net.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    opts = DecodingOptions(beam_size=4, word_timestamps=True)
    a = [speech[CLIP]]
    assert u2pp.transcribe(a, opts)[0].to_dict() == m2.transcribe(a, opts)[0].to_dict()
    assert m2.units.pieces == u2pp.units.pieces
    # a checkpoint converted before the key was renamed (it names "wenet_conformer") still loads
    body = json.loads((dst / "oasr_model.json").read_text())
    (dst / "oasr_model.json").write_text(json.dumps({**body, "architecture": "wenet_conformer"}))
    m3 = load_model(EngineConfig(ckpt_dir=str(dst)))
    assert m3.transcribe(a, opts)[0].to_dict() == m2.transcribe(a, opts)[0].to_dict()


def test_checkpoint_errors(tmp_path: Path) -> None:
    d = tmp_path / "bad"
    shutil.copytree(DATA / "u2pp_conformer", d)
    text = (d / "train.yaml").read_text().replace("num_blocks: 2", "num_blocks: 3", 1)
    (d / "train.yaml").write_text(text)
    with pytest.raises(CheckpointError, match="missing"):
        load_model(EngineConfig(ckpt_dir=str(d)))
    shutil.copy(DATA / "u2pp_conformer" / "train.yaml", d / "train.yaml")
    (d / "units.txt").write_text("<blank> 0\na 1\n")
    with pytest.raises(CheckpointError):
        load_model(EngineConfig(ckpt_dir=str(d)))
    (d / "units.txt").write_text("<blank> zero\n")
    with pytest.raises(CheckpointError, match="token id"):
        load_model(EngineConfig(ckpt_dir=str(d)))


def test_cmvn_files_and_checkpoint_without_cmvn(tmp_path: Path, u2_conv2d6, speech) -> None:
    """The Kaldi-text stats file gives the checkpoint's own CMVN; a checkpoint whose state dict
    lacks the CMVN buffers reads train.yaml's cmvn_file instead."""
    from oasr_models_wenet.config import read_cmvn

    mean, istd = read_cmvn(DATA / "u2_conformer_conv2d6" / "global_cmvn.kaldi")
    cm = u2_conv2d6.net.encoder.global_cmvn
    assert np.allclose(mean, cm.mean.numpy(), atol=1e-4) and np.allclose(istd, cm.istd.numpy(), rtol=1e-5)
    mean, istd = read_cmvn(DATA / "u2pp_conformer" / "global_cmvn")
    d = tmp_path / "nocmvn"
    shutil.copytree(DATA / "u2_conformer_conv2d6", d)
    sd = torch.load(d / "avg_5.pt")
    sd = {k: v for k, v in sd.items() if "global_cmvn" not in k}
    torch.save(sd, d / "avg_5.pt")
    m = load_model(EngineConfig(ckpt_dir=str(d)))
    a = [speech[CLIP]]
    assert m.transcribe(a, DecodingOptions())[0].text == u2_conv2d6.transcribe(a, DecodingOptions())[0].text


def test_transcribe_offline(u2pp, speech) -> None:
    g = Golden("u2pp_conformer")
    run = g.run("C-1_L-1_mask")
    u2pp.ctc_weight, u2pp.reverse_weight = run["ctc_weight"], run["reverse_weight"]
    audios = [speech[CLIP], speech["zh_aishell_BAC009S0724W0121.wav"], np.zeros(100, np.float32)]
    greedy = u2pp.transcribe(audios, DecodingOptions())
    beam = u2pp.transcribe(audios, DecodingOptions(beam_size=5, word_timestamps=True))
    for b in range(2):
        assert greedy[b].segments[0].tokens == run["results"][b]["greedy"]
        assert beam[b].segments[0].tokens == run["results"][b]["rescoring"]
        assert beam[b].text == u2pp.units.decode(run["results"][b]["rescoring"])
    assert greedy[2].text == "" and greedy[2].segments == []
    assert greedy[0].language == "zh"
    words = beam[0].words
    assert len(words) == len(beam[0].segments[0].tokens)  # Chinese: one character per word
    starts = [w.start for w in words]
    assert starts == sorted(starts)
    assert all(0 <= w.start <= w.end <= beam[0].duration + 1e-6 for w in words)
    assert all(0.0 < w.confidence <= 1.0 for w in words)
    assert not greedy[0].words  # only when asked
    # default confidences come from the CTC alignment; "attention" gives WeNet's decoder ones
    from oasr.decoders.ctc import ctc_prefix_beam_search

    # the same batch as transcribe's (the empty clip is not encoded): a one-utterance batch
    # blocks its float32 GEMMs differently, which moves confidences by ~1.5e-6 (relative); the
    # same batch gives the same values (approx: only for BLAS kernels that follow alignment)
    enc, lens = u2pp.encode(audios[:2])
    n = int(lens[0])
    nbest = ctc_prefix_beam_search(u2pp.net.ctc_log_probs(enc)[0, :n].detach(), beam_size=5)[0]
    hyp, att_conf = u2pp._rescore(enc[0, :n], nbest)
    assert [w.confidence for w in words] == pytest.approx(hyp.confidences)
    u2pp.word_confidence = "attention"
    try:
        w2 = u2pp.transcribe(audios[:2], DecodingOptions(beam_size=5, word_timestamps=True))[0].words
    finally:
        u2pp.word_confidence = "ctc"
    assert [w.confidence for w in w2] == pytest.approx(att_conf)


def test_engine_offline_and_streaming_mode(u2pp, speech) -> None:
    from oasr.engine import ASREngine

    eng = ASREngine(EngineConfig(service_mode="streaming"), model=u2pp)
    out = eng.transcribe_arrays([speech[CLIP]], DecodingOptions())
    assert out[0].text


def test_bpe_words_and_timestamps(bpe8, speech) -> None:
    from oasr_models_wenet.model import Units

    u = Units(["<blank>", "\u2581HE", "LLO", "\u2581WORLD"])
    assert u.decode([1, 2, 3]) == "HELLO WORLD"
    tr = bpe8.transcribe([speech["en_sr_one_two_three.wav"]], DecodingOptions(beam_size=3, word_timestamps=True))[0]
    pieces = [bpe8.units.piece(t) for t in tr.segments[0].tokens]
    n_words = sum(1 for i, p in enumerate(pieces) if p.startswith("\u2581") or i == 0)
    assert len(tr.words) == n_words
    assert " ".join(w.word for w in tr.words) == tr.text
    assert tr.language == "en"


def test_ctc_blank_vad(u2pp, speech) -> None:
    from oasr.vad import get_detector, get_speech_segments

    vad = get_detector("ctc_blank", model=u2pp)
    a = speech[CLIP]
    w = vad.window_size(16000)
    assert w == 640
    probs = vad.speech_probs(a, 16000)
    assert probs.shape == (-(-len(a) // w),)
    assert probs.dtype == np.float32 and (probs >= 0).all() and (probs <= 1).all()
    state = vad.new_state(16000)
    parts = [vad.step(state, a[i : i + 9000]) for i in range(0, len(a), 9000)]
    parts.append(vad.step(state, np.zeros(0, np.float32), final=True))
    assert np.allclose(np.concatenate(parts), probs, atol=1e-5)
    assert isinstance(get_speech_segments(a[:24000], 16000, vad), list)
    with pytest.raises(ValueError):
        vad.window_size(8000)


def _edit_yaml(src: Path, dst: Path, **enc) -> Path:
    import yaml

    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "train.yaml").read_text())
    cfg["encoder_conf"].update(enc)
    (dst / "train.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return dst


def test_full_context_model_does_not_stream(tmp_path: Path, speech) -> None:
    from oasr.engine import ASREngine
    from oasr.errors import UnsupportedOptionError

    d = _edit_yaml(DATA / "u2pp_conformer", tmp_path / "full", use_dynamic_chunk=False)
    m = load_model(EngineConfig(ckpt_dir=str(d)))
    assert m.capabilities.streaming is False
    with pytest.raises(UnsupportedOptionError):
        m.new_stream(DecodingOptions())
    with pytest.raises(UnsupportedOptionError):
        ASREngine(EngineConfig(service_mode="streaming"), model=m)
    assert m.transcribe([speech[CLIP]], DecodingOptions())[0].text
    from oasr.vad import get_detector

    assert len(get_detector("ctc_blank", model=m).speech_probs(speech[CLIP][:16000])) == 25


def test_static_chunk_model_uses_its_mask_offline(tmp_path: Path, speech) -> None:
    """WeNet applies static_chunk_size's mask in every forward when use_dynamic_chunk is off."""
    d = _edit_yaml(DATA / "u2_conformer_conv2d6", tmp_path / "static", use_dynamic_chunk=False,
                   static_chunk_size=4)
    m = load_model(EngineConfig(ckpt_dir=str(d)))
    assert m.capabilities.streaming and m.chunk_size == 4 and m.offline_chunk_size == 4
    run = Golden("u2_conformer_conv2d6").run("C4_L-1_mask")
    tr = m.transcribe([speech[CLIP]], DecodingOptions())[0]
    assert tr.segments[0].tokens == run["results"][0]["greedy"]
