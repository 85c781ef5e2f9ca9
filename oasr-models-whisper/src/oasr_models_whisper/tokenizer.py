"""Whisper's byte-level BPE tokenizer with its special tokens, on the ``tokenizers`` library.

Loads ``tokenizer.json`` (Hugging Face / CTranslate2 checkpoints) or ``vocab.json`` +
``merges.txt``. Special-token ids are looked up by name, so the English-only vocabulary
(``<|endoftext|>`` = 50256), the multilingual one (50257) and large-v3's 100 languages all work.
Timestamp tokens ``<|0.00|>`` .. ``<|30.00|>`` follow ``<|notimestamps|>`` whether or not the
vocabulary file lists them.

The tokenizer is stateless with respect to language and task: callers pass them to
:meth:`WhisperTokenizer.sot_sequence` and :meth:`WhisperTokenizer.split_to_word_tokens`.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

from oasr.errors import CheckpointError, InvalidRequestError
from oasr.languages import NAMES

#: Whisper's language codes in token order (the 100th, "yue", exists only in large-v3
#: vocabularies): the core's table of OpenAI's names, which keeps Whisper's order.
LANGUAGES: dict[str, str] = NAMES

#: Alternative names accepted for a language (besides the code and the English name).
LANGUAGE_ALIASES: dict[str, str] = {
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht",
    "letzeburgesch": "lb", "pushto": "ps", "panjabi": "pa", "moldavian": "ro",
    "moldovan": "ro", "sinhalese": "si", "castilian": "es", "mandarin": "zh",
}  # fmt: skip

#: Languages written without spaces: words are split at unicode-character boundaries.
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})

#: Seconds per timestamp token step.
TIME_PRECISION = 0.02
N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>


def normalize_language(language: str | None) -> str | None:
    """Map a code ("en"), an English name ("English") or an alias to a Whisper code."""
    if language is None:
        return None
    key = language.strip().lower()
    if key in LANGUAGES:
        return key
    for code, name in LANGUAGES.items():
        if name == key:
            return code
    if key in LANGUAGE_ALIASES:
        return LANGUAGE_ALIASES[key]
    raise InvalidRequestError(
        f"unknown language {language!r}; use an ISO 639-1 code such as 'en', 'de' or 'zh'",
        param="language",
    )


class WhisperTokenizer:
    """Whisper BPE tokenizer: text <-> ids, special tokens, timestamps, word splitting.

    ``num_languages`` limits the language tokens to the first N (99 for most multilingual
    models, 100 for large-v3); by default every ``<|xx|>`` token found in the vocabulary counts.
    """

    def __init__(self, tokenizer, *, num_languages: int | None = None) -> None:
        self._tok = tokenizer
        ids = {}
        for name in ("endoftext", "startoftranscript", "translate", "transcribe", "startoflm",
                     "startofprev", "notimestamps"):  # fmt: skip
            tid = tokenizer.token_to_id(f"<|{name}|>")
            if tid is None:
                raise CheckpointError(f"Whisper tokenizer lacks the special token <|{name}|>")
            ids[name] = tid
        self.eot: int = ids["endoftext"]
        self.sot: int = ids["startoftranscript"]
        self.translate: int = ids["translate"]
        self.transcribe: int = ids["transcribe"]
        self.sot_lm: int = ids["startoflm"]
        self.sot_prev: int = ids["startofprev"]
        self.no_timestamps: int = ids["notimestamps"]
        ns = tokenizer.token_to_id("<|nospeech|>")
        if ns is None:
            ns = tokenizer.token_to_id("<|nocaptions|>")
        self.no_speech: int | None = ns
        ts = tokenizer.token_to_id("<|0.00|>")
        self.timestamp_begin: int = ts if ts is not None else self.no_timestamps + 1
        self.timestamp_end: int = self.timestamp_begin + N_TIMESTAMPS - 1

        langs: dict[str, int] = {}
        for code in LANGUAGES:
            tid = tokenizer.token_to_id(f"<|{code}|>")
            if tid is None or not (self.sot < tid < self.translate):
                continue
            langs[code] = tid
        if num_languages is not None:
            langs = dict(list(langs.items())[:num_languages])
        self.language_tokens: dict[str, int] = langs
        self._lang_by_token = {v: k for k, v in langs.items()}

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> WhisperTokenizer:
        """Load ``tokenizer.json``."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), **kwargs)

    @classmethod
    def from_vocab_merges(
        cls, vocab: str | os.PathLike, merges: str | os.PathLike,
        added_tokens: str | os.PathLike | None = None, **kwargs,
    ) -> WhisperTokenizer:  # fmt: skip
        """Load ``vocab.json`` + ``merges.txt`` (+ optional ``added_tokens.json``)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if added_tokens is not None:
            extra = json.loads(Path(added_tokens).read_text(encoding="utf-8"))
            for content, _ in sorted(extra.items(), key=lambda kv: kv[1]):
                tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        return cls(tok, **kwargs)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, **kwargs) -> WhisperTokenizer:
        """Load from a checkpoint directory holding tokenizer.json or vocab.json + merges.txt."""
        p = Path(path)
        if (p / "tokenizer.json").is_file():
            return cls.from_file(p / "tokenizer.json", **kwargs)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            added = p / "added_tokens.json"
            return cls.from_vocab_merges(
                p / "vocab.json", p / "merges.txt", added if added.is_file() else None, **kwargs
            )
        raise CheckpointError(
            f"no Whisper tokenizer in {str(p)!r}: expected tokenizer.json or vocab.json + merges.txt"
        )

    @classmethod
    def from_files(cls, files: dict[str, str] | Sequence[str] | str, **kwargs) -> WhisperTokenizer:
        """Load from a role -> path mapping, a list of paths or one path (file or directory)."""
        if isinstance(files, (str, os.PathLike)):
            p = Path(files)
            return cls.from_dir(p, **kwargs) if p.is_dir() else cls.from_file(p, **kwargs)
        paths = list(files.values()) if isinstance(files, dict) else list(files)
        by_name = {Path(x).name: Path(x) for x in paths}
        if "tokenizer.json" in by_name:
            return cls.from_file(by_name["tokenizer.json"], **kwargs)
        if "vocab.json" in by_name and "merges.txt" in by_name:
            return cls.from_vocab_merges(
                by_name["vocab.json"],
                by_name["merges.txt"],
                by_name.get("added_tokens.json"),
                **kwargs,
            )
        tiktoken = [p for n, p in by_name.items() if n.endswith(".tiktoken")]
        if len(tiktoken) == 1:
            if kwargs.get("num_languages") is None:
                kwargs.pop("num_languages", None)
            return cls.from_tiktoken(tiktoken[0], **kwargs)
        raise CheckpointError(f"no Whisper tokenizer among {paths!r}")

    @classmethod
    def from_tiktoken(
        cls, path: str | os.PathLike, *, num_languages: int = 99, **kwargs
    ) -> WhisperTokenizer:
        """Load openai-whisper's ``gpt2.tiktoken`` / ``multilingual.tiktoken`` rank file.

        The BPE merges are recovered from the ranks and Whisper's special tokens are appended in
        openai-whisper's order (``num_languages`` language tokens; 100 for large-v3).
        """
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        ranks: dict[bytes, int] = {}
        for line in Path(path).read_text(encoding="ascii").splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        byte_map = _bytes_to_unicode()

        def spell(b: bytes) -> str:
            return "".join(byte_map[x] for x in b)

        vocab = {spell(tok): rank for tok, rank in ranks.items()}
        merges = [(spell(a), spell(b)) for a, b in _recover_merges(ranks)]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        langs = list(LANGUAGES)[:num_languages]
        specials = [
            "<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in langs],
            "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
            "<|nospeech|>", "<|notimestamps|>",
            *[f"<|{i * TIME_PRECISION:.2f}|>" for i in range(N_TIMESTAMPS)],
        ]  # fmt: skip
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        kwargs.setdefault("num_languages", num_languages)
        return cls(tok, **kwargs)

    @classmethod
    def for_vocabulary(cls, multilingual: bool, num_languages: int = 99) -> WhisperTokenizer:
        """The standard tokenizer of a checkpoint that ships none (openai-whisper ``.pt``), from
        the ``.tiktoken`` assets of an installed ``openai-whisper`` package."""
        name = "multilingual.tiktoken" if multilingual else "gpt2.tiktoken"
        asset = _openai_asset(name)
        if asset is None:
            raise CheckpointError(
                f"this Whisper checkpoint carries no tokenizer and {name} was not found; install "
                f"openai-whisper (which ships it) or put the Hugging Face tokenizer.json of the "
                f"same model next to the checkpoint"
            )
        return cls.from_tiktoken(asset, num_languages=num_languages if multilingual else 99)

    # ---------------------------------------------------------------- properties
    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(self.language_tokens)

    @property
    def all_language_tokens(self) -> tuple[int, ...]:
        return tuple(self.language_tokens.values())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def language_token(self, language: str) -> int:
        code = normalize_language(language)
        if code not in self.language_tokens:
            raise InvalidRequestError(
                f"language {language!r} is not in this model's vocabulary", param="language"
            )
        return self.language_tokens[code]

    def language_of_token(self, token: int) -> str:
        return self._lang_by_token[token]

    def timestamp_token(self, seconds: float) -> int:
        return self.timestamp_begin + round(seconds / TIME_PRECISION)

    def sot_sequence(
        self, language: str | None = None, task: str | None = None, *, multilingual: bool = True
    ) -> tuple[int, ...]:
        """``<|startoftranscript|>`` [+ ``<|lang|>`` + ``<|task|>`` for multilingual models]."""
        seq = [self.sot]
        if multilingual:
            if language is not None:
                seq.append(self.language_token(language))
            if task is not None:
                seq.append(self.translate if task == "translate" else self.transcribe)
        return tuple(seq)

    # ---------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        """Plain BPE ids of ``text`` (special-token strings in it are not interpreted)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ordinary tokens in ``ids`` (special and timestamp tokens dropped)."""
        return self._tok.decode([int(t) for t in ids if t < self.eot], skip_special_tokens=False)

    def decode_with_timestamps(self, ids: Iterable[int]) -> str:
        """Text with special tokens spelt out and timestamps rendered as ``<|1.08|>``."""
        out: list[str] = []
        run: list[int] = []
        for t in ids:
            t = int(t)
            if t >= self.timestamp_begin:
                if run:
                    out.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                out.append(f"<|{(t - self.timestamp_begin) * TIME_PRECISION:.2f}|>")
            else:
                run.append(t)
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)

    @functools.cached_property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Ids to suppress so the model does not emit speaker tags, music notes or annotations
        such as "( SPEAKING FOREIGN LANGUAGE )", while ordinary punctuation stays allowed."""
        singles = '"#()*+/:;<=>@[\\]^_`{|}~「」『』'
        multi = "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        # music symbols (U+2640..U+267F): several tokens in some vocabularies; their first token
        # is shared by the whole block, so suppressing it is safe.
        music = "♩♪♫♬♭♮♯"
        found = {self.encode(" -")[0], self.encode(" '")[0]}
        for sym in [*singles, *multi, *music]:
            for variant in (sym, " " + sym):
                ids = self.encode(variant)
                if len(ids) == 1 or sym in music:
                    found.add(ids[0])
        return tuple(sorted(found))

    # ---------------------------------------------------------------- words
    def split_to_word_tokens(
        self, tokens: Sequence[int], language: str | None = None
    ) -> tuple[list[str], list[list[int]]]:
        """Group ``tokens`` into words: at spaces and punctuation, or at every complete unicode
        character for languages written without spaces (zh, ja, th, lo, my, yue)."""
        if language in NO_SPACE_LANGUAGES:
            return self._split_on_unicode(tokens)
        return self._split_on_spaces(tokens)

    def _split_on_unicode(self, tokens: Sequence[int]) -> tuple[list[str], list[list[int]]]:
        full = self.decode_with_timestamps(tokens)
        words: list[str] = []
        groups: list[list[int]] = []
        pending: list[int] = []
        offset = 0
        for t in tokens:
            pending.append(int(t))
            text = self.decode_with_timestamps(pending)
            bad = text.find("\ufffd")
            # emit once the pending bytes form whole characters (or the replacement character is
            # genuinely part of the full text)
            if bad < 0 or (offset + bad < len(full) and full[offset + bad] == "\ufffd"):
                words.append(text)
                groups.append(pending)
                pending = []
                offset += len(text)
        return words, groups

    def _split_on_spaces(self, tokens: Sequence[int]) -> tuple[list[str], list[list[int]]]:
        sub_words, sub_groups = self._split_on_unicode(tokens)
        words: list[str] = []
        groups: list[list[int]] = []
        for sub, group in zip(sub_words, sub_groups, strict=False):
            starts_word = (
                group[0] >= self.eot
                or sub.startswith(" ")
                or sub.strip() in string.punctuation
                or not words
            )
            if starts_word:
                words.append(sub)
                groups.append(list(group))
            else:
                words[-1] += sub
                groups[-1].extend(group)
        return words, groups


# --------------------------------------------------------------------------- tiktoken assets
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges in priority order from tiktoken ranks: a multi-byte token of rank r is the
    merge of the two pieces that byte-pair encoding with only lower-ranked tokens leaves."""
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_i, best_rank = -1, rank
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best_i, best_rank = i, r
            if best_i < 0:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            merges.append((rank, parts[0], parts[1]))
    merges.sort()
    return [(a, b) for _, a, b in merges]


def _openai_asset(name: str) -> Path | None:
    """Path of ``whisper/assets/<name>`` in an installed openai-whisper (found without importing
    it, which would import torch)."""
    try:
        spec = importlib.util.find_spec("whisper")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / "assets" / name
        if candidate.is_file():
            return candidate
    return None
