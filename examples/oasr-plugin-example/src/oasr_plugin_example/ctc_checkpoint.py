"""The ``example-ctc`` checkpoint format: one directory holding

* ``example_ctc.json``: the network's shape, the fbank settings and the decoding defaults
  (:class:`CTCConfig`);
* ``model.safetensors``: the weights (names are the ``state_dict`` of
  :class:`oasr_plugin_example.ctc_network.ExampleCTCNet`);
* ``units.txt``: one output unit per line, line ``i`` is token id ``i`` (id 0 is ``<blank>``);
  sentencepiece-style pieces, ``▁`` starts a word.

This module is what OASR imports to *detect* the format, for every checkpoint it opens, so it
imports neither torch nor the model at module level; :meth:`ExampleCTCFormat.load` does.
:func:`write_random_checkpoint` makes a small random-weight checkpoint to try the plugin with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oasr.errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

    from oasr.types import EngineConfig
    from oasr_plugin_example.ctc_model import ExampleCTC

CONFIG_NAME = "example_ctc.json"
WEIGHTS_NAME = "model.safetensors"
UNITS_NAME = "units.txt"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CTCConfig:
    """Everything ``example_ctc.json`` holds besides ``format_version``."""

    num_mel_bins: int = 80
    sample_rate: int = 16000
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 128
    conv_kernel: int = 7  # causal depthwise convolution: kernel - 1 frames of left context
    vocab_size: int = 32
    blank_id: int = 0
    #: encoder frames (40 ms each after x4 subsampling) attended as one block; the stream's chunk
    chunk_size: int = 4
    #: chunks of left context each chunk attends to; -1: all
    num_left_chunks: int = -1
    #: a new segment starts where two tokens are further apart than this (seconds)
    segment_gap: float = 1.0
    #: what the transcripts report as their language (None: unknown)
    language: str | None = "en"

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise CheckpointError(
                f"{CONFIG_NAME}: d_model {self.d_model} is not divisible by num_heads {self.num_heads}"
            )
        if self.chunk_size < 1 or self.num_left_chunks < -1:
            raise CheckpointError(f"{CONFIG_NAME}: chunk_size must be >= 1 and num_left_chunks >= -1")
        if not 0 <= self.blank_id < self.vocab_size:
            raise CheckpointError(f"{CONFIG_NAME}: blank_id {self.blank_id} is not a unit id")

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CTCConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known - {"format_version"})
        if unknown:
            raise CheckpointError(f"{CONFIG_NAME} has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in body.items() if k in known})


def read_config(path: Path) -> CTCConfig:
    try:
        body = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / CONFIG_NAME} is unreadable: {exc}") from exc
    if body.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / CONFIG_NAME} has format_version {body.get('format_version')!r}; this plugin "
            f"reads version {FORMAT_VERSION}"
        )
    return CTCConfig.from_json(body)


def read_units(path: Path) -> list[str]:
    try:
        lines = (path / UNITS_NAME).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CheckpointError(f"{path / UNITS_NAME} is unreadable: {exc}") from exc
    return [line.rstrip("\r") for line in lines]


def write_checkpoint(dst: str | Path, config: CTCConfig, state: dict[str, Any], units: list[str]) -> Path:
    """Write a checkpoint directory from a config, a ``state_dict`` and the unit table."""
    from safetensors.torch import save_file

    if len(units) != config.vocab_size:
        raise CheckpointError(f"{len(units)} units for a vocabulary of {config.vocab_size}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    body = {"format_version": FORMAT_VERSION, **asdict(config)}
    (dst / CONFIG_NAME).write_text(json.dumps(body, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(dst / WEIGHTS_NAME))
    (dst / UNITS_NAME).write_text("".join(u + "\n" for u in units), encoding="utf-8")
    return dst


#: units of the random checkpoint: blank, then word-initial and word-internal letters
DEMO_UNITS = ["<blank>"] + [f"\u2581{c}" for c in "aeiost"] + list("abcdeghiklmnoprstuwy") + list("'fjvz")


def demo_audio(seed: int, seconds: float, sample_rate: int = 16000) -> np.ndarray:
    """A seeded speech-like test signal (mono float32): a harmonic voice with a gliding pitch,
    syllable-rate amplitude bursts and a little noise. Different seeds sound different."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    f0 = rng.uniform(100, 160) + 60 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(2, 4) * t + rng.uniform(0, 6)), 0, None)
    x = voice * syllables + 0.05 * rng.standard_normal(n)
    return (0.3 * x / max(float(np.abs(x).max()), 1e-9)).astype(np.float32)


def write_random_checkpoint(dst: str | Path, seed: int = 0, config: CTCConfig | None = None) -> Path:
    """A random-weight checkpoint (seeded: the same ``seed`` writes the same weights).

    Untrained weights emit the same one or two units everywhere: the encoder's output is
    dominated by a constant direction. So the output layer is calibrated on :func:`demo_audio`
    and on silence: each unit's logit reads the encoder output's *deviation* from its mean over
    speech frames (scaled per channel); the blank's logit reads how much a frame looks like
    silence, with a bias that makes it win on half the speech frames. The units then vary with
    the audio, pauses decode as blank (so transcripts have segments), and streaming, batching
    and timestamps have something to show. The text means nothing."""
    import numpy as np
    import torch

    from oasr_plugin_example.ctc_model import ExampleCTC
    from oasr_plugin_example.ctc_network import ExampleCTCNet

    config = config or CTCConfig(vocab_size=len(DEMO_UNITS))
    units = DEMO_UNITS if config.vocab_size == len(DEMO_UNITS) else (
        ["<blank>"] + [f"<{i}>" for i in range(1, config.vocab_size)]
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = ExampleCTCNet(config).eval()
    model = ExampleCTC(net, units)
    with torch.no_grad():
        for name, value in net.named_parameters():
            if name.endswith(("pos_bias_u", "pos_bias_v")):
                value.copy_(0.1 * torch.randn(value.shape, generator=generator))
        # log fbank of speech-level audio (samples in [-1, 1]) sits around -5 +- 3
        net.cmvn_mean.fill_(-5.0)
        net.cmvn_istd.fill_(1 / 3)
        speech = [demo_audio(seed + 1000 + k, 3.0, config.sample_rate) for k in range(4)]
        quiet = np.random.default_rng(seed).standard_normal(2 * config.sample_rate).astype(np.float32)
        silence = [0.003 * quiet, np.zeros_like(quiet)]
        speech_h, silence_h = (_hidden(model, waves) for waves in (speech, silence))
        mean, std = speech_h.mean(0), speech_h.std(0).clamp_min(1e-3)
        weight = 3.0 * net.ctc.weight / std
        bias = -weight @ mean
        # the blank reads how much a frame looks like silence: 0 on average speech, 1 on silence
        towards_silence = silence_h.mean(0) - mean
        weight[config.blank_id] = 20.0 * towards_silence / towards_silence.square().sum()
        bias[config.blank_id] = 0.0
        logits = speech_h @ weight.T + bias
        non_blank = torch.ones(config.vocab_size, dtype=torch.bool)
        non_blank[config.blank_id] = False
        margin = logits[:, non_blank].max(dim=-1).values - logits[:, config.blank_id]
        bias[config.blank_id] = margin.median()  # blank wins on half the speech frames
        net.ctc.weight.copy_(weight)
        net.ctc.bias.copy_(bias)
    return write_checkpoint(dst, config, net.state_dict(), units)


def _hidden(model: ExampleCTC, waves: list[np.ndarray]) -> Any:
    """The normalised encoder output of ``waves`` (offline), their valid frames concatenated."""
    import torch

    net = model.net
    feats, flens = model.fbank.extract([torch.from_numpy(w) for w in waves])
    hidden, lens = net.encode(feats, flens, net.config.chunk_size, net.config.num_left_chunks)
    return net.norm_out(torch.cat([hidden[b, : lens[b]] for b in range(len(waves))]))


class ExampleCTCFormat:
    """Detects and loads the ``example-ctc`` format (see the module docstring)."""

    @staticmethod
    def detect(path: Path) -> bool:
        return path.is_dir() and (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()

    @staticmethod
    def load(path: Path, config: EngineConfig) -> ExampleCTC:
        from oasr_plugin_example.ctc_model import ExampleCTC

        return ExampleCTC.from_checkpoint(path, config)
