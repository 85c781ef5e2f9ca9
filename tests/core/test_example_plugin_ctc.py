"""The example plugin's ``example_ctc``: a new family written against oasr-core alone (issue #13).

The plugin is registered in memory (``temporary_plugin``), a random-weight checkpoint is written
with its own helper, and the model is served by core's machinery only: offline through the
engine's batch executor, streaming through the streaming scheduler."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.plugins import get_plugin_manager, get_registry, reset_plugin_manager, temporary_plugin
from oasr.types import DecodingOptions, EngineConfig, Transcript

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SRC = REPO / "examples" / "oasr-plugin-example" / "src"
RATE = 16000


@pytest.fixture(scope="module")
def plugin() -> Iterator[None]:
    """The example plugin's hook module, registered for this module's tests (one torch thread:
    the model is tiny, and on a busy 2-core runner two threads spin against each other)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE_SRC))
        reset_plugin_manager()
        if "oasr-plugin-example" in get_plugin_manager().plugins:  # pip-installed here
            yield
        else:
            with temporary_plugin("oasr_plugin_example.plugin", name="oasr-plugin-example"):
                yield
        reset_plugin_manager()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(plugin: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from oasr_plugin_example.ctc_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("example_ctc"), seed=0)


@pytest.fixture(scope="module")
def audios(plugin: None) -> list[np.ndarray]:
    from oasr_plugin_example.ctc_checkpoint import demo_audio

    pause = np.zeros(int(1.5 * RATE), np.float32)
    return [
        demo_audio(1, 2.0),
        np.concatenate([demo_audio(2, 1.2), pause, demo_audio(3, 1.0)]),  # two segments
        demo_audio(4, 0.7),
        demo_audio(5, 3.1),
        demo_audio(6, 0.02),  # shorter than one encoder frame
    ]


@pytest.fixture(scope="module")
def offline(ckpt: Path) -> object:
    from oasr.engine import ASREngine

    return ASREngine(EngineConfig(ckpt_dir=str(ckpt)))


@pytest.fixture(scope="module")
def streaming(ckpt: Path) -> object:
    from oasr.engine import ASREngine

    return ASREngine(EngineConfig(ckpt_dir=str(ckpt), service_mode="streaming", max_batch_size=3))


def _same(a: Transcript, b: Transcript) -> None:
    """Equal transcripts: text, tokens and times exactly; confidences to float rounding (a
    chunk's attention sums over fewer padded keys than the whole utterance's)."""
    assert a.text == b.text
    assert (a.duration, a.language) == (b.duration, b.language)
    assert [(s.start, s.end, s.text, s.tokens) for s in a.segments] == [
        (s.start, s.end, s.text, s.tokens) for s in b.segments
    ]
    assert [(w.word, w.start, w.end) for w in a.words] == [(w.word, w.start, w.end) for w in b.words]
    assert [w.confidence for w in a.words] == pytest.approx([w.confidence for w in b.words], abs=1e-4)
    assert [s.avg_logprob for s in a.segments] == pytest.approx([s.avg_logprob for s in b.segments], abs=1e-4)


def _stream(engine, audios: list[np.ndarray], options: DecodingOptions, seed: int = 0):  # noqa: ANN001, ANN202
    """Feed every audio as a concurrent stream in uneven chunks, stepping as it goes; returns
    the final transcripts in order and the partial updates seen per stream."""
    rng = np.random.default_rng(seed)
    rids = [engine.add_streaming_request(options) for _ in audios]
    sent = [0] * len(audios)
    partials: dict[str, list[str]] = {r: [] for r in rids}
    finals: dict[str, Transcript] = {}

    def collect(outputs) -> None:  # noqa: ANN001
        for out in outputs:
            if out.is_final:
                finals[out.request_id] = out.transcript
            else:
                partials[out.request_id].append(out.text)

    while any(s < len(a) for s, a in zip(sent, audios, strict=True)):
        for k, (rid, audio) in enumerate(zip(rids, audios, strict=True)):
            if sent[k] < len(audio):
                n = int(rng.integers(1, 7000))
                engine.feed_chunk(rid, audio[sent[k] : sent[k] + n], is_last=sent[k] + n >= len(audio))
                sent[k] += n
        collect(engine.step())
    while outputs := engine.step():
        collect(outputs)
    return [finals[r] for r in rids], [partials[r] for r in rids]


# -- registration and checkpoint ----------------------------------------------------------------


def test_registered_through_the_hooks_with_capabilities_declared_once(plugin: None) -> None:
    from oasr_plugin_example.ctc_model import ExampleCTC
    from oasr_plugin_example.plugin import CTC_CAPABILITIES

    spec = get_registry("architecture").get("example_ctc")
    assert spec.distribution == "oasr-plugin-example"
    assert spec.capabilities == CTC_CAPABILITIES and ExampleCTC.capabilities is CTC_CAPABILITIES
    assert (CTC_CAPABILITIES.streaming, CTC_CAPABILITIES.word_timestamps) == (True, True)
    assert spec.load() is ExampleCTC
    fmt = get_registry("checkpoint_format").get("example-ctc")
    assert fmt.metadata["architecture"] == "example_ctc"


def test_written_against_core_alone() -> None:
    """No import of another model family anywhere in the plugin."""
    for path in (EXAMPLE_SRC / "oasr_plugin_example").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), re.M)
        foreign = [m for m in imports if m.startswith("oasr_") and not m.startswith("oasr_plugin_example")]
        assert not foreign, f"{path.name} imports {foreign}"


def test_hook_and_format_modules_do_not_import_torch() -> None:
    code = (
        "import sys; import oasr_plugin_example.plugin, oasr_plugin_example.ctc_checkpoint as c, "
        "oasr_plugin_example.ctc_options; from pathlib import Path; "
        "assert not c.ExampleCTCFormat.detect(Path('.')); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {"PYTHONPATH": str(EXAMPLE_SRC), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_random_checkpoint_is_seeded_and_detected(ckpt: Path, tmp_path: Path) -> None:
    from oasr.checkpoint import detect_format
    from oasr_plugin_example.ctc_checkpoint import (
        CONFIG_NAME,
        UNITS_NAME,
        WEIGHTS_NAME,
        write_random_checkpoint,
    )

    assert sorted(p.name for p in ckpt.iterdir()) == sorted([CONFIG_NAME, UNITS_NAME, WEIGHTS_NAME])
    assert detect_format(ckpt) == "example-ctc"
    body = json.loads((ckpt / CONFIG_NAME).read_text())
    assert (body["format_version"], body["d_model"], body["num_layers"]) == (1, 64, 2)
    again = write_random_checkpoint(tmp_path / "again", seed=0)
    assert (again / WEIGHTS_NAME).read_bytes() == (ckpt / WEIGHTS_NAME).read_bytes()
    other = write_random_checkpoint(tmp_path / "other", seed=1)
    assert (other / WEIGHTS_NAME).read_bytes() != (ckpt / WEIGHTS_NAME).read_bytes()


def test_a_units_file_of_another_checkpoint_is_refused(ckpt: Path, tmp_path: Path) -> None:
    import shutil

    from oasr.engine import ASREngine

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "units.txt").write_text("<blank>\na\nb\n")
    with pytest.raises(CheckpointError, match="units.txt does not belong"):
        ASREngine(EngineConfig(ckpt_dir=str(bad)))


def test_engine_dtype_is_honoured(ckpt: Path, audios) -> None:  # noqa: ANN001
    import torch

    from oasr.engine import ASREngine

    engine = ASREngine(EngineConfig(ckpt_dir=str(ckpt), dtype="bfloat16"))
    assert engine.model.dtype is torch.bfloat16
    assert engine.transcribe(audios[0]).text
    with pytest.raises(InvalidRequestError, match="dtype"):
        ASREngine(EngineConfig(ckpt_dir=str(ckpt), dtype="int3"))


# -- offline through the batch executor -----------------------------------------------------------


def test_offline_transcripts_are_varied_with_segments_and_word_times(offline, audios) -> None:  # noqa: ANN001
    from oasr.scheduler import BatchExecutor

    outs = offline.transcribe(audios, DecodingOptions(word_timestamps=True))
    assert isinstance(offline.scheduler.executor, BatchExecutor)  # core's, not the plugin's
    *spoken, tiny = outs
    assert tiny.text == "" and tiny.segments == []
    for audio, out in zip(audios, spoken, strict=False):
        assert out.text and out.language == "en"
        assert out.duration == pytest.approx(len(audio) / RATE)
        assert len(set(out.text.replace(" ", ""))) >= 4, out.text  # not one unit repeated
        times = [t for w in out.words for t in (w.start, w.end)]
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= out.duration
        assert all(0 < w.confidence <= 1 for w in out.words)
        assert out.text == " ".join(s.text for s in out.segments)
    assert len({o.text for o in spoken}) == len(spoken)
    paused = spoken[1]
    assert len(paused.segments) == 2  # the 1.5 s pause decodes as blank
    first, second = paused.segments
    assert first.start < 1.2 < 2.7 <= second.end and second.start - first.end >= 0.4


def test_batched_equals_one_by_one(offline, audios) -> None:  # noqa: ANN001
    options = DecodingOptions(word_timestamps=True)
    together = offline.transcribe_arrays(audios, options)
    for audio, batched in zip(audios, together, strict=True):
        _same(offline.transcribe_arrays([audio], options)[0], batched)


def test_family_options_are_declared_checked_and_used(offline, audios) -> None:  # noqa: ANN001
    from oasr_plugin_example.ctc_options import ExampleCTCOptions

    model = offline.model
    assert model.default_options == ExampleCTCOptions(chunk_size=4, num_left_chunks=-1, blank_penalty=0.0)
    base = offline.transcribe(audios[3]).text
    eager = offline.transcribe(audios[3], DecodingOptions.build(blank_penalty="3")).text
    assert len(eager.replace(" ", "")) > len(base.replace(" ", ""))  # more tokens survive
    with pytest.raises(UnsupportedOptionError, match="blank_penalty"):
        offline.transcribe(audios[0], DecodingOptions.build(patience=2))
    with pytest.raises(InvalidRequestError, match="chunk_size"):
        offline.transcribe(audios[0], DecodingOptions.build(chunk_size=0))
    with pytest.raises(UnsupportedOptionError):
        offline.transcribe(audios[0], DecodingOptions(task="translate"))


# -- streaming through the streaming scheduler ----------------------------------------------------


def test_streams_fed_unevenly_equal_offline(offline, streaming, audios) -> None:  # noqa: ANN001
    options = DecodingOptions(word_timestamps=True)
    finals, partials = _stream(streaming, audios, options)
    for want, got in zip(offline.transcribe_arrays(audios, options), finals, strict=True):
        _same(got, want)
    # text arrived before the end, growing as the stream went
    assert any(p for p in partials[3])
    assert all(len(a) <= len(b) for a, b in zip(partials[3], partials[3][1:], strict=False))
    # the engine's whole-input path goes through the same scheduler
    assert [t.text for t in streaming.transcribe(audios)] == [t.text for t in finals]


@pytest.mark.parametrize("options", [
    DecodingOptions(beam_size=3),
    DecodingOptions.build(chunk_size=2, num_left_chunks=1, blank_penalty=1.0, word_timestamps=True),
])  # fmt: skip
def test_streams_equal_offline_with_beam_search_and_options(offline, streaming, audios, options) -> None:  # noqa: ANN001
    finals, _ = _stream(streaming, audios[:4], options, seed=1)
    for want, got in zip(offline.transcribe_arrays(audios[:4], options), finals, strict=True):
        _same(got, want)


def test_streams_with_different_options_share_steps(offline, streaming, audios) -> None:  # noqa: ANN001
    """Rows of one batched step may have different chunk sizes and contexts."""
    per_stream = [DecodingOptions.build(chunk_size=c, num_left_chunks=left) for c, left in ((2, 0), (5, -1), (3, 2))]
    rids = [streaming.add_streaming_request(o) for o in per_stream]
    for rid, audio in zip(rids, audios[:3], strict=True):
        for part in np.array_split(audio, 5):
            streaming.feed_chunk(rid, part)
        streaming.feed_chunk(rid, None, is_last=True)
    finals = streaming.run()
    for rid, audio, options in zip(rids, audios, per_stream, strict=False):
        _same(finals[rid], offline.transcribe_arrays([audio], options)[0])


# -- the CLI ---------------------------------------------------------------------------------------


def test_oasr_models_lists_it(plugin: None) -> None:
    from typer.testing import CliRunner

    from oasr.cli.main import app

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads(result.output) if r["architecture"] == "example_ctc")
    assert (row["installed"], row["distribution"], row["source_formats"]) == (True, "oasr-plugin-example", ["example-ctc"])
    assert (row["decode_family"], row["streaming"], row["word_timestamps"]) == ("ctc", True, True)


def test_checkpoint_command_writes_a_loadable_checkpoint(plugin: None, tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from oasr.engine import ASREngine
    from oasr_plugin_example import plugin as hooks

    cli = typer.Typer()
    hooks.register_commands(cli=cli)
    result = CliRunner().invoke(cli, ["example-ctc-checkpoint", str(tmp_path / "ck"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    engine = ASREngine(EngineConfig(ckpt_dir=str(tmp_path / "ck")))
    assert engine.model.name == "example_ctc 2x64"
