"""NeMo FastConformer benchmark: OASR beside ``transformers``' own Parakeet classes.

    python -m benchmarks.nemobench --device cuda                      # H200: < 3 minutes
    python -m benchmarks.nemobench --device cpu --shape tiny --batch 4 --seconds 5 --streams 2,4

Offline: Parakeet-0.6B shapes (``--shape 0.6b``: FastConformer 24 x 1024, 8 heads, FFN 4096,
x8 dw-striding subsampling with 256 channels, 128 mel bins, 1024 tokens + blank; TDT: LSTM
prediction network 2 x 640, durations 0..4), random weights, written with ``save_pretrained`` and
loaded by OASR as released. ``--batch`` inputs of ``--seconds`` seconds: OASR's
``model.transcribe`` (mel on the device, encoder, search; fp16 on CUDA) against transformers'
``generate`` on the same weights in the same dtype, given its features already on the device (its
feature extraction is not counted; ``transformers_end_to_end_s`` adds its processor, run with
``device=`` on the same device, to the call, as OASR's time includes its mel). CTC and TDT; RTFx = audio seconds / wall seconds (best of
``--repeats`` after a warm-up) and the speedup. Both decode the same greedy tokens (reported:
``same_tokens`` on the first ``--check`` inputs).

Streaming: the Nemotron streaming model at the same size (causal subsampling, LayerNorm
convolution module, left context 70 frames), ``--lookahead`` 6 (560 ms chunks), loaded once;
N streams fed one chunk of audio per tick through a streaming ``ASREngine`` (all ready at once);
p50 / p99 latency of the step that serves them all, for each N of ``--streams``; real time when
p99 <= ``--p99-target-ms`` (100). ``--find-max`` doubles N from the first count until p99 is over
the target, then bisects twice (``max_streams_held``). Each run also reports the final texts of
its first ``--check-streams`` streams against offline decoding, the cache pool's gauges, every
timed step's latency, Python's full garbage collections during the timed steps and, where core
has ``StepProfile``, the host time per step phase (per step and per stream). On CUDA the chunk step runs as CUDA
graphs (the model's default), captured for every batch bucket up to N before N is measured;
``--no-stream-graphs`` (or ``OASR_NEMO_STREAM_GRAPHS=0``) times the eager step, ``--compare-eager``
both (an H200, Parakeet-0.6B size, fp16, 560 ms chunks: graphs held 384 streams at p99 <= 100 ms,
eager 320). Random weights keep emitting at a frame once
they emit there (a trained model says blank after about one token), so this run caps
``max_symbols_per_frame`` at ``--max-symbols`` (2), as the JSON reports.

    python -m benchmarks.nemobench --device cuda --kinds none --streams 64 --find-max

Prints one JSON object (also written to ``--json``), with the transformers version.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

SHAPES = {
    "0.6b": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
             "intermediate_size": 4096, "subsampling_conv_channels": 256, "num_mel_bins": 128,
             "vocab": 1024, "decoder_hidden_size": 640},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "subsampling_conv_channels": 16, "num_mel_bins": 80,
             "vocab": 256, "decoder_hidden_size": 32},
}  # fmt: skip
SR = 16000


def _waves(n: int, seconds: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    length = int(seconds * SR)
    t = np.arange(length) / SR
    out = []
    for k in range(n):
        x = 0.05 * rng.standard_normal(length) + 0.2 * np.sin(2 * math.pi * (150 + 7 * k) * t) * (np.sin(3 * t + k) > 0)
        out.append(x.astype(np.float32))
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn, repeats: int, device: str) -> tuple[float, object]:
    out = fn()  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _encoder_config(shape: dict, **extra) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "subsampling_conv_channels", "num_mel_bins")
    return {**{k: shape[k] for k in keys}, "dropout": 0.0, "layerdrop": 0.0,
            "activation_dropout": 0.0, "attention_dropout": 0.0, **extra}


def _calibrate(model, fe, blank: int, device: str, kind: str) -> None:
    """Random encoders say nearly the same thing at every frame: centre the output layer's
    logits on a calibration input, scale them to a spread of 4 and set the blank bias so that
    about a fifth of the frames emit a token (a realistic rate for speech), the same weights for
    both engines."""
    import torch

    wave = _waves(1, 4.0, seed=99)[0]
    feats = fe([wave], sampling_rate=SR, return_tensors="pt").input_features.to(device, model.dtype)
    if kind == "ctc":
        hidden = model.encoder(input_features=feats).last_hidden_state[0].float()
        head = model.ctc_head
        weight = head.weight.float()[..., 0]
    else:
        enc = model.get_audio_features(input_features=feats).pooler_output[0].float()
        # the decoder after blank and after a few tokens: every state should prefer blank alike
        ids = torch.tensor([blank, *range(1, blank, max(1, blank // 15))], device=device)
        dec = model.decoder(ids[:, None])[:, 0].float()
        hidden = model.joint.activation(enc[:, None] + dec[None]).reshape(-1, dec.shape[-1])
        head = model.joint.head
        weight = head.weight.float()
    _set_output_bias(head, hidden, blank, device, weight)


def _set_output_bias(head, hidden, blank: int, device: str, weight=None) -> None:  # noqa: ANN001
    import torch

    weight = head.weight.float() if weight is None else weight
    vocab = blank + 1
    logits = hidden @ weight[:vocab].T
    bias = -logits.mean(0)
    scale = 4.0 / float((logits + bias).std())
    bias = bias * scale
    logits = (logits + bias / scale) * scale
    best_token = logits[:, :blank].max(-1).values
    bias[blank] += float(torch.quantile(best_token - logits[:, blank], 0.8))
    full = torch.zeros(head.bias.shape[0], device=device)
    full[:vocab] = bias
    full[vocab:] = -50.0  # TDT durations: below every token (see tests/nemo) ...
    if head.bias.shape[0] > vocab:
        full[vocab] = -56.0  # ... and duration 0 rare, as in trained models
    with torch.no_grad():
        head.weight.mul_(scale)
        if head.bias.shape[0] > vocab:  # keep the duration rows' spread as it was
            head.weight[vocab:].div_(scale)
        head.bias.copy_(full.to(head.bias.dtype))


def _build(kind: str, shape: dict, path: Path, device: str, dtype):
    import torch
    import transformers

    vocab = shape["vocab"]
    torch.manual_seed(0)
    # built on the device (random initialisation of 0.6B parameters is slow on the host)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        if kind == "ctc":
            cfg = transformers.ParakeetCTCConfig(vocab_size=vocab + 1, pad_token_id=vocab,
                                                 encoder_config=_encoder_config(shape))
            model = transformers.ParakeetForCTC(cfg)
            fe = transformers.ParakeetFeatureExtractor(feature_size=shape["num_mel_bins"])
        elif kind == "tdt":
            cfg = transformers.ParakeetTDTConfig(
                vocab_size=vocab + 1, blank_token_id=vocab, pad_token_id=vocab,
                decoder_start_token_id=vocab, decoder_hidden_size=shape["decoder_hidden_size"],
                durations=[0, 1, 2, 3, 4], encoder_config=_encoder_config(shape))
            model = transformers.ParakeetForTDT(cfg)
            fe = transformers.ParakeetFeatureExtractor(feature_size=shape["num_mel_bins"])
        else:
            cfg = transformers.NemotronAsrStreamingConfig(
                vocab_size=vocab + 1, blank_token_id=vocab, pad_token_id=vocab,
                decoder_start_token_id=vocab, decoder_hidden_size=shape["decoder_hidden_size"],
                encoder_config=_encoder_config(shape, sliding_window=71,
                                               default_num_lookahead_tokens=13))
            model = transformers.NemotronAsrStreamingForRNNT(cfg)
            fe = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=shape["num_mel_bins"])
    # outside the device context: feature extractors (transformers 5.17's Parakeet one) build
    # CPU tensors that must not land on the default device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to(device=device, dtype=dtype).eval()
        with torch.no_grad():
            _calibrate(model, fe, vocab, device, kind)
        model.save_pretrained(path)
        fe.save_pretrained(path)
    pieces = ["<unk>"] + [f"\u2581t{i}" for i in range(vocab - 1)]
    (path / "vocab.txt").write_text("".join(p + "\n" for p in pieces))
    return model, fe


REFERENCE = {"ctc": "ParakeetForCTC", "tdt": "ParakeetForTDT",
             "nemotron": "NemotronAsrStreamingForRNNT"}


def _has_reference(kind: str) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, REFERENCE[kind])


def _build_without_transformers(kind: str, shape: dict, path: Path, device: str, dtype) -> None:
    """The same Hugging Face layout written by OASR itself (random weights, the same
    calibration) for a machine whose transformers lacks the class: OASR is then measured alone."""
    import torch
    from safetensors.torch import save_file

    from oasr.features.nemo import NemoMel
    from oasr.types import FeatureSpec
    from oasr_models_nemo.config import NemoConfig
    from oasr_models_nemo.nn import FastConformerNet

    vocab = shape["vocab"]
    head = "ctc" if kind == "ctc" else ("tdt" if kind == "tdt" else "rnnt")
    streaming = kind == "nemotron"
    cfg = NemoConfig(
        head=head, vocab_size=vocab + 1, blank_id=vocab, hidden_size=shape["hidden_size"],
        num_layers=shape["num_hidden_layers"], num_heads=shape["num_attention_heads"],
        intermediate_size=shape["intermediate_size"],
        subsampling_channels=shape["subsampling_conv_channels"],
        num_mel_bins=shape["num_mel_bins"], decoder_hidden_size=shape["decoder_hidden_size"],
        durations=(0, 1, 2, 3, 4) if head == "tdt" else (), streaming=streaming,
        causal=streaming, conv_norm="layer_norm" if streaming else "batch_norm",
        att_context=(70, 13) if streaming else (-1, -1),
        att_context_style="chunked_limited" if streaming else "regular",
        normalize=None if streaming else "per_feature")
    torch.manual_seed(0)
    net = FastConformerNet(cfg).to(device=device, dtype=dtype).eval()
    mel = NemoMel(FeatureSpec(kind="nemo_mel", num_bins=cfg.num_mel_bins, n_fft=512,
                              options={"normalize": cfg.normalize}))
    feats, flens = mel.extract(torch.from_numpy(_waves(1, 4.0, seed=99)[0])[None])
    enc, _ = net.encoder(feats.to(device, dtype), flens.to(device))
    if head == "ctc":
        hidden, out = enc[0].float(), net.ctc_head
    else:
        e = net.encoder_projector(enc[0]).float()
        ids = torch.tensor([vocab, *range(1, vocab, max(1, vocab // 15))], device=device)
        z = torch.zeros(cfg.num_decoder_layers, len(ids), cfg.decoder_hidden_size, device=device,
                        dtype=dtype)
        dec = net.decoder(ids, (z, z.clone()))[0].float()
        hidden = torch.relu(e[:, None] + dec[None]).reshape(-1, dec.shape[-1])
        out = net.joint.head
    _set_output_bias(out, hidden, vocab, device)
    state = {}
    for key, value in net.state_dict().items():
        if key.endswith(("pointwise_conv1.weight", "pointwise_conv2.weight")) or key == "ctc_head.weight":
            value = value[..., None]
        parts = key.split(".")
        if key.startswith("decoder.lstm."):  # cells -> nn.LSTM names
            key = f"decoder.lstm.{parts[3]}_l{parts[2]}"
        if streaming and key.startswith("encoder.subsampling.layers."):
            i = int(parts[3])
            rest = ".".join(parts[4:])
            key = ("encoder.subsampling.conv_in." + rest if i == 0 else
                   f"encoder.subsampling.layers.{(i - 2) // 3}."
                   f"{'pointwise' if (i - 2) % 3 else 'depthwise'}_conv.{rest}")
        state[key] = value.detach().cpu().contiguous()
    save_file(state, str(path / "model.safetensors"))
    enc_cfg = {**_encoder_config(shape), "subsampling_factor": 8, "subsampling_conv_kernel_size": 3,
               "subsampling_conv_stride": 2, "conv_kernel_size": 9}
    if streaming:
        enc_cfg.update(sliding_window=71, default_num_lookahead_tokens=13)
    body = {"model_type": {"ctc": "parakeet_ctc", "tdt": "parakeet_tdt"}.get(kind, "nemotron_asr_streaming"),
            "vocab_size": vocab + 1, "pad_token_id": vocab, "blank_token_id": vocab,
            "decoder_hidden_size": shape["decoder_hidden_size"], "num_decoder_layers": 2,
            "encoder_config": enc_cfg}
    if head == "tdt":
        body["durations"] = [0, 1, 2, 3, 4]
    (path / "config.json").write_text(json.dumps(body))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "feature_size": shape["num_mel_bins"], "sampling_rate": SR, "hop_length": 160,
        "n_fft": 512, "win_length": 400, "preemphasis": 0.97}))
    pieces = ["<unk>"] + [f"\u2581t{i}" for i in range(vocab - 1)]
    (path / "vocab.txt").write_text("".join(p + "\n" for p in pieces))


def _hf_tokens(kind: str, out, lengths: list[int], blank: int) -> list[list[int]]:
    rows = []
    if kind == "ctc":
        for b, row in enumerate(out.tolist()):
            row = row[: lengths[b]]
            collapsed = [t for i, t in enumerate(row) if i == 0 or t != row[i - 1]]
            rows.append([t for t in collapsed if t != blank])
        return rows
    for b in range(out.sequences.shape[0]):
        frame, toks = 0, []
        for tok, dur in zip(out.sequences[b, 1:].tolist(), out.durations[b, 1:].tolist(), strict=True):
            if frame >= lengths[b]:
                break
            if tok != blank:
                toks.append(tok)
            frame += dur
        rows.append(toks)
    return rows


def _reference_generate(ref, kind: str, feats, mask, max_new: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "ctc":
            return ref.generate(input_features=feats, attention_mask=mask)
        return ref.generate(input_features=feats, attention_mask=mask, max_new_tokens=max_new)


def offline(args, kind: str, shape: dict) -> dict:
    import torch

    from oasr.checkpoint import load_model
    from oasr.types import DecodingOptions, EngineConfig

    dtype = torch.float16 if args.device.startswith("cuda") and args.dtype == "auto" else (
        torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype))
    have_ref = _has_reference(kind)
    with tempfile.TemporaryDirectory() as tmp:
        if have_ref:
            ref, fe = _build(kind, shape, Path(tmp), args.device, dtype)
        else:
            _build_without_transformers(kind, shape, Path(tmp), args.device, dtype)
        model = load_model(EngineConfig(ckpt_dir=tmp, device=args.device,
                                        dtype=str(dtype).replace("torch.", "")))
    params = sum(p.numel() for p in model.net.parameters())
    waves = _waves(args.batch, args.seconds)
    audio = args.batch * args.seconds
    blank = shape["vocab"]
    # max_symbols_per_frame: transformers' TDT loop has none
    opts = DecodingOptions(model_options={"max_symbols_per_frame": 10_000} if kind == "tdt" else {})
    ours_s, ours = _best(lambda: model.transcribe(waves, opts), args.repeats, args.device)
    ours_tokens = [t.segments[0].tokens if t.segments else [] for t in ours]
    split = {}
    if args.cudnn_attention:  # the same call with cuDNN's SDPA tried first (fixed shapes)
        from oasr.layers import fixed_shape_attention

        def cudnn_first():
            with fixed_shape_attention():
                return model.transcribe(waves, opts)

        cudnn_s, _ = _best(cudnn_first, args.repeats, args.device)
        split["oasr_cudnn_attention_s"] = round(cudnn_s, 4)
    if args.profile:
        from benchmarks.profiling import profile_call

        split["profile"] = profile_call(lambda: model.transcribe(waves, opts), args.device)
    # where the time goes: waveforms to mel on the device (the upload included), mel + encoder
    resolved = model._check(opts)
    features_s, _ = _best(lambda: model.features(waves), args.repeats, args.device)
    encode_s, _ = _best(lambda: model.encode(waves, resolved), args.repeats, args.device)
    split |= {"oasr_features_s": round(features_s, 4), "oasr_encode_s": round(encode_s, 4)}
    if kind != "ctc":  # the search without graphs
        model.cuda_graphs = False
        eager_s, eager = _best(lambda: model.transcribe(waves, opts), args.repeats, args.device)
        model.cuda_graphs = True
        split |= {"oasr_search_s": round(ours_s - encode_s, 4),
                 "oasr_no_graphs_s": round(eager_s, 4),
                 # the CUDA-graph search against the same search stepped eagerly (both OASR);
                 # ``same_tokens`` above compares with transformers (fp16: near-ties differ)
                 "graph_tokens_equal_eager": ours_tokens == [
                     t.segments[0].tokens if t.segments else [] for t in eager]}  # fmt: skip
    if not have_ref:
        return {"kind": kind, "parameters": params, "batch": args.batch, "seconds": args.seconds,
                "dtype": str(dtype).replace("torch.", ""), "oasr_s": round(ours_s, 4),
                "oasr_rtfx": round(audio / ours_s, 1),
                "transformers": f"missing {REFERENCE[kind]}: OASR measured alone",
                "tokens_per_input": round(sum(map(len, ours_tokens)) / len(ours_tokens), 1),
                **split}
    t0 = time.perf_counter()
    inp = fe(waves, sampling_rate=SR, return_tensors="pt")
    fe_s = time.perf_counter() - t0
    feats = inp.input_features.to(args.device, dtype)
    mask = inp.attention_mask.to(args.device)
    with torch.no_grad():
        lengths = ref._get_output_attention_mask(mask).sum(-1).tolist() if kind == "ctc" else \
            ref.get_audio_features(input_features=feats[:1], attention_mask=mask[:1],
                                   output_attention_mask=True).attention_mask.sum(-1).tolist() * args.batch
        max_new = 12 * int(max(lengths))

        def reference():
            return _reference_generate(ref, kind, feats, mask, max_new)

        ref_s, ref_out = _best(reference, max(1, args.repeats - 1), args.device)

        fe_device = [args.device]

        def reference_end_to_end():
            # what a user of transformers runs: the processor (its torch STFT on the same
            # device, the fastest way it offers) and generate, from the same waveforms
            try:
                x = fe(waves, sampling_rate=SR, return_tensors="pt", device=fe_device[0])
            except RuntimeError as e:  # some versions leave the waveforms on the CPU
                print(f"transformers' processor on {fe_device[0]} failed ({e}); on the CPU",
                      file=sys.stderr)
                fe_device[0] = "cpu"
                x = fe(waves, sampling_rate=SR, return_tensors="pt")
            return _reference_generate(ref, kind, x.input_features.to(args.device, dtype),
                                       x.attention_mask.to(args.device), max_new)

        e2e_s, _ = _best(reference_end_to_end, max(1, args.repeats - 1), args.device)
        if args.profile:
            from benchmarks.profiling import profile_call

            split["reference_profile"] = profile_call(reference, args.device)
    ref_tokens = _hf_tokens(kind, ref_out, lengths, blank)
    check = min(args.check, args.batch)
    return {
        "kind": kind, "parameters": params, "batch": args.batch, "seconds": args.seconds,
        "dtype": str(dtype).replace("torch.", ""),
        "oasr_s": round(ours_s, 4), "transformers_s": round(ref_s, 4),
        "oasr_rtfx": round(audio / ours_s, 1), "transformers_rtfx": round(audio / ref_s, 1),
        "speedup": round(ref_s / ours_s, 2),
        # transformers' feature extraction (CPU, numpy) is not in transformers_s
        "transformers_features_s": round(fe_s, 4),
        # processor with its features on the device, then generate: the whole call, as OASR's
        "transformers_end_to_end_s": round(e2e_s, 4),
        "transformers_processor_device": fe_device[0],
        "speedup_end_to_end": round(e2e_s / ours_s, 2),
        "tokens_per_input": round(sum(len(t) for t in ours_tokens) / len(ours_tokens), 1),
        "same_tokens": ours_tokens[:check] == ref_tokens[:check],
        **split,
    }  # fmt: skip


def _stream_run(model, n: int, args, r: int, chunk: int, profile_cls) -> dict:
    """N streams fed one chunk per tick (all ready at once), one ``engine.step()`` per tick:
    the step that serves them all, timed from the chunks' arrival to its updates."""
    import gc

    import torch

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    cuda = args.device.startswith("cuda")
    engine = ASREngine(EngineConfig(device=args.device, service_mode="streaming",
                                    max_batch_size=max(n, 1)), model=model)
    waves = _waves(n, args.stream_seconds, seed=n)
    opts = DecodingOptions(model_options={"lookahead": r, "max_symbols_per_frame": args.max_symbols})
    rids = [engine.add_streaming_request(opts) for _ in range(n)]
    rt = model.stream_runtime
    graphs = rt.graphs
    captures0 = graphs.stats["captures"] if graphs is not None else 0
    model.stream_profile = profile_cls() if profile_cls is not None else None
    lat, finals = [], {}
    step_profile = None
    ticks = int(args.stream_seconds * SR) // chunk
    # Python's full (generation 2) garbage collections during the timed steps: one can stall a
    # step for 100+ ms with a large heap (reported, so that a p99 outlier can be told apart)
    collections, started = [], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - started[0])
    for k in range(ticks):
        for rid, w in zip(rids, waves, strict=True):
            engine.feed_chunk(rid, w[k * chunk:(k + 1) * chunk], is_last=k == ticks - 1)
        if k == 2 and model.stream_profile is not None:
            model.stream_profile = profile_cls()  # the warm-up steps are not profiled
        if args.stream_profile and k == ticks // 2:  # one measured step under the profiler
            from benchmarks.profiling import profile_call

            outs = []
            step_profile = profile_call(lambda out=outs: out.extend(engine.step()), args.device, rows=25)
            for o in outs:
                if o.is_final:
                    finals[o.request_id] = o.text
            continue
        seen = len(collections)
        gc.callbacks.append(on_gc)
        t0 = time.perf_counter()
        try:
            outs = engine.step()
            _sync(args.device)
        finally:
            gc.callbacks.remove(on_gc)
        if k >= 2:  # warm-up steps excluded
            lat.append(time.perf_counter() - t0)
        else:
            del collections[seen:]
        for o in outs:
            if o.is_final:
                finals[o.request_id] = o.text
    profile = model.stream_profile.as_dict() if model.stream_profile is not None else None
    model.stream_profile = None
    for rid, tr in engine.run().items():  # what the last tick left (not timed)
        if tr is not None:
            finals[rid] = tr.text
    occupancy = engine.streaming.occupancy() if hasattr(engine.streaming, "occupancy") else {}
    engine.shutdown()
    lat_ms = np.array(lat or [0.0]) * 1000
    p99 = float(np.percentile(lat_ms, 99))
    check = min(n, args.check_streams)
    offline = [t.text for t in model.transcribe([w[: ticks * chunk] for w in waves[:check]], opts)]
    same = [finals.get(rid) == t for rid, t in zip(rids[:check], offline, strict=True)]
    if cuda:
        torch.cuda.synchronize()
    out = {"streams": n, "steps": len(lat), "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
           "p99_ms": round(p99, 2), "max_ms": round(float(lat_ms.max()), 2),
           "real_time": bool(p99 <= args.p99_target_ms), "finished": len(finals),
           "step_ms": [round(x, 1) for x in lat_ms.tolist()],
           "gc_full_collections": {"count": len(collections), "ms": round(1e3 * sum(collections), 1)},
           "text_equal_offline": round(float(np.mean(same)), 3) if same else None,
           **({"step_profile": step_profile} if step_profile is not None else {}),
           "graph_captures_during_run": (graphs.stats["captures"] - captures0) if graphs is not None else 0,
           "pool": {k: v for k, v in occupancy.items() if k.startswith("pool_")}}  # fmt: skip
    if profile is not None:
        out["phases_ms_per_step"] = profile["ms_per_step"]
        out["phases_us_per_stream"] = profile["us_per_row"]
    return out


def streaming(args, shape: dict) -> dict:
    """The Nemotron streaming model at ``--shape``, loaded once; for each stream count (or, with
    ``--find-max``, doubling from the first count until p99 > target, then two bisections) the
    CUDA graphs of every batch bucket up to it are captured first (``capture_stream_graphs``),
    so a measured step only replays."""
    import torch

    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    try:  # per-phase host timing of the steps, where core has it
        from oasr.stream_cache import StepProfile
    except ImportError:
        StepProfile = None  # noqa: N806

    cuda = args.device.startswith("cuda")
    dtype = torch.float16 if cuda else torch.float32
    r = args.lookahead
    chunk = 8 * (r + 1) * 160  # samples of one chunk: (r + 1) encoder frames of 80 ms
    out = {"lookahead": r, "chunk_ms": chunk * 1000 // SR, "max_symbols_per_frame": args.max_symbols,
           "p99_target_ms": args.p99_target_ms, "stream_seconds": args.stream_seconds,
           "find_max": args.find_max, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        if _has_reference("nemotron"):
            _build("nemotron", shape, Path(tmp), args.device, dtype)  # (the model is dropped)
        else:
            _build_without_transformers("nemotron", shape, Path(tmp), args.device, dtype)
        if cuda:
            torch.cuda.empty_cache()
        model = load_model(EngineConfig(ckpt_dir=tmp, device=args.device,
                                        dtype=str(dtype).replace("torch.", "")))
    if args.stream_graphs is not None:  # else the model's default: on with CUDA
        model.stream_cuda_graphs = args.stream_graphs
    rt = model.stream_runtime
    graph_steps = rt.graphs
    most = args.max_streams if args.find_max else max(args.streams)
    if args.gc_freeze:
        import gc

        gc.collect()
        gc.freeze()
    out["gc_freeze"] = args.gc_freeze
    capture_s = 0.0

    def measure(n: int, mode: str) -> dict:
        nonlocal capture_s
        t = time.perf_counter()
        model.capture_stream_graphs(max_batch=n, lookahead=r, streams=most, max_symbols=args.max_symbols)
        _sync(args.device)
        capture_s += time.perf_counter() - t
        run = {"mode": mode, **_stream_run(model, n, args, r, chunk, StepProfile)}
        out["runs"].append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
        return run

    t_start = time.perf_counter()
    # with graphs, the eager step is measured too (--compare-eager): the same counts, graphs off
    modes = ["graphs", "eager"] if graph_steps is not None and args.compare_eager else \
        ["graphs" if graph_steps is not None else "eager"]
    out["max_streams_held"] = {}
    for mode in modes:
        rt.graphs = graph_steps if mode == "graphs" else None
        budget_end = time.perf_counter() + args.time_budget / len(modes)
        if args.find_max:
            n, held, failed = max(1, args.streams[0]), None, None
            while n <= args.max_streams and time.perf_counter() < budget_end:
                if measure(n, mode)["real_time"]:
                    held, n = n, 2 * n
                else:
                    failed = n
                    break
            for _ in range(2 if held is not None and failed is not None else 0):
                mid = (held + failed) // 2
                if mid <= held or mid >= failed or time.perf_counter() >= budget_end:
                    break
                if measure(mid, mode)["real_time"]:
                    held = mid
                else:
                    failed = mid
        else:
            for n in args.streams:
                measure(n, mode)
            ok = [x["streams"] for x in out["runs"] if x["real_time"] and x["mode"] == mode]
            held = max(ok) if ok else None
        out["max_streams_held"][mode] = held
    rt.graphs = graph_steps
    out["cuda_graphs"] = graph_steps is not None
    out["graph_captures"] = graph_steps.stats["captures"] if graph_steps is not None else 0
    out["graph_capture_s"] = round(capture_s, 2)
    out["pool_bytes"] = rt.pool.memory_bytes
    out["measure_s"] = round(time.perf_counter() - t_start, 1)
    # the figure of the reports before find-max: the best mode's
    out["max_streams_p99_le_100ms"] = max((h or 0 for h in out["max_streams_held"].values()), default=0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check", type=int, default=16, help="inputs whose tokens are compared")
    p.add_argument("--kinds", default="ctc,tdt")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64, 128, 256])
    p.add_argument("--stream-seconds", type=float, default=6.72)
    p.add_argument("--lookahead", type=int, default=6)
    # random weights keep emitting at a frame once they emit there (a trained model says blank
    # after about one token): the streaming run caps the symbols per frame, as reported
    p.add_argument("--max-symbols", type=int, default=2)
    p.add_argument("--skip-streaming", action="store_true")
    p.add_argument("--find-max", action="store_true",
                   help="streaming: double the stream count from the first --streams value until "
                        "p99 > --p99-target-ms, then bisect twice; reports max_streams_held")
    p.add_argument("--max-streams", type=int, default=2048)
    p.add_argument("--p99-target-ms", type=float, default=100.0)
    p.add_argument("--check-streams", type=int, default=4,
                   help="streams whose final text is compared with offline decoding")
    p.add_argument("--stream-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="streaming: the chunk step as CUDA graphs per batch bucket and the greedy "
                        "search's device loop (default: on with CUDA, unless "
                        "OASR_NEMO_STREAM_GRAPHS=0); --no-stream-graphs times the eager step")
    p.add_argument("--compare-eager", action="store_true",
                   help="streaming with graphs: also measure the eager step (the same counts)")
    p.add_argument("--time-budget", type=float, default=1e9,
                   help="streaming --find-max: start no new count after this many seconds "
                        "(shared by the modes measured)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one OASR call and one transformers generate (top operators "
                        "to stderr and in the JSON)")
    p.add_argument("--stream-profile", action="store_true",
                   help="streaming: one step in the middle of each run under the torch profiler "
                        "(not timed; top operators in the JSON)")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="offline: also time OASR with cuDNN's attention kernel tried first")
    p.add_argument("--gc-freeze", action="store_true",
                   help="streaming: gc.collect() and gc.freeze() once the model is loaded (what a "
                        "server may do after start-up: full collections then skip the start-up "
                        "heap); each run reports the full collections during its timed steps")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    import torch

    try:
        import transformers

        version = transformers.__version__
    except ImportError:
        version = None
    torch.set_grad_enabled(False)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    shape = SHAPES[args.shape]
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": version,
        "shape": args.shape, "offline": [],
    }
    for kind in [k for k in args.kinds.split(",") if k and k != "none"]:
        result["offline"].append(offline(args, kind, shape))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if not args.skip_streaming:
        result["streaming"] = streaming(args, shape)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
