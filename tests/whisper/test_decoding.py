"""Window decoding (greedy, beam, timestamp rules, language detection) against openai-whisper's
``decode`` on identical weights: token-for-token parity."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import (  # noqa: E402
    OpenAIWhisperNetwork,
    english_tokenizer,
    load_speech,
    multilingual_tokenizer,
    random_openai_model,
)

from oasr.features.whisper import N_SAMPLES, log_mel_spectrogram, pad_or_trim  # noqa: E402
from oasr_models_whisper.decoding import (  # noqa: E402
    WindowOptions,
    _Filters,
    compression_ratio,
    decode_windows,
    detect_language,
    initial_tokens,
    resolve_suppress_tokens,
)

whisper = pytest.importorskip("whisper")
from whisper.decoding import ApplyTimestampRules, SuppressBlank, SuppressTokens  # noqa: E402


def mel_of(audio: np.ndarray, n_mels: int = 80) -> torch.Tensor:
    return pad_or_trim(log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES), 3000)


@pytest.fixture(scope="module")
def clips():
    jfk = load_speech("en_jfk_inaugural.flac")
    ls = load_speech("en_ls_1089-134686-0001.wav")
    return {"jfk": mel_of(jfk), "ls": mel_of(ls)}


@pytest.fixture(scope="module")
def multi_tok(tmp_path_factory):
    return multilingual_tokenizer(tmp_path_factory.mktemp("tok"), 99)


def ours_decode(net, tok, mel, *, language="en", task="transcribe", multilingual=False, beam=1,
                patience=None, length_penalty=None, without_timestamps=False, prompt=None,
                sample_len=None, suppress=(-1,), suppress_blank=True, feats=None):  # fmt: skip
    """``feats``: ``net.encode(mel)`` computed before (the same for every option set)."""
    if feats is None:
        feats = net.encode(mel if mel.dim() == 3 else mel[None])
    sot = tok.sot_sequence(language, task, multilingual=multilingual)
    init = initial_tokens(tok, sot, prompt=prompt, without_timestamps=without_timestamps,
                          n_text_ctx=net.dims.n_text_ctx)  # fmt: skip
    opts = WindowOptions(
        beam_size=beam, patience=patience, length_penalty=length_penalty, sample_len=sample_len,
        without_timestamps=without_timestamps, suppress_blank=suppress_blank,
        suppress_tokens=resolve_suppress_tokens(tok, suppress),
    )  # fmt: skip
    return decode_windows(net, tok, feats, [init] * feats.shape[0], opts)


def ref_decode(model, mel, **kw):
    """``mel`` may be the model's own audio features: openai-whisper's decode then skips its
    encoder (``DecodingTask._get_audio_features``)."""
    kw.setdefault("fp16", False)
    return whisper.decode(model, mel, whisper.DecodingOptions(**kw))


# --------------------------------------------------------------------------- unit: filters
def _random_histories(tok, sample_begin, rng, n=64):
    rows = []
    length = int(rng.integers(0, 6))
    for _ in range(n):
        seq = []
        for _ in range(length):
            if rng.random() < 0.4:
                seq.append(int(tok.timestamp_begin + rng.integers(0, 1501)))
            else:
                seq.append(int(rng.integers(0, tok.eot)))
        rows.append(seq)
    prefix = [tok.sot] * sample_begin
    return torch.tensor([prefix + r for r in rows], dtype=torch.long)


@pytest.mark.parametrize("seed", range(8))
def test_logit_filters_match_reference(seed):
    tok = english_tokenizer()
    ref_tok = whisper.tokenizer.get_tokenizer(False)
    rng = np.random.default_rng(seed)
    sample_begin = 1
    tokens = _random_histories(tok, sample_begin, rng)
    logits = torch.from_numpy(rng.normal(0, 3, (tokens.shape[0], 51864)).astype(np.float32))
    logits[:, tok.timestamp_begin :] += float(rng.normal(0, 4))  # vary the timestamp mass
    suppress = resolve_suppress_tokens(tok, (-1,))
    opts = WindowOptions(suppress_tokens=suppress)
    ours = logits.clone()
    _Filters(tok, sample_begin, opts, 1500, 51864, torch.device("cpu"))(ours, tokens)
    ref = logits.clone()
    for f in [SuppressBlank(ref_tok, sample_begin), SuppressTokens(suppress),
              ApplyTimestampRules(ref_tok, sample_begin, 50)]:  # fmt: skip
        f.apply(ref, tokens)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours, ref)


def test_compression_ratio():
    assert compression_ratio("") == 0.0
    assert compression_ratio("la " * 100) > 5
    assert compression_ratio("The quick brown fox.") < 1.5


# --------------------------------------------------------------------------- random weights
@pytest.fixture(scope="module")
def rand_multi():
    model = random_openai_model(multilingual=True, seed=1)
    return model, OpenAIWhisperNetwork(model)


@pytest.fixture(scope="module")
def rand_jfk_feats(rand_multi, clips):
    """The random model's encoding of the JFK window, once: both sides below decode with the same
    openai-whisper model (``OpenAIWhisperNetwork`` wraps it), so its encoder output is shared."""
    return rand_multi[1].encode(clips["jfk"][None])


def test_language_detection_matches_reference(rand_multi, multi_tok, clips):
    model, net = rand_multi
    mels = torch.stack([clips["jfk"], clips["ls"]])
    codes, probs = detect_language(net, multi_tok, net.encode(mels))
    ref_tokens, ref_probs = model.detect_language(mels, whisper.tokenizer.get_tokenizer(True))
    assert codes == [max(p, key=p.get) for p in ref_probs]
    for ours_p, ref_p in zip(probs, ref_probs, strict=False):
        assert set(ours_p) == set(ref_p)
        for k in ref_p:
            assert ours_p[k] == pytest.approx(ref_p[k], abs=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(language="de", task="transcribe"),
        dict(language="fr", task="translate"),
        dict(language="en", task="transcribe", without_timestamps=True),
        pytest.param(dict(language="ja", task="transcribe", beam=3), marks=pytest.mark.slow),
        dict(language="en", task="transcribe", prompt="Previous words here."),
    ],
)
def test_random_multilingual_parity(rand_multi, multi_tok, clips, rand_jfk_feats, kw):
    model, net = rand_multi
    beam = kw.pop("beam", 1)
    ours = ours_decode(net, multi_tok, clips["jfk"], multilingual=True, beam=beam,
                       sample_len=24, feats=rand_jfk_feats, **kw)[0]  # fmt: skip
    ref = ref_decode(model, rand_jfk_feats[0], beam_size=beam if beam > 1 else None, sample_len=24,
                     **kw)  # fmt: skip
    assert ours.tokens == ref.tokens
    assert ours.text == ref.text
    assert ours.avg_logprob == pytest.approx(ref.avg_logprob, abs=1e-5)
    assert ours.no_speech_prob == pytest.approx(ref.no_speech_prob, abs=1e-6)


def test_random_batch_equals_single(rand_multi, multi_tok, clips):
    model, net = rand_multi
    mels = torch.stack([clips["jfk"], clips["ls"], torch.zeros_like(clips["ls"])])
    batch = ours_decode(net, multi_tok, mels, multilingual=True, sample_len=16)
    ref = ref_decode(model, mels, language="en", sample_len=16)
    for i in range(3):
        single = ours_decode(net, multi_tok, mels[i], multilingual=True, sample_len=16)[0]
        assert batch[i].tokens == single.tokens == ref[i].tokens


# --------------------------------------------------------------------------- real tiny.en
@pytest.fixture(scope="module")
def tiny():
    from fixtures_decoding import TINY_EN, openai_model_from_loaded

    from oasr_models_whisper.checkpoints import load_ct2
    from oasr_models_whisper.nn import build_network

    loaded = load_ct2(TINY_EN)
    return openai_model_from_loaded(loaded), build_network(loaded, "cpu", torch.float32)


@pytest.fixture(scope="module")
def tiny_feats(tiny, clips):
    """Each side's own encoder output per clip, computed once: the tiny.en encoder on a 30 s
    window is a large share of each decode, and it is the same for every option set below.
    Both encoders still run (ours and openai-whisper's), so decoding still sees each side's own
    features."""
    ref_model, net = tiny
    with torch.no_grad():
        ref = {k: ref_model.embed_audio(m[None]) for k, m in clips.items()}
    return ref, {"jfk": net.encode(clips["jfk"][None])}


@pytest.fixture(scope="module")
def tiny_ref_decode(tiny, tiny_feats):
    """openai-whisper's decode of one clip's features, each option set run once in this module
    (the batched beam test and the beam-5 parity case share the single-clip beam-5 reference)."""
    ref_model = tiny[0]
    done: dict = {}

    def decode(clip: str, **kw):
        key = (clip, tuple(sorted(kw.items())))
        if key not in done:
            done[key] = ref_decode(ref_model, tiny_feats[0][clip][0], **kw)
        return done[key]

    return decode


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        pytest.param(dict(without_timestamps=True), marks=pytest.mark.slow),
        pytest.param(dict(beam=5), marks=pytest.mark.slow),
        pytest.param(
            dict(beam=3, patience=2.0, length_penalty=0.6, without_timestamps=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(prompt="President Kennedy's inaugural address, 1961."), marks=pytest.mark.slow
        ),
        pytest.param(dict(suppress=(), suppress_blank=False), marks=pytest.mark.slow),
    ],
    ids=["greedy", "greedy-notimestamps", "beam5", "beam3-patience-lp", "prompt", "nosuppress"],
)
def test_tiny_en_parity(tiny, clips, tiny_feats, tiny_ref_decode, kw):
    net, our_feats = tiny[1], tiny_feats[1]
    ours = ours_decode(net, english_tokenizer(), clips["jfk"], feats=our_feats["jfk"], **kw)[0]
    ref_kw = dict(language="en")
    if kw.get("beam", 1) > 1:
        ref_kw["beam_size"] = kw["beam"]
    for k in ("patience", "length_penalty", "without_timestamps", "prompt", "suppress_blank"):
        if k in kw:
            ref_kw[k] = kw[k]
    if "suppress" in kw:
        ref_kw["suppress_tokens"] = ""
    ref = tiny_ref_decode("jfk", **ref_kw)
    assert ours.tokens == ref.tokens, (ours.text, ref.text)
    assert ours.text == ref.text
    assert "fellow Americans" in ours.text
    assert ours.avg_logprob == pytest.approx(ref.avg_logprob, abs=1e-3)
    assert ours.no_speech_prob == pytest.approx(ref.no_speech_prob, abs=1e-4)
    assert ours.compression_ratio == pytest.approx(ref.compression_ratio)


@pytest.mark.slow
def test_tiny_en_batched_beam_matches_single_reference(tiny, clips, tiny_ref_decode):
    net = tiny[1]
    mels = torch.stack([clips["jfk"], clips["ls"]])
    # beam 5 as in test_tiny_en_parity[beam5], whose single-clip JFK reference this reuses
    ours = ours_decode(net, english_tokenizer(), mels, beam=5)  # our encoder on the batch
    for i, name in enumerate(["jfk", "ls"]):
        ref = tiny_ref_decode(name, language="en", beam_size=5)
        assert ours[i].tokens == ref.tokens
