"""Greedy decoding of a random-weight checkpoint saved by transformers, loaded through OASR's HF
loader, against transformers' own ``generate``, token for token.

With ``return_timestamps=True`` transformers runs its own seek loop even for one window (it
re-decodes from the last timestamp pair and concatenates), so its output is not one window's;
there the first window is compared up to where transformers moved on. Timestamp-mode windows are
checked token for token against openai-whisper's ``decode`` in test_decoding.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import load_speech, multilingual_tokenizer_json  # noqa: E402

#: parity with transformers' generate, 15-35 s a case: skipped by `scripts/test.sh --fast`
pytestmark = pytest.mark.slow

from oasr.features.whisper import N_SAMPLES, log_mel_spectrogram, pad_or_trim  # noqa: E402
from oasr_models_whisper.decoding import (  # noqa: E402
    WindowOptions,
    decode_windows,
    initial_tokens,
    resolve_suppress_tokens,
)

transformers = pytest.importorskip("transformers")
wt = pytest.importorskip("whisper.tokenizer")

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(transformers model, OASR WhisperASR) on the same random weights."""
    from oasr_models_whisper.checkpoints import load_hf
    from oasr_models_whisper.model import WhisperASR

    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=51865, num_mel_bins=80, encoder_layers=2, encoder_attention_heads=2,
        decoder_layers=2, decoder_attention_heads=2, d_model=64, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_source_positions=1500, max_target_positions=448,
        pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258,
        init_std=0.5,
    )  # fmt: skip
    transformers.WhisperForConditionalGeneration(cfg).save_pretrained(d)
    # a complete generation_config.json, built from openai-whisper's tokenizer
    ref = wt.get_tokenizer(True, num_languages=99)
    langs = list(wt.LANGUAGES)[:99]
    gen = {
        "decoder_start_token_id": ref.sot, "eos_token_id": ref.eot, "pad_token_id": ref.eot,
        "bos_token_id": ref.eot, "is_multilingual": True,
        "lang_to_id": {f"<|{c}|>": ref.sot + 1 + i for i, c in enumerate(langs)},
        "task_to_id": {"transcribe": ref.transcribe, "translate": ref.translate},
        "no_timestamps_token_id": ref.no_timestamps, "prev_sot_token_id": ref.sot_prev,
        "max_initial_timestamp_index": 50, "suppress_tokens": list(ref.non_speech_tokens),
        "begin_suppress_tokens": [220, ref.eot], "max_length": 448,
        "alignment_heads": [[1, 0], [1, 1]],
    }  # fmt: skip
    (d / "generation_config.json").write_text(json.dumps(gen))
    (d / "tokenizer.json").write_text(multilingual_tokenizer_json(99))
    model = transformers.WhisperForConditionalGeneration.from_pretrained(d).eval()
    ours = WhisperASR.from_loaded(load_hf(d))
    return model, ours


#: The three factors (clip, timestamp mode, language/task) are independent code paths, so a
#: pairwise covering set of 4 cases replaces the full 2x2x2 product (transformers' generate is
#: the cost): every value of each factor occurs twice and every pair of values of any two factors
#: occurs exactly once.
PAIRWISE_CASES = [
    ("en_jfk_inaugural.flac", False, "en", "transcribe"),
    ("en_jfk_inaugural.flac", True, "de", "translate"),
    ("en_ls_1089-134686-0001.wav", False, "de", "translate"),
    ("en_ls_1089-134686-0001.wav", True, "en", "transcribe"),
]


@pytest.mark.parametrize("clip,timestamps,language,task", PAIRWISE_CASES)
def test_greedy_matches_transformers_generate(hf_pair, clip, timestamps, language, task):
    model, ours = hf_pair
    mel = pad_or_trim(log_mel_spectrogram(load_speech(clip), 80, padding=N_SAMPLES), 3000)[None]
    with torch.no_grad():
        out = model.generate(mel, language=language, task=task, return_timestamps=timestamps,
                             max_new_tokens=NEW_TOKENS)  # fmt: skip
    hf_tokens = (out.sequences if hasattr(out, "sequences") else out)[0].tolist()
    tok = ours.tokenizer
    init = initial_tokens(tok, tok.sot_sequence(language, task), prompt=None,
                          without_timestamps=not timestamps, n_text_ctx=448)  # fmt: skip
    opts = WindowOptions(
        sample_len=NEW_TOKENS, without_timestamps=not timestamps,
        suppress_tokens=resolve_suppress_tokens(tok, (-1,), ours.non_speech_tokens),
    )  # fmt: skip
    got = decode_windows(ours.network, tok, ours.network.encode(mel), [init], opts)[0]
    if hf_tokens[: len(init)] == init:  # some versions return the prompt too
        hf_tokens = hf_tokens[len(init) :]
    if hf_tokens and hf_tokens[-1] == tok.eot:
        hf_tokens = hf_tokens[:-1]
    if not timestamps:
        assert got.tokens == hf_tokens
        return
    # transformers' first window: up to its last timestamp pair before it seeks on
    tb = tok.timestamp_begin
    common = 0
    while common < min(len(got.tokens), len(hf_tokens)) and got.tokens[common] == hf_tokens[common]:
        common += 1
    assert common == len(got.tokens) or (
        common >= 2 and got.tokens[common - 1] >= tb and got.tokens[common - 2] >= tb
    ), (got.tokens, hf_tokens)
    assert common >= min(len(got.tokens), 8)
