"""The FastConformer tokenizer for decoding: id -> SentencePiece piece -> text.

Read from whichever file the checkpoint carries, with no sentencepiece / tokenizers dependency
(inference only decodes):

* ``tokenizer.model``: a SentencePiece ``ModelProto`` (NeMo's ``*_tokenizer.model``; parsed here
  from its protobuf wire format: field 1 holds the pieces, each with its piece string (1), score
  (2) and type (3));
* ``tokenizer.json``: the Hugging Face ``tokenizers`` file ``transformers`` writes (Unigram: a
  ``[piece, score]`` list; BPE / WordPiece: a piece -> id map), plus its ``added_tokens``;
* ``vocab.txt`` (NeMo's ``*_vocab.txt``, one piece per line) as a last resort.

Decoding follows SentencePiece: control pieces (``<s>``, ``</s>``, ``<pad>``) produce nothing,
``<0xNN>`` byte pieces are joined into UTF-8, ``▁`` becomes a space.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from oasr.errors import CheckpointError

WORD_BOUNDARY = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message; value is bytes for
    length-delimited fields, an int for varints, raw bytes for fixed32 / fixed64."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def read_sentencepiece_model(path: Path | bytes, name: str = "") -> tuple[list[str], list[int]]:
    """Pieces and their types from a SentencePiece ``.model`` file (or its bytes)."""
    try:
        if isinstance(path, bytes):
            data, path = path, Path(name or "tokenizer.model")
        else:
            data = Path(path).read_bytes()
        pieces, types = [], []
        for field, wire, value in _fields(data):
            if field != 1 or wire != 2:
                continue
            piece, kind = "", NORMAL
            for f2, w2, v2 in _fields(value):
                if f2 == 1 and w2 == 2:
                    piece = v2.decode("utf-8")
                elif f2 == 3 and w2 == 0:
                    kind = int(v2)
                elif f2 == 2 and w2 == 5:
                    struct.unpack("<f", v2)  # the score: validated, not needed to decode
            pieces.append(piece)
            types.append(kind)
    except (OSError, ValueError, IndexError, UnicodeDecodeError, struct.error) as exc:
        raise CheckpointError(f"{path} is not a readable SentencePiece model: {exc}") from exc
    if not pieces:
        raise CheckpointError(f"{path} holds no SentencePiece pieces")
    return pieces, types


def read_tokenizer_json(path: Path) -> tuple[list[str], list[int]]:
    try:
        body = json.loads(Path(path).read_text())
        model = body["model"]
        vocab = model["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable tokenizer.json: {exc}") from exc
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = [str(p[0]) for p in vocab]
    else:  # BPE / WordPiece: {piece: id}
        pieces = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for piece, i in vocab.items():
            pieces[int(i)] = piece
    types = [NORMAL] * len(pieces)
    for tok in body.get("added_tokens") or []:
        i = int(tok["id"])
        if i >= len(pieces):
            pieces += [""] * (i + 1 - len(pieces))
            types += [NORMAL] * (i + 1 - len(types))
        pieces[i] = tok["content"]
        types[i] = CONTROL if tok.get("special") else USER_DEFINED
    for i, p in enumerate(pieces):
        if _BYTE_PIECE.match(p) and types[i] == NORMAL:
            types[i] = BYTE
    return pieces, types


class SentencePieceDecoder:
    """id -> text for a SentencePiece vocabulary (ids past the vocabulary, e.g. the transducer's
    blank, decode to nothing)."""

    def __init__(self, pieces: Sequence[str], types: Sequence[int] | None = None) -> None:
        self.pieces = list(pieces)
        self.types = list(types) if types is not None else [
            CONTROL if p in ("<s>", "</s>", "<pad>") else
            UNKNOWN if p == "<unk>" else BYTE if _BYTE_PIECE.match(p) else NORMAL
            for p in self.pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def piece(self, i: int) -> str:
        if 0 <= i < len(self.pieces) and self.types[i] not in (CONTROL, UNUSED):
            return self.pieces[i]
        return ""

    def decode(self, ids: Sequence[int]) -> str:
        return self.text(self.decode_bytes(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytearray:
        """The UTF-8 bytes of ``ids`` before :meth:`text` (``decode(a + b) ==
        text(decode_bytes(a) + decode_bytes(b))``: a stream appends its new tokens' bytes)."""
        out = bytearray()
        for i in ids:
            if not 0 <= i < len(self.pieces):
                continue
            kind = self.types[i]
            if kind in (CONTROL, UNUSED):
                continue
            if kind == UNKNOWN:
                out += " \u2047 ".encode()
                continue
            m = _BYTE_PIECE.match(self.pieces[i]) if kind == BYTE else None
            if m:
                out.append(int(m.group(1), 16))
            else:
                out += self.pieces[i].encode("utf-8")
        return out

    @staticmethod
    def text(raw: bytes | bytearray) -> str:
        """Text of :meth:`decode_bytes` output (word boundaries as single spaces)."""
        text = raw.decode("utf-8", errors="replace").replace(WORD_BOUNDARY, " ")
        return re.sub(r" +", " ", text).strip()


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "vocab.txt")


def load_tokenizer(path: Path) -> SentencePieceDecoder:
    """The decoder of a checkpoint directory (``tokenizer.model``, ``tokenizer.json`` or
    ``vocab.txt``, in that order; ``*_tokenizer.model`` / ``*_vocab.txt`` as NeMo names them)."""
    path = Path(path)
    candidates = [path / "tokenizer.model", *sorted(path.glob("*tokenizer.model"))]
    for f in candidates:
        if f.is_file():
            return SentencePieceDecoder(*read_sentencepiece_model(f))
    if (path / "tokenizer.json").is_file():
        return SentencePieceDecoder(*read_tokenizer_json(path / "tokenizer.json"))
    for f in [path / "vocab.txt", *sorted(path.glob("*vocab.txt"))]:
        if f.is_file():
            return SentencePieceDecoder([ln.split("\t")[0] for ln in f.read_text().splitlines()])
    raise CheckpointError(f"{path} has no tokenizer: add tokenizer.model (SentencePiece), "
                          f"tokenizer.json or vocab.txt")
