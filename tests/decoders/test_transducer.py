"""Generic transducer decoders (oasr.decoders.transducer) against reference search code.

* RNN-T greedy and modified beam search against icefall's own searches, from the PyPI package
  ``zipformer`` (Apache-2.0, Xiaomi / Next-gen Kaldi: a k2-free copy of icefall's Zipformer
  recipe; its ``decode/search.py`` holds ``greedy_search``, ``_greedy_search_batch`` and
  ``modified_beam_search``). It is installed with ``pip install --no-deps zipformer`` (see
  scripts/setup.sh); the fixture below imports only its search module, with its training-only
  imports (atdataset, kaldifst, kaldialign, tensorboard ... behind ``zipformer.utils``,
  ``zipformer.decode.ngram_lm`` and ``zipformer.modules.model``) replaced by small fakes in
  ``sys.modules`` and removed again afterwards. Both searches run on the same tiny icefall-style
  stateless decoder (embedding + grouped context convolution) and joiner with random weights.
* NeMo RNN-T greedy and TDT greedy against restatements of NeMo's loops written here (NeMo is
  not installed): ``GreedyRNNTInfer._greedy_decode`` and the batched TDT label-looping
  ``GreedyBatchedTDTLabelLoopingComputer.torch_impl``, on an LSTM prediction network.
* TDT greedy against ``transformers``' own ``ParakeetForTDT.generate`` (its duration-aware
  greedy loop, run in the test on a tiny random Parakeet TDT: encoder, LSTM prediction network,
  joint with the duration head): tokens, frames and durations.
* batched == one utterance at a time, chunked (streaming) == offline, CUDA == CPU (gpu mark).
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from oasr.decoders import (
    CTCHypothesis,
    Hypothesis,
    TDTGreedySearch,
    TransducerGreedySearch,
    TransducerModifiedBeamSearch,
    TransducerNetwork,
    duration_token_timestamps,
    group_words,
    tdt_greedy_search,
    token_timestamps,
    transducer_greedy_search,
    transducer_modified_beam_search,
)
from oasr.errors import CheckpointError, InvalidRequestError

VOCAB = 12  # icefall: blank 0 plus 11 tokens
CONTEXT = 2
LENGTHS = [29, 17, 23, 9]  # distinct: icefall sorts utterances by length


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors here are tiny: extra intra-op threads only add synchronisation (and are slow on a
    busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- icefall-style stateless decoder + joiner --------------------------------------------------------


class IcefallDecoder(nn.Module):
    """icefall's stateless decoder (embedding, grouped Conv1d over the last ``context_size``
    tokens, relu) without its training-only balancers; negative ids embed to zero."""

    def __init__(self, vocab: int, dim: int, blank_id: int, context_size: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blank_id = blank_id
        self.context_size = context_size
        self.vocab_size = vocab
        self.conv = nn.Conv1d(dim, dim, kernel_size=context_size, groups=dim // 4, bias=False)

    def forward(self, y: torch.Tensor, need_pad: bool = True) -> torch.Tensor:
        y = y.to(torch.int64)
        emb = self.embedding(y.clamp(min=0)) * (y >= 0).unsqueeze(-1)
        emb = emb.permute(0, 2, 1)
        if need_pad:
            emb = nn.functional.pad(emb, (self.context_size - 1, 0))
        return torch.relu(self.conv(emb)).permute(0, 2, 1)


class IcefallJoiner(nn.Module):
    """icefall's joiner. It returns log-probabilities (log-softmax of icefall's logits): the
    argmax is unchanged, and icefall's per-token greedy ``scores`` (joiner outputs) become
    comparable with OASR's log-softmaxed ``token_logprobs``."""

    def __init__(self, enc_dim: int, dec_dim: int, joiner_dim: int, vocab: int) -> None:
        super().__init__()
        self.encoder_proj = nn.Linear(enc_dim, joiner_dim)
        self.decoder_proj = nn.Linear(dec_dim, joiner_dim)
        self.output_linear = nn.Linear(joiner_dim, vocab)

    def forward(self, encoder_out, decoder_out, project_input: bool = True):
        if project_input:
            logit = self.encoder_proj(encoder_out) + self.decoder_proj(decoder_out)
        else:
            logit = encoder_out + decoder_out
        return self.output_linear(torch.tanh(logit)).log_softmax(dim=-1)


class IcefallModel(nn.Module):
    def __init__(self, seed: int, enc_dim: int = 16, dim: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.decoder = IcefallDecoder(VOCAB, dim, blank_id=0, context_size=CONTEXT)
        self.joiner = IcefallJoiner(enc_dim, dim, 24, VOCAB)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.7
        with torch.no_grad():  # a blank-leaning joiner: outputs mix blanks and varied tokens
            self.joiner.output_linear.weight.mul_(1.5)
            self.joiner.output_linear.bias[0] += 5.0
            self.joiner.decoder_proj.weight.mul_(2.0)
        self.eval()


class IcefallNetwork:
    """The TransducerNetwork of an icefall model: the state is the last ``context_size`` tokens."""

    def __init__(self, model: IcefallModel) -> None:
        self.model = model

    def initial_state(self, batch_size, device):
        return torch.full((batch_size, CONTEXT), -1, dtype=torch.long, device=device)

    def predict(self, tokens, state):
        context = torch.cat([state[:, 1:], tokens.unsqueeze(1)], dim=1)
        out = self.model.decoder(context, need_pad=False)
        return self.model.joiner.decoder_proj(out).squeeze(1), context

    def select_state(self, state, index):
        return state[index]

    def merge_state(self, state, new_state, update):
        return torch.where(update.unsqueeze(1), new_state, state)

    def join(self, encoder_frames, decoder_out):
        return self.model.joiner(encoder_frames, decoder_out, project_input=False)


# -- NeMo-style LSTM prediction network + joint ------------------------------------------------------


class LSTMTransducer(nn.Module):
    """NeMo-style RNN-T / TDT: blank is the last token (blank-as-pad: its embedding is zero, and
    it is the start symbol), a 2-layer LSTM prediction network, joint = relu(enc + pred)."""

    def __init__(self, seed: int, tokens: int = 10, durations: tuple[int, ...] = (),
                 enc_dim: int = 16, hidden: int = 16, joint_dim: int = 24) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blank_id = tokens
        self.durations = list(durations)
        self.embed = nn.Embedding(tokens + 1, hidden, padding_idx=tokens)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.enc_proj = nn.Linear(enc_dim, joint_dim)
        self.pred_proj = nn.Linear(hidden, joint_dim)
        self.out = nn.Linear(joint_dim, tokens + 1 + len(durations))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.6
        with torch.no_grad():
            self.embed.weight[tokens].zero_()
            self.out.weight.mul_(0.5)
            self.out.bias[tokens] += 5.0
            self.pred_proj.weight.mul_(2.5)
            if durations:
                self.out.bias[tokens + 1] += 0.8  # some duration-0 predictions
        self.eval()


class LSTMNetwork:
    """The TransducerNetwork of the LSTM model: the state is ``(h, c)``, (layers, N, hidden)."""

    def __init__(self, model: LSTMTransducer) -> None:
        self.model = model

    def initial_state(self, batch_size, device):
        z = torch.zeros(2, batch_size, self.model.lstm.hidden_size, device=device)
        return (z, z.clone())

    def predict(self, tokens, state):
        out, (h, c) = self.model.lstm(self.model.embed(tokens).unsqueeze(1), state)
        return self.model.pred_proj(out[:, 0]), (h, c)

    def select_state(self, state, index):
        return (state[0][:, index], state[1][:, index])

    def merge_state(self, state, new_state, update):
        m = update.view(1, -1, 1)
        return (torch.where(m, new_state[0], state[0]), torch.where(m, new_state[1], state[1]))

    def join(self, encoder_frames, decoder_out):
        return self.model.out(torch.relu(encoder_frames + decoder_out))


def _encoder_out(seed: int, dim: int = 16, lengths=LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    enc = torch.randn(len(lengths), max(lengths), dim, generator=g)
    return enc, torch.tensor(lengths)


# -- icefall's searches (zipformer package) ------------------------------------------------------------


@pytest.fixture(scope="module")
def icefall_search():
    """``zipformer.decode.search`` with its training-only imports faked, restored afterwards."""
    spec = importlib.util.find_spec("zipformer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the icefall reference is missing: pip install --no-deps zipformer")
    saved = {k: v for k, v in sys.modules.items() if k == "zipformer" or k.startswith("zipformer.")}

    def module(name: str, package: bool = False, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        if package:
            m.__path__ = []
        m.__dict__.update(attrs)
        return m

    def classes(*names: str) -> dict[str, type]:
        return {n: type(n, (), {}) for n in names}

    root = module("zipformer")  # the real package's directory, without running its __init__
    root.__path__ = list(spec.submodule_search_locations)
    fakes = {
        "zipformer": root,
        "zipformer.utils": module("zipformer.utils", AttributeDict=type("AttributeDict", (dict,), {}),
                                  is_module_available=lambda *names: False),
        "zipformer.decode.ngram_lm": module("zipformer.decode.ngram_lm",
                                            **classes("NgramLm", "NgramLmStateCost")),
        "zipformer.modules": module("zipformer.modules", package=True),
        "zipformer.modules.model": module("zipformer.modules.model", **classes(
            "OnnxTransducerModel", "OnnxStreamingTransducerModel", "OnnxCtcModel",
            "OnnxStreamingCtcModel")),
    }
    for name in saved:
        del sys.modules[name]
    sys.modules.update(fakes)
    try:
        yield importlib.import_module("zipformer.decode.search")
    finally:
        for name in [k for k in sys.modules if k == "zipformer" or k.startswith("zipformer.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _assert_varied(token_lists: list[list[int]], num_frames: int) -> None:
    """Guard against a degenerate random model: the reference must emit many, varied tokens,
    and still leave frames blank."""
    flat = [u for toks in token_lists for u in toks]
    assert len(flat) >= 15, token_lists
    assert len(set(flat)) >= 5, token_lists
    assert len(flat) < num_frames, token_lists


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equals_icefall_greedy_search_batch(icefall_search, seed) -> None:
    model = IcefallModel(seed)
    enc, lens = _encoder_out(seed)
    with torch.no_grad():
        ref = icefall_search.greedy_search(model, enc, lens, max_sym_per_frame=1,
                                           return_timestamps=True)
        ours = transducer_greedy_search(IcefallNetwork(model), model.joiner.encoder_proj(enc),
                                        lens, blank_id=0, max_symbols_per_frame=1)
    _assert_varied(ref.hyps, sum(LENGTHS))
    for b, hyp in enumerate(ours):
        assert hyp.tokens == ref.hyps[b]
        assert hyp.times == ref.timestamps[b]
        assert hyp.token_logprobs == pytest.approx(ref.scores[b], abs=1e-5)
        assert hyp.score <= sum(hyp.token_logprobs) + 1e-6  # the path also pays for its blanks


def test_greedy_blank_penalty_and_unk_equal_icefall(icefall_search) -> None:
    model = IcefallModel(4)
    model.unk_id = 5  # icefall treats <unk> like blank
    enc, lens = _encoder_out(4)
    with torch.no_grad():
        ref = icefall_search.greedy_search(model, enc, lens, max_sym_per_frame=1,
                                           blank_penalty=0.8, return_timestamps=True)
        ours = transducer_greedy_search(IcefallNetwork(model), model.joiner.encoder_proj(enc),
                                        lens, unk_id=5, blank_penalty=0.8)
    _assert_varied(ref.hyps, sum(LENGTHS))
    assert [h.tokens for h in ours] == ref.hyps
    assert [h.times for h in ours] == ref.timestamps
    assert all(5 not in h.tokens for h in ours)


@pytest.mark.parametrize("max_symbols", [2, 3])
def test_greedy_max_symbols_equals_icefall_greedy_search(icefall_search, max_symbols) -> None:
    model = IcefallModel(12)
    enc, lens = _encoder_out(12)
    ref_tokens, ref_times = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "max_sym_per_frame > 1 is not supported in batch mode"
        for b, n in enumerate(LENGTHS):  # icefall's version takes one utterance at a time
            r = icefall_search.greedy_search(model, enc[b : b + 1, :n], lens[b : b + 1],
                                             max_sym_per_frame=max_symbols,
                                             return_timestamps=True)
            ref_tokens.append(r.hyps[0])
            ref_times.append(r.timestamps[0])
        ours = transducer_greedy_search(IcefallNetwork(model), model.joiner.encoder_proj(enc),
                                        lens, max_symbols_per_frame=max_symbols)
    _assert_varied(ref_tokens, 10**6)
    # the setting matters here: some frame emits more than one symbol
    assert any(ts.count(t) > 1 for ts in ref_times for t in ts)
    assert [h.tokens for h in ours] == ref_tokens
    assert [h.times for h in ours] == ref_times


def _capture_final_beams(icefall_search, monkeypatch) -> list[dict]:
    """Record every hypothesis of icefall's final beams (in icefall's length-sorted order)."""
    beams: list[dict] = []
    original = icefall_search.HypothesisList.get_most_probable

    def get_most_probable(self, length_norm: bool = False):
        beams.append({tuple(h.ys[CONTEXT:]): (float(h.log_prob), h.timestamps)
                      for h in self.data.values()})
        best = original(self, length_norm=length_norm)
        beams[-1]["best"] = tuple(best.ys[CONTEXT:])
        return best

    monkeypatch.setattr(icefall_search.HypothesisList, "get_most_probable", get_most_probable)
    return beams


@pytest.mark.parametrize("seed,beam", [(2, 4), (9, 3), (13, 8)])
def test_modified_beam_equals_icefall(icefall_search, monkeypatch, seed, beam) -> None:
    model = IcefallModel(seed)
    enc, lens = _encoder_out(seed)
    captured = _capture_final_beams(icefall_search, monkeypatch)
    with torch.no_grad():
        ref = icefall_search.modified_beam_search(model, enc, lens, beam=beam,
                                                  return_timestamps=True)
        nbest = transducer_modified_beam_search(
            IcefallNetwork(model), model.joiner.encoder_proj(enc), lens, beam_size=beam,
            length_norm_offset=CONTEXT)
    _assert_varied(ref.hyps, sum(LENGTHS))
    by_length = sorted(range(len(LENGTHS)), key=lambda b: -LENGTHS[b])
    for b, hyps in enumerate(nbest):
        assert hyps[0].tokens == ref.hyps[b]
        assert hyps[0].times == ref.timestamps[b]
        final = captured[by_length.index(b)]
        assert final.pop("best") == tuple(ref.hyps[b])
        assert {tuple(h.tokens) for h in hyps} == set(final)  # the whole final beam
        for h in hyps:
            score, times = final[tuple(h.tokens)]
            assert h.score == pytest.approx(score, abs=1e-4)
            assert h.times == times
        assert len(hyps) <= beam


def test_modified_beam_temperature_blank_penalty_unk_equal_icefall(icefall_search) -> None:
    model = IcefallModel(14)
    model.unk_id = 3  # icefall treats <unk> like blank
    enc, lens = _encoder_out(14)
    with torch.no_grad():
        ref = icefall_search.modified_beam_search(model, enc, lens, beam=4, temperature=1.5,
                                                  blank_penalty=0.5, return_timestamps=True)
        nbest = transducer_modified_beam_search(
            IcefallNetwork(model), model.joiner.encoder_proj(enc), lens, beam_size=4,
            temperature=1.5, blank_penalty=0.5, unk_id=3, length_norm_offset=CONTEXT)
    _assert_varied(ref.hyps, sum(LENGTHS))
    assert all(3 not in h.tokens for n in nbest for h in n)
    assert [n[0].tokens for n in nbest] == ref.hyps
    assert [n[0].times for n in nbest] == ref.timestamps


def test_beam_of_one_is_greedy() -> None:
    """Modified beam search with one hypothesis follows the greedy path (one symbol per frame)
    and both score it as the path's log-probability."""
    model = IcefallModel(15)
    net = IcefallNetwork(model)
    enc, lens = _encoder_out(15)
    proj = model.joiner.encoder_proj(enc).detach()
    greedy = transducer_greedy_search(net, proj, lens)
    beam = transducer_modified_beam_search(net, proj, lens, beam_size=1)
    for g, n in zip(greedy, beam, strict=True):
        assert len(n) == 1
        assert (n[0].tokens, n[0].times) == (g.tokens, g.times)
        assert n[0].token_logprobs == pytest.approx(g.token_logprobs, abs=1e-5)
        assert n[0].score == pytest.approx(g.score, abs=1e-4)


# -- NeMo restated ---------------------------------------------------------------------------------------


def nemo_rnnt_greedy_reference(model: LSTMTransducer, enc: torch.Tensor, length: int,
                               max_symbols: int) -> tuple[list[int], list[int]]:
    """NeMo's ``GreedyRNNTInfer._greedy_decode`` restated for one utterance: at each frame,
    predict from the last label (the start symbol is a zero embedding and a zero state), join,
    emit the argmax unless blank and stay on the frame, at most ``max_symbols`` times."""
    tokens, times = [], []
    last, state = None, None
    for t in range(length):
        symbols, not_blank = 0, True
        while not_blank and symbols < max_symbols:
            if last is None:
                x = torch.zeros(1, 1, model.lstm.input_size)
            else:
                x = model.embed(torch.tensor([[last]]))
            g, new_state = model.lstm(x, state)
            logits = model.out(torch.relu(model.enc_proj(enc[t]) + model.pred_proj(g[0, 0])))
            k = int(logits.argmax())
            if k == model.blank_id:
                not_blank = False
            else:
                tokens.append(k)
                times.append(t)
                last, state = k, new_state
            symbols += 1
    return tokens, times


def nemo_tdt_label_looping_reference(model: LSTMTransducer, enc: torch.Tensor,
                                     lengths: torch.Tensor, max_symbols: int) -> list[dict]:
    """NeMo's ``GreedyBatchedTDTLabelLoopingComputer.torch_impl`` restated (no fusion models, no
    CUDA graphs): find each utterance's next non-blank label, advancing the time pointer by the
    predicted duration (at least 1 after blank); record the label at the frame where it was found
    with its duration; update the prediction network for found labels only; force one frame
    ahead after ``max_symbols`` labels at one frame. Token log-probs are the log-softmax of the
    token logits at the label (NeMo records raw logits there)."""
    batch, _, _ = enc.shape
    blank = model.blank_id
    durations = torch.tensor(model.durations)
    nd = len(durations)
    proj = model.enc_proj(enc)
    idx = torch.arange(batch)
    last_t = torch.clamp(lengths - 1, min=0)
    time = torch.zeros(batch, dtype=torch.long)
    safe = torch.minimum(time, last_t)
    time_cur = torch.zeros_like(time)
    active = time < lengths
    hyps = [{"tokens": [], "times": [], "durations": [], "logprobs": []} for _ in range(batch)]
    last_stamp = torch.full((batch,), -1)
    lasts = torch.zeros(batch, dtype=torch.long)
    state = (torch.zeros(2, batch, model.lstm.hidden_size), torch.zeros(2, batch, model.lstm.hidden_size))
    g, state = model.lstm(model.embed(torch.full((batch, 1), blank)), state)
    dec = model.pred_proj(g[:, 0])

    def joint():
        logits = model.out(torch.relu(proj[idx, safe] + dec))
        return logits

    while active.any():
        active_prev = active.clone()
        logits = joint()
        scores, labels = logits[:, :-nd].max(-1)
        lp = logits[:, :-nd].log_softmax(-1).gather(1, labels.unsqueeze(1)).squeeze(1)
        dur = durations[logits[:, -nd:].argmax(-1)]
        blank_mask = labels == blank
        dur = dur.masked_fill((dur == 0) & blank_mask, 1)
        time_cur = time.clone()
        time = time + dur * active
        safe = torch.minimum(time, last_t)
        active = time < lengths
        advance = active & blank_mask
        while advance.any():
            time_cur = torch.where(advance, time, time_cur)
            logits = joint()
            more_scores, more_labels = logits[:, :-nd].max(-1)
            more_lp = logits[:, :-nd].log_softmax(-1).gather(1, more_labels.unsqueeze(1)).squeeze(1)
            labels = torch.where(advance, more_labels, labels)
            lp = torch.where(advance, more_lp, lp)
            dur = durations[logits[:, -nd:].argmax(-1)]
            blank_mask = labels == blank
            dur = dur.masked_fill((dur == 0) & blank_mask, 1)
            time = torch.where(advance, time + dur, time)
            safe = torch.minimum(time, last_t)
            active = time < lengths
            advance = active & blank_mask
        found = active_prev & (labels != blank)
        for b in range(batch):
            if found[b]:
                h = hyps[b]
                h["tokens"].append(int(labels[b]))
                h["times"].append(int(time_cur[b]))
                h["durations"].append(int(dur[b]))
                h["logprobs"].append(float(lp[b]))
        lasts = torch.where(found, torch.where(last_stamp == time_cur, lasts + 1, 1), lasts)
        last_stamp = torch.where(found, time_cur, last_stamp)
        g, new_state = model.lstm(model.embed(labels.unsqueeze(1)), state)
        m = found.view(1, -1, 1)
        state = (torch.where(m, new_state[0], state[0]), torch.where(m, new_state[1], state[1]))
        dec = torch.where(found.unsqueeze(1), model.pred_proj(g[:, 0]), dec)
        force = active & (labels != blank) & (lasts >= max_symbols) & (last_stamp == time)
        time = time + force.long()
        safe = torch.minimum(time, last_t)
        active = time < lengths
    return hyps


@pytest.mark.parametrize("max_symbols", [1, 3, 10])
def test_greedy_equals_restated_nemo_rnnt(max_symbols) -> None:
    model = LSTMTransducer(16)
    enc, lens = _encoder_out(27)
    with torch.no_grad():
        ours = transducer_greedy_search(LSTMNetwork(model), model.enc_proj(enc), lens,
                                        blank_id=model.blank_id,
                                        max_symbols_per_frame=max_symbols)
        ref = [nemo_rnnt_greedy_reference(model, enc[b], n, max_symbols)
               for b, n in enumerate(LENGTHS)]
    _assert_varied([r[0] for r in ref], 10**6)
    if max_symbols > 1:
        assert any(ts.count(t) > 1 for _, ts in ref for t in ts)
    assert [(h.tokens, h.times) for h in ours] == ref


@pytest.mark.parametrize("seed,max_symbols", [(20, 2), (19, 10), (22, 1)])
def test_tdt_greedy_equals_restated_nemo_label_looping(seed, max_symbols) -> None:
    model = LSTMTransducer(seed, durations=(0, 1, 2, 3, 4))
    enc, lens = _encoder_out(seed + 30)
    with torch.no_grad():
        ref = nemo_tdt_label_looping_reference(model, enc, lens, max_symbols)
        ours = tdt_greedy_search(LSTMNetwork(model), model.enc_proj(enc), lens,
                                 durations=model.durations, blank_id=model.blank_id,
                                 max_symbols_per_frame=max_symbols)
    _assert_varied([r["tokens"] for r in ref], 10**6)
    all_durations = [d for r in ref for d in r["durations"]]
    assert 0 in all_durations and len(set(all_durations)) >= 3, all_durations
    for b, (h, r) in enumerate(zip(ours, ref, strict=True)):
        assert h.tokens == r["tokens"]
        assert h.times == r["times"]
        assert h.token_logprobs == pytest.approx(r["logprobs"], abs=1e-5)
        assert all(t < LENGTHS[b] for t in h.times)
        # NeMo's batched loop records, for an utterance that found its label at once, the
        # duration argmax re-evaluated at its next frame while other utterances still search
        # (its inner loop overwrites `durations` for every row), so its recorded durations depend
        # on the batch; one utterance at a time they are the durations it advanced by.
        with torch.no_grad():
            alone = nemo_tdt_label_looping_reference(model, enc[b : b + 1, : LENGTHS[b]],
                                                     lens[b : b + 1], max_symbols)[0]
        assert alone["tokens"] == r["tokens"]
        assert h.durations == alone["durations"]


class ParakeetTDTNetwork:
    """The TransducerNetwork of a ``transformers`` ParakeetForTDT: its LSTM prediction network
    (state ``(h, c)``) and its joint (token logits, then duration logits)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.model = model

    def initial_state(self, batch_size, device):
        cfg = self.model.config
        z = torch.zeros(cfg.num_decoder_layers, batch_size, cfg.decoder_hidden_size, device=device)
        return (z, z.clone())

    def predict(self, tokens, state):
        dec = self.model.decoder
        out, (h, c) = dec.lstm(dec.embedding(tokens)[:, None], state)
        return dec.decoder_projector(out[:, 0]), (h, c)

    def select_state(self, state, index):
        return (state[0][:, index], state[1][:, index])

    def merge_state(self, state, new_state, update):
        m = update.view(1, -1, 1)
        return (torch.where(m, new_state[0], state[0]), torch.where(m, new_state[1], state[1]))

    def join(self, encoder_frames, decoder_out):
        return self.model.joint(decoder_hidden_states=decoder_out, encoder_hidden_states=encoder_frames)


@pytest.mark.parametrize("seed", [1, 2])
def test_tdt_greedy_equals_transformers_parakeet_tdt_generate(seed) -> None:
    transformers = pytest.importorskip("transformers")
    blank = 12
    config = transformers.ParakeetTDTConfig(
        vocab_size=blank + 1, blank_token_id=blank, pad_token_id=blank, decoder_start_token_id=blank,
        decoder_hidden_size=16, num_decoder_layers=2, durations=[0, 1, 2, 3, 4],
        encoder_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 32, "subsampling_factor": 4,
                        "subsampling_conv_channels": 8, "num_mel_bins": 20, "dropout": 0.0,
                        "layerdrop": 0.0, "activation_dropout": 0.0, "attention_dropout": 0.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.ParakeetForTDT(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        # transformers' generate takes each step's token as the argmax over the token AND
        # duration logits (only its frame advance splits them): keep the duration logits below
        # the tokens' so that never picks a duration; a uniform shift leaves their argmax alone
        model.joint.head.bias[blank + 1 :] -= 50.0
    feats = torch.randn(3, 120, 20, generator=g)
    mask = torch.ones(3, 120, dtype=torch.long)
    mask[1, 80:] = 0
    mask[2, 50:] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_features=feats, attention_mask=mask, max_new_tokens=400)
        enc = model.get_audio_features(input_features=feats, attention_mask=mask,
                                       output_attention_mask=True)  # fmt: skip
        lengths = enc.attention_mask.sum(-1).tolist()
        # transformers has no per-frame symbol limit: give ours one it never reaches
        ours = tdt_greedy_search(ParakeetTDTNetwork(model), enc.pooler_output, lengths,
                                 durations=config.durations, blank_id=blank,
                                 max_symbols_per_frame=10_000)  # fmt: skip
    all_durations, all_blanks = [], 0
    for b, hyp in enumerate(ours):
        # replay the reference's steps (after its start token): each emits a token (blank
        # included) at the current frame and advances by its duration, until the frames end
        frame, tokens, times, durations = 0, [], [], []
        for tok, dur in zip(out.sequences[b, 1:].tolist(), out.durations[b, 1:].tolist(), strict=True):
            if frame >= lengths[b]:
                break
            all_blanks += tok == blank
            if tok != blank:
                tokens.append(tok)
                times.append(frame)
                durations.append(dur)
            frame += dur
        assert frame >= lengths[b], "the reference stopped before the end of its frames"
        assert len(set(tokens)) >= 3, tokens  # varied
        assert (hyp.tokens, hyp.times, hyp.durations) == (tokens, times, durations)
        all_durations += durations
    assert len(set(all_durations)) >= 2 and all_blanks > 0, (all_durations, all_blanks)  # not all blank


# -- batching, streaming, types ----------------------------------------------------------------------------


def _searches():
    icefall = IcefallModel(5)
    lstm = LSTMTransducer(16)
    tdt = LSTMTransducer(20, durations=(0, 1, 2, 4))
    enc, lens = _encoder_out(40)
    yield ("icefall greedy x2", IcefallNetwork(icefall), icefall.joiner.encoder_proj(enc).detach(),
           lambda net, b: TransducerGreedySearch(net, b, max_symbols_per_frame=2))
    yield ("nemo greedy", LSTMNetwork(lstm), lstm.enc_proj(enc).detach(),
           lambda net, b: TransducerGreedySearch(net, b, blank_id=lstm.blank_id,
                                                 max_symbols_per_frame=5))
    yield ("icefall beam", IcefallNetwork(icefall), icefall.joiner.encoder_proj(enc).detach(),
           lambda net, b: TransducerModifiedBeamSearch(net, 4, b, length_norm_offset=CONTEXT))
    yield ("nemo beam", LSTMNetwork(lstm), lstm.enc_proj(enc).detach(),
           lambda net, b: TransducerModifiedBeamSearch(net, 3, b, blank_id=lstm.blank_id))
    yield ("tdt", LSTMNetwork(tdt), tdt.enc_proj(enc).detach(),
           lambda net, b: TDTGreedySearch(net, tdt.durations, b, blank_id=tdt.blank_id,
                                          max_symbols_per_frame=2))


def _result(search) -> list:
    out = search.nbest() if hasattr(search, "nbest") else search.results()
    return [[(h.tokens, h.times, h.durations) for h in n] if isinstance(n, list) else
            (n.tokens, n.times, n.durations) for n in out]


def _scores(search) -> list[float]:
    out = search.nbest() if hasattr(search, "nbest") else search.results()
    return [h.score for n in out for h in (n if isinstance(n, list) else [n])]


def test_batched_equals_one_at_a_time() -> None:
    lens = torch.tensor(LENGTHS)
    with torch.no_grad():
        for name, net, enc, make in _searches():
            batched = make(net, len(LENGTHS))
            batched.step(enc, lens)
            alone = []
            for b, n in enumerate(LENGTHS):
                one = make(net, 1)
                one.step(enc[b : b + 1, :n])
                alone += _result(one)
            assert _result(batched) == alone, name
            assert any(_result(batched)), name


def test_chunked_equals_offline() -> None:
    """Frames fed in random chunks (streams of different lengths run out at different chunks)
    give the offline hypotheses, times, durations and scores."""
    rng = random.Random(0)
    lens = LENGTHS
    with torch.no_grad():
        for name, net, enc, make in _searches():
            offline = make(net, len(lens))
            offline.step(enc, torch.tensor(lens))
            for _ in range(3):
                streaming = make(net, len(lens))
                start = 0
                while start < max(lens):
                    size = rng.choice([1, 2, 3, 5, 8])
                    chunk = enc[:, start : start + size]
                    chunk_lens = [max(0, min(size, n - start)) for n in lens]
                    streaming.step(chunk, chunk_lens)
                    start += size
                assert _result(streaming) == _result(offline), name
                assert _scores(streaming) == pytest.approx(_scores(offline), abs=1e-5), name


def test_empty_and_single_inputs() -> None:
    model = IcefallModel(14)
    net = IcefallNetwork(model)
    enc = torch.randn(2, 5, 24)
    assert [h.tokens for h in transducer_greedy_search(net, enc, [0, 0])] == [[], []]
    nbest = transducer_modified_beam_search(net, enc, [0, 3], beam_size=2)
    assert nbest[0] == [Hypothesis(tokens=[], score=0.0)]
    one = transducer_greedy_search(net, enc[1])  # (T, D): a batch of one
    assert len(one) == 1 and one[0] == transducer_greedy_search(net, enc[1:2])[0]


def test_hypotheses_flow_into_word_timestamps() -> None:
    """Transducer hypotheses are the CTC type: the same timestamp and word helpers apply; TDT
    durations give token spans."""
    assert CTCHypothesis is Hypothesis
    model = LSTMTransducer(15, durations=(0, 1, 2, 4))
    rnnt = LSTMTransducer(15)
    enc, lens = _encoder_out(45)
    with torch.no_grad():
        hyp = tdt_greedy_search(LSTMNetwork(model), model.enc_proj(enc), lens,
                                durations=model.durations, blank_id=model.blank_id)[0]
        greedy = transducer_greedy_search(LSTMNetwork(rnnt), rnnt.enc_proj(enc), lens,
                                          blank_id=rnnt.blank_id)[0]
    assert hyp.tokens and greedy.tokens
    assert all(0 < c <= 1 for c in hyp.confidences)
    timings = token_timestamps(greedy.tokens, greedy.times, greedy.confidences,
                               frame_shift=0.08, num_frames=LENGTHS[0])
    assert [t.token for t in timings] == greedy.tokens
    spans = duration_token_timestamps(hyp.tokens, hyp.times, hyp.durations, hyp.confidences,
                                      frame_shift=0.08, num_frames=LENGTHS[0], offset=1.0)
    for span, t, d in zip(spans, hyp.times, hyp.durations, strict=True):
        assert span.start == pytest.approx(1.0 + 0.08 * t, abs=1e-3)
        assert span.end == pytest.approx(1.0 + 0.08 * min(t + d, LENGTHS[0]), abs=1e-3)
    pieces = ["\u2581w" if i % 3 == 0 else "x" for i in range(len(spans))]
    words = group_words(pieces, spans)
    assert words[0][1] == spans[0].start and words[-1][2] == spans[-1].end


def test_protocol_and_errors() -> None:
    model = LSTMTransducer(16, durations=(0, 1, 2))
    net = LSTMNetwork(model)
    assert isinstance(net, TransducerNetwork) and isinstance(IcefallNetwork(IcefallModel(0)),
                                                             TransducerNetwork)
    enc = torch.randn(1, 4, 24)
    with pytest.raises(InvalidRequestError, match="beam_size"):
        transducer_modified_beam_search(net, enc, beam_size=0)
    with pytest.raises(InvalidRequestError, match="max_symbols_per_frame"):
        transducer_greedy_search(net, enc, max_symbols_per_frame=0)
    with pytest.raises(InvalidRequestError, match="lengths"):
        transducer_greedy_search(net, enc, [5])
    with pytest.raises(InvalidRequestError, match="streams"):
        TransducerGreedySearch(net, 2).step(enc)
    with pytest.raises(CheckpointError, match="too few"):
        tdt_greedy_search(net, enc, durations=list(range(14)), blank_id=10)
    with pytest.raises(CheckpointError, match="durations"):
        tdt_greedy_search(net, enc, durations=[], blank_id=10)


def test_registered_decoders() -> None:
    from oasr.plugins import get_registry

    dec = get_registry("decoder")
    for key in ("transducer_greedy", "transducer_greedy_incremental", "transducer_modified_beam",
                "tdt_greedy", "tdt_greedy_incremental"):
        assert dec.get(key).metadata["decode_family"] == "transducer"
        assert callable(dec.resolve(key))
    assert dec.resolve("tdt_greedy") is tdt_greedy_search


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu(monkeypatch) -> None:
    # full fp32 on CUDA (cuDNN convolutions default to TF32, which moves near-tied beam scores)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    lens = torch.tensor(LENGTHS)
    with torch.no_grad():
        for name, net, enc, make in _searches():
            cpu = make(net, len(LENGTHS))
            cpu.step(enc, lens)
            net.model.cuda()
            gpu = make(net, len(LENGTHS))
            gpu.step(enc.cuda(), lens.cuda())
            net.model.cpu()
            assert _result(gpu) == _result(cpu), name
            assert _scores(gpu) == pytest.approx(_scores(cpu), abs=1e-4), name


@pytest.mark.parametrize("seed,beam", [(2, 4), (9, 3)])
def test_hotword_biased_modified_beam_equals_icefall(icefall_search, monkeypatch, seed, beam) -> None:
    """Hotwords: icefall's biased modified beam search (its ContextGraph, non-strict) keeps the
    same final beams with the same scores; ours also takes back unfinished matches before
    ranking (icefall's finalize; this packaged copy adds it to an unused lm_score)."""
    from oasr.decoders.context_graph import ContextGraph

    graph_mod = importlib.import_module("zipformer.decode.context_graph")
    model = IcefallModel(seed)
    enc, lens = _encoder_out(seed)
    with torch.no_grad():
        plain = transducer_modified_beam_search(IcefallNetwork(model), model.joiner.encoder_proj(enc),
                                                lens, beam_size=beam, length_norm_offset=CONTEXT)
    # hotwords from hypotheses the plain search ranks below the best
    phrases = [h.tokens[-2:] for n in plain for h in n[1:2] if len(h.tokens) >= 2][:3] + [[5, 7, 5]]
    ref_graph = graph_mod.ContextGraph(2.0)
    ref_graph.build(phrases)
    graph = ContextGraph(phrases, 2.0)
    captured = _capture_final_beams(icefall_search, monkeypatch)
    with torch.no_grad():
        icefall_search.modified_beam_search(model, enc, lens, beam=beam, context_graph=ref_graph,
                                            return_timestamps=True)
        nbest = transducer_modified_beam_search(
            IcefallNetwork(model), model.joiner.encoder_proj(enc), lens, beam_size=beam,
            length_norm_offset=CONTEXT, context_graph=graph)
    by_length = sorted(range(len(LENGTHS)), key=lambda b: -LENGTHS[b])
    changed = 0
    for b, hyps in enumerate(nbest):
        final = captured[by_length.index(b)]
        final.pop("best")
        assert {tuple(h.tokens) for h in hyps} == set(final)
        for h in hyps:
            score, times = final[tuple(h.tokens)]
            state = 0
            for u in h.tokens:
                state = graph.step(state, u)[1]
            assert h.score - graph.finalize(state) == pytest.approx(score, abs=1e-4)
            assert h.times == times
        changed += hyps[0].tokens != plain[b][0].tokens
    assert changed  # the hotwords changed some best hypothesis
