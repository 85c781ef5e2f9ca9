"""WhisperTokenizer against openai-whisper's tiktoken tokenizer (the reference)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import TINY_EN, english_tokenizer, multilingual_tokenizer  # noqa: E402

from oasr.errors import CheckpointError, InvalidRequestError  # noqa: E402
from oasr_models_whisper.tokenizer import (  # noqa: E402
    LANGUAGES,
    WhisperTokenizer,
    normalize_language,
)

wt = pytest.importorskip("whisper.tokenizer")

SPECIALS = ["eot", "sot", "translate", "transcribe", "sot_lm", "sot_prev", "no_speech",
            "no_timestamps", "timestamp_begin"]  # fmt: skip
TEXTS = [
    " And so my fellow Americans, ask not what your country can do for you.",
    "Hello  world!! ça va? naïve café — 100% (ok) [x] {y} <z>",
    " 我们今天去公园。 日本語のテキストです。",
    " Привет, мир! Ελληνικά. عربى",
    " ♪♪ la la ♪ -- ' ' \" ",
    "",
]


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    return multilingual_tokenizer(tmp_path_factory.mktemp("tok99"), 99)


def test_language_table_matches_reference():
    assert list(LANGUAGES.items()) == list(wt.LANGUAGES.items())


def test_english_special_tokens():
    ours, ref = english_tokenizer(), wt.get_tokenizer(False)
    for name in SPECIALS:
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eot == 50256 and ours.timestamp_begin == 50363
    assert ours.timestamp_end == 50363 + 1500
    assert ours.sot_sequence("en", "transcribe", multilingual=False) == (ours.sot,)


def test_multilingual_special_tokens(multi):
    for lang, task in [("en", "transcribe"), ("de", "translate"), ("zh", "transcribe")]:
        ref = wt.get_tokenizer(True, num_languages=99, language=lang, task=task)
        for name in SPECIALS:
            assert getattr(multi, name) == getattr(ref, name), name
        assert multi.sot_sequence(lang, task) == tuple(ref.sot_sequence)
    ref = wt.get_tokenizer(True, num_languages=99)
    assert set(multi.all_language_tokens) == set(ref.all_language_tokens)
    assert len(multi.languages) == 99 and "yue" not in multi.languages


def test_large_v3_has_100_languages(tmp_path):
    tok = multilingual_tokenizer(tmp_path, 100)
    ref = wt.get_tokenizer(True, num_languages=100, language="yue", task="transcribe")
    for name in SPECIALS:
        assert getattr(tok, name) == getattr(ref, name), name
    assert tok.languages[-1] == "yue" and len(tok.languages) == 100
    assert tok.sot_sequence("yue", "transcribe") == tuple(ref.sot_sequence)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_reference(text, multi):
    for ours, ref in [(english_tokenizer(), wt.get_tokenizer(False)),
                      (multi, wt.get_tokenizer(True, num_languages=99))]:  # fmt: skip
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids) == text
        stamped = [ours.timestamp_begin, *ids, ours.timestamp_begin + 57, ours.eot]
        assert ours.decode_with_timestamps(stamped) == ref.decode_with_timestamps(stamped)
        assert ours.decode(stamped) == text  # specials and timestamps dropped


def test_partial_utf8_decodes_with_replacement():
    tok, ref = english_tokenizer(), wt.get_tokenizer(False)
    ids = tok.encode(" 我")
    assert len(ids) > 1
    assert tok.decode(ids[:1]) == ref.decode(ids[:1])
    assert "\ufffd" in tok.decode(ids[:1])


def test_non_speech_tokens_match_reference_and_checkpoint(multi):
    en = english_tokenizer()
    assert en.non_speech_tokens == wt.get_tokenizer(False).non_speech_tokens
    assert multi.non_speech_tokens == wt.get_tokenizer(True, num_languages=99).non_speech_tokens
    cfg = json.loads((TINY_EN / "config.json").read_text())
    specials = {en.sot, en.translate, en.transcribe, en.sot_lm, en.sot_prev, en.no_speech}
    assert set(cfg["suppress_ids"]) - specials == set(en.non_speech_tokens)


@pytest.mark.parametrize(
    "text,language",
    [
        (' Hello, world! It\'s 3.5 "quoted" (aside) end.', "en"),
        (" 我们今天去公园。你好！", "zh"),
        ("日本語のテキスト、です。", "ja"),
        (" สวัสดีครับ", "th"),
        (" Guten Tag, wie geht's?", "de"),
    ],
)
def test_split_to_word_tokens_matches_reference(text, language, multi):
    ref = wt.get_tokenizer(True, num_languages=99, language=language)
    ids = ref.encode(text) + [ref.eot]
    assert multi.split_to_word_tokens(ids, language) == ref.split_to_word_tokens(ids)
    if language == "en":
        en_ref = wt.get_tokenizer(False)
        en_ids = en_ref.encode(text) + [en_ref.eot]
        assert english_tokenizer().split_to_word_tokens(
            en_ids, "en"
        ) == en_ref.split_to_word_tokens(en_ids)


def test_vocab_merges_loading_equals_tokenizer_json(tmp_path):
    body = json.loads((TINY_EN / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(body["model"]["vocab"]))
    merges = body["model"]["merges"]
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    added = {t["content"]: t["id"] for t in body["added_tokens"]}
    (tmp_path / "added_tokens.json").write_text(json.dumps(added))
    tok = WhisperTokenizer.from_dir(tmp_path)
    ref = english_tokenizer()
    for name in SPECIALS:
        assert getattr(tok, name) == getattr(ref, name)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(ref.encode(text)) == text


def test_missing_tokenizer_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        WhisperTokenizer.from_dir(tmp_path)


def test_language_names():
    assert normalize_language("English") == "en"
    assert normalize_language(" de ") == "de"
    assert normalize_language("mandarin") == "zh"
    assert normalize_language(None) is None
    with pytest.raises(InvalidRequestError, match="unknown language"):
        normalize_language("klingon")


def test_timestamp_token(multi):
    assert multi.timestamp_token(0.0) == multi.timestamp_begin
    assert multi.timestamp_token(30.0) == multi.timestamp_end
    assert multi.decode_with_timestamps([multi.timestamp_token(1.08)]) == "<|1.08|>"


@pytest.mark.parametrize("multilingual,num_languages", [(False, 99), (True, 99), (True, 100)])
def test_tiktoken_assets_give_the_reference_tokenizer(multilingual, num_languages):
    """openai-whisper .pt checkpoints ship no tokenizer: it is rebuilt from the .tiktoken ranks."""
    tok = WhisperTokenizer.for_vocabulary(multilingual, num_languages)
    ref = wt.get_tokenizer(multilingual, num_languages=num_languages)
    for name in SPECIALS:
        assert getattr(tok, name) == getattr(ref, name), name
    assert len(tok.languages) == (num_languages if multilingual else 99)
    for text in TEXTS + ["  a\n\n b  c\t", "'s 're 123456 !!?? 'LL"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.non_speech_tokens == ref.non_speech_tokens
