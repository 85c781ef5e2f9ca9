"""Decoding of 30-second Whisper windows: batched greedy / sampling and beam search.

Semantics follow openai-whisper's ``decoding.py`` (so outputs agree token for token on the same
weights): the same logit filters (suppress blank, suppress tokens, timestamp rules), the same beam
search with ``patience`` and the same length-penalty ranking, the no-speech probability read at
the ``<|startoftranscript|>`` position, and language detection from the first decoder step.

Decoding only drives a :class:`~oasr_models_whisper.network.WhisperNetwork`; it never touches
weights.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.tokenizer import WhisperTokenizer

CHUNK_SECONDS = 30.0


@dataclass
class WindowOptions:
    """Options for decoding one batch of 30 s windows (already resolved from the request)."""

    temperature: float = 0.0
    beam_size: int = 1  # used only at temperature 0
    patience: float | None = None
    length_penalty: float | None = None
    best_of: int = 1  # independent samples at temperature > 0
    sample_len: int | None = None  # default n_text_ctx // 2
    without_timestamps: bool = False
    max_initial_timestamp: float | None = 1.0
    suppress_blank: bool = True
    #: final, resolved ids to suppress (see :func:`resolve_suppress_tokens`)
    suppress_tokens: tuple[int, ...] = ()


@dataclass
class WindowResult:
    tokens: list[int]  # sampled tokens, without the initial tokens and without <|endoftext|>
    text: str
    sum_logprob: float
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float
    language: str | None = None
    language_probs: dict[str, float] | None = field(default=None, repr=False)


def compression_ratio(text: str) -> float:
    """len(utf-8 bytes) / len(zlib-compressed bytes): high values flag repetition loops."""
    data = text.encode("utf-8")
    if not data:
        return 0.0
    return len(data) / len(zlib.compress(data))


def resolve_suppress_tokens(
    tokenizer: WhisperTokenizer,
    suppress_tokens: Sequence[int] | None,
    non_speech: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """-1 in ``suppress_tokens`` stands for the non-speech symbols (the checkpoint's list when
    given as ``non_speech``, else the tokenizer's); task, start and no-speech tokens are always
    suppressed."""
    ids: list[int] = []
    if suppress_tokens:
        ids = [int(t) for t in suppress_tokens if int(t) >= 0]
        if -1 in suppress_tokens:
            ids.extend(non_speech if non_speech is not None else tokenizer.non_speech_tokens)
    ids.extend([tokenizer.transcribe, tokenizer.translate, tokenizer.sot, tokenizer.sot_prev,
                tokenizer.sot_lm])  # fmt: skip
    if tokenizer.no_speech is not None:
        ids.append(tokenizer.no_speech)
    return tuple(sorted(set(ids)))


def initial_tokens(
    tokenizer: WhisperTokenizer,
    sot_sequence: Sequence[int],
    *,
    prompt: Sequence[int] | str | None,
    without_timestamps: bool,
    n_text_ctx: int,
) -> list[int]:
    """[<|startofprev|> prompt...] <|startoftranscript|> [lang task] [<|notimestamps|>]."""
    tokens = list(sot_sequence)
    if without_timestamps:
        tokens.append(tokenizer.no_timestamps)
    if prompt:
        ids = tokenizer.encode(" " + prompt.strip()) if isinstance(prompt, str) else list(prompt)
        keep = n_text_ctx // 2 - 1
        tokens = [tokenizer.sot_prev, *ids[-keep:], *tokens]
    return tokens


# --------------------------------------------------------------------------- language detection
@torch.no_grad()
def detect_language(
    network: WhisperNetwork, tokenizer: WhisperTokenizer, audio_features: torch.Tensor
) -> tuple[list[str], list[dict[str, float]]]:
    """Most likely language per row of ``audio_features`` and the probability of each language."""
    n = audio_features.shape[0]
    cache = network.new_cache(audio_features)
    sot = torch.full((n, 1), tokenizer.sot, dtype=torch.long, device=audio_features.device)
    logits = network.decode(sot, cache)[:, 0].float()
    lang_ids = torch.tensor(tokenizer.all_language_tokens, device=logits.device)
    probs = logits[:, lang_ids].softmax(dim=-1).cpu()
    codes = tokenizer.languages
    best = probs.argmax(dim=-1).tolist()
    out_probs = [dict(zip(codes, row.tolist(), strict=False)) for row in probs]
    return [codes[i] for i in best], out_probs


# --------------------------------------------------------------------------- logit filters
class _Filters:
    """Suppress-blank, suppress-tokens and timestamp rules, vectorised over the batch."""

    def __init__(
        self, tokenizer: WhisperTokenizer, sample_begin: int, opts: WindowOptions, n_audio_ctx: int,
        n_vocab: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.tok = tokenizer
        self.sample_begin = sample_begin
        self.opts = opts
        self.blank = None
        if opts.suppress_blank:
            self.blank = torch.tensor([*tokenizer.encode(" "), tokenizer.eot], device=device)
        self.suppress = None
        if opts.suppress_tokens:
            ids = [t for t in opts.suppress_tokens if t < n_vocab]
            self.suppress = torch.tensor(ids, dtype=torch.long, device=device)
        self.timestamps = not opts.without_timestamps
        self.max_initial = None
        if self.timestamps and opts.max_initial_timestamp:
            precision = CHUNK_SECONDS / n_audio_ctx
            self.max_initial = round(opts.max_initial_timestamp / precision)

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        at_begin = tokens.shape[1] == self.sample_begin
        if self.blank is not None and at_begin:
            logits[:, self.blank] = -math.inf
        if self.suppress is not None:
            logits[:, self.suppress] = -math.inf
        if self.timestamps:
            self._timestamp_rules(logits, tokens, at_begin)

    def _timestamp_rules(self, logits: torch.Tensor, tokens: torch.Tensor, at_begin: bool) -> None:
        tb = self.tok.timestamp_begin
        sampled = tokens[:, self.sample_begin :]
        b, n = sampled.shape
        dev = logits.device
        if n > 0:
            is_ts = sampled >= tb
            last_is_ts = is_ts[:, -1]
            penult_is_ts = is_ts[:, -2] if n >= 2 else torch.ones_like(last_is_ts)
            pos = torch.arange(n, device=dev).expand_as(sampled)
            last_pos = torch.where(is_ts, pos, torch.full_like(pos, -1)).amax(dim=1)
            last_val = sampled.gather(1, last_pos.clamp(min=0)[:, None])[:, 0]
            last_ts = torch.where(last_pos >= 0, last_val, torch.full_like(last_val, -1))
        else:
            last_is_ts = torch.zeros(b, dtype=torch.bool, device=dev)
            penult_is_ts = torch.ones(b, dtype=torch.bool, device=dev)
            last_ts = torch.full((b,), -1, dtype=torch.long, device=dev)
        apply_timestamp_rules(
            logits, self.tok, sampled_count=torch.full((b,), n, dtype=torch.long, device=dev),
            last_is_ts=last_is_ts, penult_is_ts=penult_is_ts, last_ts=last_ts,
            max_initial=torch.full((b,), NO_MAX_INITIAL if self.max_initial is None else self.max_initial,
                                   dtype=torch.long, device=dev),
        )  # fmt: skip


#: ``max_initial`` of a row without a bound on its first timestamp
NO_MAX_INITIAL = 10**9


def apply_timestamp_rules(
    logits: torch.Tensor,
    tokenizer: WhisperTokenizer,
    *,
    sampled_count: torch.Tensor,
    last_is_ts: torch.Tensor,
    penult_is_ts: torch.Tensor,
    last_ts: torch.Tensor,
    max_initial: torch.Tensor,
    cols: torch.Tensor | None = None,
) -> None:
    """openai-whisper's ApplyTimestampRules on next-token ``logits`` (B, V), in place; the one
    implementation behind the per-batch search and the continuous-batching driver.

    What the rules read of each row's history, as (B,) tensors: how many tokens it sampled,
    whether its last and second-to-last tokens are timestamps (True for the second-to-last when
    there is none), its latest timestamp token (-1 before the first) and the largest first
    timestamp allowed, in timestamp steps (:data:`NO_MAX_INITIAL` for none)."""
    col = torch.arange(logits.shape[-1], device=logits.device) if cols is None else cols
    state = (sampled_count, last_is_ts, penult_is_ts, last_ts, max_initial)
    if logits.device.type == "cpu":
        _timestamp_masks_rows(logits, tokenizer, *state)
    else:
        _timestamp_masks_batched(logits, tokenizer, col, *state)
    _force_likelier_timestamp(logits, tokenizer.timestamp_begin, col)


def _timestamp_masks_batched(logits: torch.Tensor, tokenizer: WhisperTokenizer, col: torch.Tensor,
                             sampled_count: torch.Tensor, last_is_ts: torch.Tensor,
                             penult_is_ts: torch.Tensor, last_ts: torch.Tensor,
                             max_initial: torch.Tensor) -> None:
    """The rules before the last, as (B, V) masks: a fixed number of ops whatever B (a GPU
    step reads no row state on the host)."""
    tb, eot = tokenizer.timestamp_begin, tokenizer.eot
    neg = -math.inf
    logits[:, tokenizer.no_timestamps] = neg
    # timestamps come in pairs, except right before <|endoftext|>
    pair_done = last_is_ts & penult_is_ts  # must be followed by text (or eot)
    pair_open = last_is_ts & ~penult_is_ts  # must be closed by a timestamp (or eot)
    mask = (pair_done[:, None] & (col[None, :] >= tb)) | (pair_open[:, None] & (col[None, :] < eot))
    # timestamps never decrease; a closed segment may not be zero-length either
    has_ts = last_ts >= 0
    limit = torch.where(pair_open, last_ts, last_ts + 1)
    mask |= has_ts[:, None] & (col[None, :] >= tb) & (col[None, :] < limit[:, None])
    # the first token is a timestamp, no later than max_initial
    begin = sampled_count == 0
    mask |= begin[:, None] & (col[None, :] < tb)
    mask |= begin[:, None] & (col[None, :] > tb + max_initial[:, None])
    logits.masked_fill_(mask, neg)


def _timestamp_masks_rows(logits: torch.Tensor, tokenizer: WhisperTokenizer,
                          sampled_count: torch.Tensor, last_is_ts: torch.Tensor,
                          penult_is_ts: torch.Tensor, last_ts: torch.Tensor,
                          max_initial: torch.Tensor) -> None:
    """The same rules on the CPU, row by row: each row's masks are one or two column ranges,
    filled as slices (a few small ops per row, where the batched form builds and combines a
    dozen (B, V) masks: ~2 ms a step for tiny.en at 9 rows). Equal to the batched form."""
    tb, eot = tokenizer.timestamp_begin, tokenizer.eot
    neg = -math.inf
    state = zip(sampled_count.tolist(), last_is_ts.tolist(), penult_is_ts.tolist(),
                last_ts.tolist(), max_initial.tolist(), strict=True)  # fmt: skip
    for row, (n, last, penult, latest, first_max) in zip(logits, state, strict=True):
        row[tokenizer.no_timestamps] = neg
        if last and penult:  # a closed pair is followed by text (or eot)
            row[tb:] = neg
        elif last:  # an open pair is closed by a timestamp (or eot)
            row[:eot] = neg
        if latest >= 0:  # timestamps never decrease; a closed segment is not empty
            row[tb : latest if last and not penult else latest + 1] = neg
        if n == 0:  # the first token is a timestamp, no later than max_initial
            row[:tb] = neg
            row[tb + first_max + 1 :] = neg


def _force_likelier_timestamp(logits: torch.Tensor, tb: int, col: torch.Tensor) -> None:
    """The last timestamp rule, in place on (B, V) ``logits``: a row's text tokens are masked
    when its timestamps together outweigh every single text token; ``col`` is ``arange(V)``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ts_mass = logprobs[:, tb:].logsumexp(dim=-1)
    best_text = logprobs[:, :tb].max(dim=-1).values
    force = ts_mass > best_text
    logits.masked_fill_(force[:, None] & (col[None, :] < tb), -math.inf)


# --------------------------------------------------------------------------- search strategies
class _Greedy:
    def __init__(self, temperature: float, eot: int) -> None:
        self.temperature = temperature
        self.eot = eot

    def update(self, tokens, logits, sum_logprobs, cache):
        if self.temperature == 0:
            next_tokens = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            next_tokens = torch.multinomial(probs, 1)[:, 0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs[torch.arange(logprobs.shape[0], device=logprobs.device), next_tokens]
        done = tokens[:, -1] == self.eot
        sum_logprobs += picked * (~done)
        next_tokens = torch.where(done, torch.full_like(next_tokens, self.eot), next_tokens)
        tokens = torch.cat([tokens, next_tokens[:, None]], dim=-1)
        return tokens, bool((tokens[:, -1] == self.eot).all())

    def finalize(self, tokens, sum_logprobs):
        # tokens (n_audio, n_group, T): make sure every row ends with eot
        pad = torch.full((*tokens.shape[:2], 1), self.eot, dtype=tokens.dtype, device=tokens.device)
        return torch.cat([tokens, pad], dim=-1).tolist(), sum_logprobs.tolist()


class _Beam:
    """Beam search; a search ends once ``round(beam_size * patience)`` hypotheses finished."""

    def __init__(self, beam_size: int, eot: int, patience: float | None, n_audio: int) -> None:
        self.beam_size = beam_size
        self.eot = eot
        self.max_candidates = round(beam_size * (patience or 1.0))
        if self.max_candidates <= 0:
            raise ValueError(f"invalid beam size / patience ({beam_size}, {patience})")
        self.finished: list[dict[tuple[int, ...], float]] = [{} for _ in range(n_audio)]

    def update(self, tokens, logits, sum_logprobs, cache):
        n_rows = tokens.shape[0]
        n_audio = n_rows // self.beam_size
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_ix = logprobs.topk(self.beam_size + 1, dim=-1)
        # cumulative scores in float32, exactly as the reference accumulates them
        cand = (sum_logprobs[:, None].float() + top_lp).cpu().tolist()
        top_ix = top_ix.cpu().tolist()
        prefixes = tokens.cpu().tolist()
        next_rows: list[list[int]] = []
        sources: list[int] = []
        new_sums: list[float] = []
        new_finished: list[dict[tuple[int, ...], float]] = []
        for i in range(n_audio):
            scores: dict[tuple[int, ...], float] = {}
            origin: dict[tuple[int, ...], int] = {}
            for j in range(self.beam_size):
                row = i * self.beam_size + j
                for score, tok in zip(cand[row], top_ix[row], strict=False):
                    seq = (*prefixes[row], tok)
                    scores[seq] = score
                    origin[seq] = row
            finished: dict[tuple[int, ...], float] = {}
            kept = 0
            for seq in sorted(scores, key=scores.__getitem__, reverse=True):
                if seq[-1] == self.eot:
                    finished[seq] = scores[seq]
                else:
                    next_rows.append(list(seq))
                    sources.append(origin[seq])
                    new_sums.append(scores[seq])
                    kept += 1
                    if kept == self.beam_size:
                        break
            while kept < self.beam_size:  # fewer live candidates than beams (rare): pad
                if kept:
                    next_rows.append(list(next_rows[-1]))
                    sources.append(sources[-1])
                    new_sums.append(new_sums[-1])
                else:
                    row = i * self.beam_size
                    next_rows.append([*prefixes[row], self.eot])
                    sources.append(row)
                    new_sums.append(-math.inf)
                kept += 1
            new_finished.append(finished)
        index = torch.tensor(sources, dtype=torch.long, device=tokens.device)
        if sources != list(range(n_rows)):
            cache.reorder(index)
        sum_logprobs.copy_(torch.tensor(new_sums, dtype=sum_logprobs.dtype))
        tokens = torch.tensor(next_rows, dtype=tokens.dtype, device=tokens.device)
        for done, new in zip(self.finished, new_finished, strict=False):
            for seq in sorted(new, key=new.__getitem__, reverse=True):
                if len(done) >= self.max_candidates:
                    break
                done[seq] = new[seq]
        completed = all(len(d) >= self.max_candidates for d in self.finished)
        return tokens, completed

    def finalize(self, tokens, sum_logprobs):
        # fill up with the unfinished beams when too few hypotheses reached eot
        sums = sum_logprobs.cpu().tolist()
        rows = tokens.cpu().tolist()
        out_tokens, out_sums = [], []
        for i, done in enumerate(self.finished):
            if len(done) < self.beam_size:
                order = sorted(range(len(sums[i])), key=lambda j: sums[i][j], reverse=True)
                for j in order:
                    done[(*rows[i][j], self.eot)] = sums[i][j]
                    if len(done) >= self.beam_size:
                        break
            out_tokens.append([list(s) for s in done])
            out_sums.append(list(done.values()))
        return out_tokens, out_sums


def _rank(lengths: list[int], sums: list[float], length_penalty: float | None) -> int:
    best, best_score = 0, -math.inf
    for k, (n, lp) in enumerate(zip(lengths, sums, strict=False)):
        penalty = n if length_penalty is None else ((5 + n) / 6) ** length_penalty
        score = lp / penalty if penalty else lp
        if score > best_score:
            best, best_score = k, score
    return best


# --------------------------------------------------------------------------- the main loop
@torch.no_grad()
def decode_windows(
    network: WhisperNetwork,
    tokenizer: WhisperTokenizer,
    audio_features: torch.Tensor,
    init_tokens: Sequence[Sequence[int]],
    opts: WindowOptions,
) -> list[WindowResult]:
    """Decode a batch of windows whose initial token sequences all have the same length.

    ``init_tokens[i]`` holds [prompt] + sot sequence [+ no_timestamps] for row ``i`` (the rows may
    differ in language token or prompt content, not in length).
    """
    n_audio = audio_features.shape[0]
    if len(init_tokens) != n_audio or len({len(t) for t in init_tokens}) != 1:
        raise ValueError("decode_windows needs one initial sequence per row, all of one length")
    dims = network.dims
    device = audio_features.device
    sample_begin = len(init_tokens[0])
    sot_index = list(init_tokens[0]).index(tokenizer.sot)
    sample_len = opts.sample_len or dims.n_text_ctx // 2
    n_ctx = dims.n_text_ctx

    use_beam = opts.temperature == 0 and opts.beam_size > 1
    n_group = opts.beam_size if use_beam else (opts.best_of if opts.temperature > 0 else 1)
    strategy = (
        _Beam(opts.beam_size, tokenizer.eot, opts.patience, n_audio)
        if use_beam
        else _Greedy(opts.temperature, tokenizer.eot)
    )
    filters = _Filters(tokenizer, sample_begin, opts, dims.n_audio_ctx, dims.n_vocab, device)

    tokens = torch.tensor([list(t) for t in init_tokens], dtype=torch.long, device=device)
    tokens = tokens.repeat_interleave(n_group, dim=0)
    feats = audio_features.repeat_interleave(n_group, dim=0) if n_group > 1 else audio_features
    cache = network.new_cache(feats)
    sum_logprobs = torch.zeros(tokens.shape[0], device=device, dtype=torch.float32)
    no_speech = [math.nan] * tokens.shape[0]

    greedy = isinstance(strategy, _Greedy)
    in_cache = torch.arange(tokens.shape[0], device=device)  # rows held by the cache, in order
    for step in range(sample_len):
        if step == 0:
            logits = network.decode(tokens, cache)
            if tokenizer.no_speech is not None:
                probs = logits[:, sot_index].float().softmax(dim=-1)
                no_speech = probs[:, tokenizer.no_speech].tolist()
            last = logits[:, -1].float().clone()
        elif greedy:
            # finished rows only ever append <|endoftext|>: drop them from the network batch
            alive = (tokens[:, -1] != tokenizer.eot).nonzero().squeeze(1)
            if alive.numel() < in_cache.numel():
                cache.reorder(torch.searchsorted(in_cache, alive))
                in_cache = alive
            out = network.decode(tokens[in_cache, -1:], cache)[:, -1].float()
            last = torch.zeros(tokens.shape[0], out.shape[-1], device=device)
            last[in_cache] = out
        else:
            last = network.decode(tokens[:, -1:], cache)[:, -1].float().clone()
        filters(last, tokens)
        tokens, completed = strategy.update(tokens, last, sum_logprobs, cache)
        if completed or tokens.shape[-1] > n_ctx:
            break

    no_speech = no_speech[::n_group]
    if isinstance(strategy, _Greedy):
        grouped = tokens.reshape(n_audio, n_group, -1)
        all_tokens, all_sums = strategy.finalize(grouped, sum_logprobs.reshape(n_audio, n_group))
    else:
        all_tokens, all_sums = strategy.finalize(
            tokens.reshape(n_audio, n_group, -1), sum_logprobs.reshape(n_audio, n_group)
        )

    results = []
    for i in range(n_audio):
        cands = []
        for seq in all_tokens[i]:
            body = seq[sample_begin:]
            cut = body.index(tokenizer.eot) if tokenizer.eot in body else len(body)
            cands.append(body[:cut])
        k = _rank([len(c) for c in cands], all_sums[i], opts.length_penalty)
        toks = cands[k]
        text = tokenizer.decode(toks).strip()
        slp = float(all_sums[i][k])
        results.append(
            WindowResult(
                tokens=toks,
                text=text,
                sum_logprob=slp,
                avg_logprob=slp / (len(toks) + 1),
                no_speech_prob=float(no_speech[i]),
                temperature=opts.temperature,
                compression_ratio=compression_ratio(text),
            )
        )
    return results
