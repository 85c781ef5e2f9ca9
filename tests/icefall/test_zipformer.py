"""icefall Zipformer: loading as released, hyper-parameter inference, encoder and decoding parity
against icefall's own code (the PyPI package ``zipformer``, run in the test on the same random
weights), word timestamps, the engine's offline path, averaging and errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from oasr.checkpoint import load_model
from oasr.decoders import transducer_greedy_search
from oasr.errors import CheckpointError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig

LOG_EPS = math.log(1e-10)
VOCAB = 40


@pytest.fixture(autouse=True, scope="module")
def _helpers(helpers):
    global build_reference, waves, write_release
    build_reference, waves, write_release = helpers.build_reference, helpers.waves, helpers.write_release
    assert helpers.VOCAB == VOCAB


def _load(path):
    return load_model(EngineConfig(ckpt_dir=str(path)))


def _assert_varied(token_lists: list[list[int]]) -> None:
    flat = [t for toks in token_lists for t in toks]
    assert len(flat) >= 15 and len(set(flat)) >= 6, token_lists


def _ref_features(model, wave_list):
    feats, lens = model.features(wave_list)
    if model.cfg.causal:
        feats = torch.nn.functional.pad(feats, (0, 0, 0, 30), value=LOG_EPS)
        lens = lens + 30
    return feats, lens


def _ref_encode(ref_model, feats, lens):
    """icefall's encoder run one utterance at a time (its padded batch lets padding reach the
    last frames of shorter rows), padded back into a batch for its searches."""
    outs = [ref_model.forward_encoder(feats[b : b + 1, :n], lens[b : b + 1]) for b, n in enumerate(lens.tolist())]
    enc = torch.nn.utils.rnn.pad_sequence([o[0][0] for o in outs], batch_first=True)
    return enc, torch.cat([o[1] for o in outs])


def test_detected_and_hyper_parameters_inferred(offline_release, causal_release) -> None:
    from oasr_models_icefall.model import ZipformerTransducer

    for ref_model, path in (offline_release, causal_release):
        model = _load(path)
        assert isinstance(model, ZipformerTransducer)
        cfg = model.cfg
        enc = ref_model.encoder
        assert cfg.downsampling_factor == tuple(enc.downsampling_factor)
        assert cfg.encoder_dim == tuple(enc.encoder_dim)
        assert cfg.num_encoder_layers == tuple(enc.num_encoder_layers)
        assert cfg.num_heads == tuple(enc.num_heads)
        assert cfg.query_head_dim == tuple(enc.query_head_dim)
        assert cfg.value_head_dim == tuple(enc.value_head_dim)
        assert cfg.cnn_module_kernel == tuple(enc.cnn_module_kernel)
        assert cfg.causal == enc.causal
        assert (cfg.vocab_size, cfg.context_size, cfg.decoder_dim) == (VOCAB, 2, 16)
        assert cfg.use_ctc and cfg.use_transducer
        assert model.capabilities.streaming == enc.causal
        assert model.tokens.pieces[0] == "<blk>"


def test_encoder_equals_icefall(offline_release, causal_release) -> None:
    """Our encoder output against icefall's AsrModel.forward_encoder on the same features: one
    utterance at a time, and our padded batch row by row (equal to icefall run alone)."""
    ws = waves(3)
    for ref_model, path in (offline_release, causal_release):
        model = _load(path)
        feats, lens = model.features(ws)
        settings = [(-1, -1)] + ([(16, 64), (32, 128)] if model.cfg.causal else [])
        for chunk, left in settings:
            if model.cfg.causal:
                ref_model.encoder.chunk_size = [chunk]
                ref_model.encoder.left_context_frames = [left]
            with torch.no_grad():
                ours, ours_lens = model.net.encode(feats, lens, chunk, left)
                for b, n in enumerate(lens.tolist()):
                    ref, ref_lens = ref_model.forward_encoder(feats[b : b + 1, :n], lens[b : b + 1])
                    alone, _ = model.net.encode(feats[b : b + 1, :n], lens[b : b + 1], chunk, left)
                    assert int(ours_lens[b]) == int(ref_lens[0])
                    m = int(ref_lens[0])
                    assert (alone[0] - ref[0]).abs().max() < 1e-4
                    if model.cfg.causal and chunk < 0:
                        continue  # icefall's full-context causal conv depends on the padded length
                    assert (ours[b, :m] - ref[0]).abs().max() < 1e-4, (chunk, b)


@pytest.mark.parametrize("beam", [1, 4])
def test_transducer_tokens_equal_icefall(ref, offline_release, causal_release, beam) -> None:
    ws = waves(3)
    for ref_model, path in (offline_release, causal_release):
        model = _load(path)
        if model.cfg.causal:
            ref_model.encoder.chunk_size = [16]
            ref_model.encoder.left_context_frames = [128]
        feats, lens = _ref_features(model, ws)
        with torch.no_grad():
            enc, enc_lens = _ref_encode(ref_model, feats, lens)
            if beam == 1:
                r = ref.search.greedy_search(ref_model, enc, enc_lens, max_sym_per_frame=1,
                                             return_timestamps=True)
            else:
                r = ref.search.modified_beam_search(ref_model, enc, enc_lens, beam=beam,
                                                    return_timestamps=True)
        ours = model.transcribe(ws, DecodingOptions(beam_size=beam, word_timestamps=True))
        got = [t.segments[0].tokens if t.segments else [] for t in ours]
        _assert_varied(r.hyps)
        assert got == [list(h) for h in r.hyps]
        for t, times in zip(ours, r.timestamps, strict=True):  # word times from emission frames
            first = t.segments[0].words[0]
            assert first.start <= (times[0] + 0.5) * 0.04 <= first.end + 1e-6


@pytest.mark.filterwarnings("ignore:max_sym_per_frame")
def test_greedy_max_symbols_and_blank_penalty_equal_icefall(ref, offline_release) -> None:
    ref_model, path = offline_release
    model = _load(path)
    ws = waves(2)
    feats, lens = _ref_features(model, ws)
    with torch.no_grad():
        enc, enc_lens = _ref_encode(ref_model, feats, lens)
        for b in range(2):
            r = ref.search.greedy_search(ref_model, enc[b : b + 1, : enc_lens[b]], enc_lens[b : b + 1],
                                         max_sym_per_frame=3, blank_penalty=0.5)
            ours = model.transcribe([ws[b]], DecodingOptions.build(max_sym_per_frame=3, blank_penalty=0.5))
            expected = list(r) if r and isinstance(r[0], int) else list(r[0])
            assert ours[0].segments[0].tokens == expected


def test_ctc_greedy_equals_icefall_and_prefix_beam(ref, offline_release) -> None:
    ref_model, path = offline_release
    model = _load(path)
    ws = waves(3)
    feats, lens = _ref_features(model, ws)
    with torch.no_grad():
        enc, enc_lens = _ref_encode(ref_model, feats, lens)
        expected = ref.search.ctc_greedy_search(ref_model.ctc_output(enc), enc_lens)
    _assert_varied(expected)
    got = model.transcribe(ws, DecodingOptions.build(decoding_method="ctc_greedy_search"))
    assert [t.segments[0].tokens for t in got] == expected
    beam = model.transcribe(ws, DecodingOptions.build(beam_size=8, decoding_method="ctc_prefix_beam_search",
                                                      word_timestamps=True))
    assert all(t.segments[0].words for t in beam)


def test_batch_results_equal_one_by_one(offline_release) -> None:
    model = _load(offline_release[1])
    ws = waves(3)
    for opts in (DecodingOptions(), DecodingOptions(beam_size=4)):
        together = model.transcribe(ws, opts)
        alone = [model.transcribe([w], opts)[0] for w in ws]
        assert [t.text for t in together] == [t.text for t in alone]


def test_ctc_only_checkpoint_is_zipformer(ref, tmp_path) -> None:
    from oasr_models_icefall.model import ZipformerCTC

    m = build_reference(ref, causal=False, use_transducer=False, seed=5)
    model = _load(write_release(tmp_path, m))
    assert isinstance(model, ZipformerCTC) and model.capabilities.decode_family.value == "ctc"
    ws = waves(2)
    feats, lens = model.features(ws)
    with torch.no_grad():
        enc, enc_lens = m.forward_encoder(feats, lens)
        expected = [h for h in torch.unique_consecutive(m.ctc_output(enc)[0].argmax(-1)[: enc_lens[0]]).tolist() if h]
    assert model.transcribe(ws[:1], DecodingOptions())[0].segments[0].tokens == expected
    with pytest.raises(UnsupportedOptionError):
        model.transcribe(ws, DecodingOptions.build(decoding_method="greedy_search"))


def test_epoch_averaging_as_icefall(ref, offline_release, tmp_path) -> None:
    """--epoch 3 --avg 2: epoch-2.pt and epoch-3.pt averaged as icefall's average_checkpoints."""
    from oasr_models_icefall.model import load_icefall

    m1 = build_reference(ref, causal=False, seed=1)
    m2 = build_reference(ref, causal=False, seed=7)
    write_release(tmp_path, m1)
    (tmp_path / "exp" / "pretrained.pt").unlink()
    # a training checkpoint also pickles the run's params (icefall's AttributeDict, paths) and
    # sampler state, whose classes need not be installed where the model is served
    import types

    fake = types.ModuleType("icefall_training_only")
    fake.Params = type("Params", (dict,), {"__module__": "icefall_training_only"})
    import sys

    sys.modules["icefall_training_only"] = fake
    try:
        torch.save({"model": m1.state_dict(), "epoch": 2, "params": fake.Params(lr=0.045),
                    "exp_dir": tmp_path}, tmp_path / "exp" / "epoch-2.pt")
    finally:
        del sys.modules["icefall_training_only"]
    torch.save({"model": m2.state_dict(), "epoch": 3}, tmp_path / "exp" / "epoch-3.pt")
    model = load_icefall(tmp_path, epoch=3, avg=2)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    key = "encoder.encoders.0.layers.0.feed_forward1.in_proj.weight"
    ours = dict(model.net.named_parameters())[key]
    assert torch.equal(ours, (sd1[key] + sd2[key]) / 2)
    assert _load(tmp_path).net.encoder_embed.out.weight.equal(sd2["encoder_embed.out.weight"])  # latest epoch


def test_bpe_model_tokens_and_errors(offline_release, tmp_path) -> None:
    from oasr_models_icefall.files import _sentencepiece_pieces

    # a sentencepiece ModelProto: repeated field 1 = SentencePiece{1: piece, 2: score}
    def piece(p: str) -> bytes:
        body = b"\x0a" + bytes([len(p.encode())]) + p.encode() + b"\x15\x00\x00\x00\x00"
        return b"\x0a" + bytes([len(body)]) + body

    assert _sentencepiece_pieces(b"".join(piece(p) for p in ["<blk>", "\u2581A", "B"]), tmp_path) == [
        "<blk>", "\u2581A", "B"]
    empty = tmp_path / "empty"
    (empty / "exp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no icefall weights"):
        from oasr_models_icefall.model import load_icefall

        load_icefall(empty)
    ref_model, path = offline_release
    no_tokens = tmp_path / "no_tokens"
    (no_tokens / "exp").mkdir(parents=True)
    (no_tokens / "exp" / "pretrained.pt").symlink_to(path / "exp" / "pretrained.pt")
    with pytest.raises(CheckpointError, match="tokens"):
        load_icefall(no_tokens)
    wrong = tmp_path / "wrong"
    write_release(wrong, ref_model, tokens=["<blk>", "a", "b"])
    with pytest.raises(CheckpointError, match="token table has 3 entries"):
        _load(wrong)


def test_engine_offline_word_timestamps(offline_release) -> None:
    from oasr.engine import ASREngine

    engine = ASREngine(EngineConfig(ckpt_dir=str(offline_release[1]), max_batch_size=4))
    try:
        ws = waves(3)
        out = engine.transcribe_arrays(ws, decoding=DecodingOptions(word_timestamps=True))
        direct = engine.model.transcribe(ws, DecodingOptions(word_timestamps=True))
        assert [t.text for t in out] == [t.text for t in direct]
        words = out[0].segments[0].words
        assert words and all(0 <= w.start <= w.end <= out[0].duration for w in words)
        assert [w.start for w in words] == sorted(w.start for w in words)
    finally:
        engine.shutdown()


def test_core_greedy_matches_our_network_adapter(offline_release) -> None:
    """The adapter the model hands the core searches (projected decoder output, -1 context)."""
    model = _load(offline_release[1])
    enc = torch.randn(1, 12, model.cfg.output_dim)
    with torch.no_grad():
        hyp = transducer_greedy_search(model.decoder_network, model.net.joiner.encoder_proj(enc))[0]
    assert len(hyp.times) == len(hyp.tokens)


@pytest.mark.parametrize("blank_penalty", [0.0, 0.7])
def test_sync_free_greedy_equals_frame_loop(offline_release, blank_penalty) -> None:
    """The core greedy search's on-device path (the CUDA default) gives the frame-by-frame
    loop's hypotheses, fed whole or in chunks."""
    model = _load(offline_release[1])
    ws = waves(3)
    feats, lens = model.features(ws)
    o = model._check(DecodingOptions())
    enc, enc_lens = model.encode_features(feats, lens, o)
    proj = model.net.joiner.encoder_proj(enc)
    with torch.no_grad():
        loop = transducer_greedy_search(model.decoder_network, proj, enc_lens, sync_free=False,
                                        blank_penalty=blank_penalty, unk_id=2)
        fast = transducer_greedy_search(model.decoder_network, proj, enc_lens, sync_free=True,
                                        blank_penalty=blank_penalty, unk_id=2)
        from oasr.decoders import TransducerGreedySearch

        chunked = TransducerGreedySearch(model.decoder_network, 3, sync_free=True,
                                         blank_penalty=blank_penalty, unk_id=2)
        for a in range(0, proj.shape[1], 7):
            n = [max(0, min(7, int(L) - a)) for L in enc_lens]
            chunked.step(proj[:, a : a + 7], n)
    _assert_varied([h.tokens for h in loop])
    for got in (fast, chunked.results()):
        for x, y in zip(loop, got, strict=True):
            assert x.tokens == y.tokens and x.times == y.times
            assert x.token_logprobs == pytest.approx(y.token_logprobs, abs=1e-5)
            assert x.score == pytest.approx(y.score, abs=1e-4)


def test_native_format_round_trip(offline_release, tmp_path) -> None:
    from oasr.checkpoint import convert_checkpoint
    from oasr.plugins import get_registry

    assert get_registry("architecture").get("transducer").distribution == "oasr-models-icefall"
    assert get_registry("architecture").get("zipformer_ctc").key == "zipformer"
    src = offline_release[1]
    convert_checkpoint(src, tmp_path / "native")
    a, b = _load(src), _load(tmp_path / "native")
    assert b.source_format == "oasr" and type(a) is type(b)
    for (k, x), (k2, y) in zip(a.net.state_dict().items(), b.net.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(x, y)
    ws = waves(2)
    assert [t.text for t in a.transcribe(ws, DecodingOptions(beam_size=4))] == \
        [t.text for t in b.transcribe(ws, DecodingOptions(beam_size=4))]


def test_use_averaged_model_equals_icefall(ref, tmp_path) -> None:
    """--epoch 3 --avg 2 --use-averaged-model: the running averages of epoch-1.pt and
    epoch-3.pt combined as icefall's average_checkpoints_with_averaged_model (the zipformer
    package's utils/checkpoint.py, loaded from its file) computes them."""
    import importlib.util

    from oasr_models_icefall.model import load_icefall

    spec = importlib.util.find_spec("zipformer")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "checkpoint.py"
    mspec = importlib.util.spec_from_file_location("icefall_checkpoint_reference", path)
    reference = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(reference)
    m1, m3 = build_reference(ref, causal=False, seed=1), build_reference(ref, causal=False, seed=7)
    avg1, avg3 = build_reference(ref, causal=False, seed=8), build_reference(ref, causal=False, seed=9)
    write_release(tmp_path, m1)
    (tmp_path / "exp" / "pretrained.pt").unlink()
    for n, m, a, idx in ((1, m1, avg1, 1100), (3, m3, avg3, 3350)):
        torch.save({"model": m.state_dict(), "model_avg": a.state_dict(), "batch_idx_train": idx,
                    "average_period": 200}, tmp_path / "exp" / f"epoch-{n}.pt")
    expected = reference.average_checkpoints_with_averaged_model(
        str(tmp_path / "exp" / "epoch-1.pt"), str(tmp_path / "exp" / "epoch-3.pt"))
    model = load_icefall(tmp_path, epoch=3, avg=2, use_averaged_model=True)
    ours = dict(model.net.named_parameters())
    for key in ("encoder.encoders.0.layers.0.feed_forward1.in_proj.weight", "joiner.output_linear.bias"):
        assert torch.equal(ours[key], expected[key])
    plain = reference.average_checkpoints([str(tmp_path / "exp" / f"epoch-{n}.pt") for n in (1, 3)])
    assert not torch.equal(plain["joiner.output_linear.bias"], expected["joiner.output_linear.bias"])


def test_bias_norm_half_keeps_float32_statistics() -> None:
    """BiasNorm in fp16: the statistics accumulate in float32 (as icefall's autocast), so
    activations whose squares overflow fp16 (|x| ~ 3000) still give icefall's float32 formula
    within fp16 rounding."""
    from oasr_models_icefall.nn import BiasNorm

    torch.manual_seed(0)
    norm = BiasNorm(256)
    with torch.no_grad():
        norm.bias.normal_()
        norm.log_scale.fill_(0.3)
        x = torch.randn(4, 10, 256) * 3000
        ref = x * ((x - norm.bias).pow(2).mean(-1, keepdim=True) ** -0.5 * norm.log_scale.exp())
        assert (norm(x) - ref).abs().max() < 1e-5
        out = norm.half()(x.half()).float()
    assert torch.isfinite(out).all()
    assert ((out - ref).abs() / ref.abs().clamp_min(0.05)).max() < 4e-3


def test_equal_length_batch_skips_padding_masks(offline_release, causal_release) -> None:
    """Inputs of one length encode without padding masks (``uniform``): bit-equal to the masked
    path on the same batch, and transcribe gives the one-by-one tokens."""
    ws = waves(3)
    ws = [w[: min(len(x) for x in ws)] for w in ws]
    for _, path in (offline_release, causal_release):
        model = _load(path)
        feats, lens = model.features(ws)
        o = model._check(DecodingOptions())
        masked, _ = model.encode_features(feats, lens, o)
        fast, _ = model.encode_features(feats, lens, o, uniform=True)
        assert torch.equal(masked, fast)
        batch = [t.segments[0].tokens if t.segments else [] for t in model.transcribe(ws, DecodingOptions())]
        alone = [model.transcribe([w], DecodingOptions())[0] for w in ws]
        assert batch == [t.segments[0].tokens if t.segments else [] for t in alone]
