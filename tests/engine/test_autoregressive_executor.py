"""The core's AutoregressiveExecutor with a family other than Whisper: a tiny decoder-only model
(no cross-attention, as a speech-LLM's decoder) and a one-window-per-request driver, written here
against oasr.executors alone. Its paged-cache decoding must give the tokens of a plain greedy loop
that recomputes the whole sequence every step."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oasr.executors.autoregressive import AttentionContext, AutoregressiveExecutor, Window  # noqa: E402
from oasr.scheduler import RequestAbortedError, Scheduler, SchedulerConfig  # noqa: E402
from oasr.types import DecodeFamily, DecodingOptions, FeatureSpec, ModelCapabilities, Transcript  # noqa: E402

VOCAB, D, HEADS, LAYERS, CONTEXT, STOP = 40, 32, 4, 2, 48, 0


class TinyDecoder(torch.nn.Module):
    """Token + position embeddings, causal self-attention blocks (``kv_heads`` < HEADS: grouped
    query attention), an output head."""

    def __init__(self, seed: int = 0, kv_heads: int = HEADS) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kv_heads = kv_heads
        self.kv_dim = kv_heads * (D // HEADS)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g))
        self.pos = torch.nn.Parameter(0.3 * torch.randn(CONTEXT, D, generator=g))
        self.qkv = torch.nn.ParameterList([
            torch.nn.Parameter(torch.randn(D + 2 * self.kv_dim, D, generator=g) / D**0.5) for _ in range(LAYERS)
        ])  # fmt: skip
        self.out = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)
                                           for _ in range(LAYERS)])  # fmt: skip
        self.head = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g) / D**0.5)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h*hd) -> (B, h, T, hd)
        b, t, c = x.shape
        return x.view(b, t, c // (D // HEADS), D // HEADS).transpose(1, 2)

    def layers(self, x: torch.Tensor, attend) -> torch.Tensor:  # noqa: ANN001
        b, t, _ = x.shape
        for li in range(LAYERS):
            q, k, v = torch.nn.functional.linear(x, self.qkv[li]).split([D, self.kv_dim, self.kv_dim], dim=-1)
            out = attend(li, self._split(q), k, v)
            x = x + torch.nn.functional.linear(out.transpose(1, 2).reshape(b, t, D), self.out[li])
        return torch.nn.functional.linear(x, self.head).float()

    def reference_greedy(self, prompt: list[int], budget: int, embeds=None, penalty: float = 1.0) -> list[int]:  # noqa: ANN001
        """Recompute the whole sequence for every token: no cache, no batching. ``embeds``
        (positions, vectors) replace prompt token embeddings; ``penalty`` is transformers'
        RepetitionPenaltyLogitsProcessor written out."""
        seq = list(prompt)
        out: list[int] = []
        with torch.no_grad():
            while len(out) < budget and len(seq) < CONTEXT:
                tok = torch.tensor([seq])
                x = self.emb[tok] + self.pos[: len(seq)][None]
                if embeds is not None:
                    for p, vec in zip(embeds[0], embeds[1], strict=True):
                        x[0, p] = vec + self.pos[p]

                def attend(li, q, k, v):  # noqa: ANN001, ANN202, ARG001
                    k, v = self._split(k), self._split(v)  # repeat_kv, as transformers does
                    k = k.repeat_interleave(HEADS // self.kv_heads, dim=1)
                    v = v.repeat_interleave(HEADS // self.kv_heads, dim=1)
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                logits = self.layers(x, attend)[0, -1]
                if penalty != 1.0:
                    ids = torch.tensor(sorted(set(seq)))
                    score = logits[ids]
                    logits[ids] = torch.where(score < 0, score * penalty, score / penalty)
                nxt = int(logits.argmax())
                out.append(nxt)
                seq.append(nxt)
                if nxt == STOP:
                    break
        return out


class TinyStepModel:
    """:class:`oasr.executors.autoregressive.StepModel` over :class:`TinyDecoder`."""

    num_layers, head_dim = LAYERS, D // HEADS
    max_positions, vocab_size, cross_shape, extra_bytes = CONTEXT, VOCAB, None, 0

    def __init__(self, net: TinyDecoder) -> None:
        self.net = net
        self.num_kv_heads = net.kv_heads
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def encode(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seq, _ = inputs  # "audio features": 3 vectors per request, a function of its index
        g = [torch.Generator().manual_seed(int(s)) for s in seq.tolist()]
        return torch.stack([torch.randn(3, D, generator=x) for x in g])

    def project_cross(self, layer, features):  # noqa: ANN001, ANN201 - no cross-attention
        raise AssertionError("not called without cross_shape")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = ctx.input_embeddings(self.net.emb[tokens]) + self.net.pos[positions]
        return self.net.layers(x, ctx.self_attention)


class OneWindowDriver:
    """A request's audio array holds its prompt token ids; one window, then the result. Options
    read from ``request.options.extra``: ``embeds`` (positions: the prompt positions whose
    embeddings are the features of the window), ``repetition_penalty``, ``seed``."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def accept(self, request) -> bool:  # noqa: ANN001
        return True

    def begin(self, requests, ex: AutoregressiveExecutor) -> None:  # noqa: ANN001
        for r in requests:
            ex.encode_later(Window(r))

    def encoder_inputs(self, windows) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        # a tuple of tensors: the encoder sees the request index and the number of rows
        return torch.tensor([float(w.request.seq) for w in windows]), torch.zeros(len(windows))

    def encoded(self, windows, features, ex: AutoregressiveExecutor) -> None:  # noqa: ANN001
        for k, w in enumerate(windows):
            w.features = features[k : k + 1]
            w.prompt = [int(t) for t in w.request.audio]
            w.sample_len = w.request.options.max_new_tokens or 20
            w.temperature = float(w.request.options.temperatures[0])
            extra = w.request.options.model_options
            w.top_k = extra.get("top_k", 1 if w.temperature > 0 else None) or None  # top-k 1 sampling is greedy
            w.stop_tokens = (STOP,)
            w.repetition_penalty = extra.get("repetition_penalty", 1.0)
            w.seed = extra.get("seed")
            if "embeds" in extra:
                w.embeds = (extra["embeds"], features[k, : len(extra["embeds"])])
            ex.decode_later(w)

    def prefilled(self, rows, logits) -> None:  # noqa: ANN001
        pass

    def process_logits(self, logits, rows) -> None:  # noqa: ANN001
        pass

    def finished(self, row, ex: AutoregressiveExecutor) -> None:  # noqa: ANN001
        tokens = list(row.sampled)
        ex.finish(row.window.request, Transcript(text=" ".join(map(str, tokens)), language=None, duration=0.0))

    def release(self, request) -> None:  # noqa: ANN001
        self.released.append(request.rid)


class TinyModel:
    name = "tiny decoder"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.LLM)
    feature_spec = FeatureSpec(kind="none")

    def transcribe(self, audios, options, progress=None):  # noqa: ANN001, ANN201
        raise AssertionError("every request runs on the rows")


def _prompts(n: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(2, 9))).astype(np.float32) for _ in range(n)]


def _scheduler(net: TinyDecoder, **kw) -> tuple[Scheduler, AutoregressiveExecutor]:
    config = SchedulerConfig(**{"max_batch_size": 3, "block_size": 4, "min_admit_group": 1, **kw})
    ex = AutoregressiveExecutor(TinyModel(), TinyStepModel(net), OneWindowDriver(), config)
    return Scheduler(ex, config), ex


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "top_k_1"])
def test_paged_rows_equal_a_full_recompute(temperature):
    net = TinyDecoder()
    sched, ex = _scheduler(net)
    prompts = _prompts(7)
    opts = DecodingOptions(max_new_tokens=20, temperature=temperature)
    futures = [sched.submit(p, opts) for p in prompts]
    sched.run_until_idle()
    got = [[int(t) for t in f.result().text.split()] for f in futures]
    want = [net.reference_greedy([int(t) for t in p], 20) for p in prompts]
    assert got == want
    # the outputs mean something: varied tokens and lengths, some stopping early
    assert len({tuple(g) for g in got}) == len(got) and len({len(g) for g in got}) > 1
    assert ex.stats["max_rows"] == 3  # 7 requests through 3 rows: rows were refilled
    assert ex.cache.allocator.num_free == ex.cache.allocator.capacity
    assert not ex.rows and not ex.active and sorted(ex.driver.released) == sorted(f.rid for f in futures)


def test_memory_budget_limits_rows_and_abort_frees_blocks():
    net = TinyDecoder(seed=2)
    probe = _scheduler(net)[1]
    per_row = probe.cache.nbytes // (probe.cache.num_blocks - 1) * probe.max_blocks
    sched, ex = _scheduler(net, kv_cache_bytes=int(per_row * 1.1))
    # no cross-attention pools: the slots stay, the blocks run short (a window reserves its
    # prompt + budget up front), so one row decodes at a time
    assert ex.max_rows == 3 and ex.cache.allocator.capacity < 2 * probe.max_blocks
    prompts = _prompts(3, seed=3)
    opts = DecodingOptions(max_new_tokens=30)
    futures = [sched.submit(p, opts) for p in prompts]
    sched.step()
    sched.step()
    assert sched.abort(futures[0].rid)
    sched.run_until_idle()
    with pytest.raises(RequestAbortedError):
        futures[0].result()
    for p, f in zip(prompts[1:], futures[1:], strict=True):
        assert [int(t) for t in f.result().text.split()] == net.reference_greedy([int(t) for t in p], 30)
    assert ex.stats["max_rows"] == 1
    assert ex.cache.allocator.num_free == ex.cache.allocator.capacity


def test_a_prompt_longer_than_the_context_fails_alone():
    net = TinyDecoder()
    sched, _ = _scheduler(net)
    too_long = np.ones(CONTEXT, np.float32)
    ok = _prompts(1)[0]
    f_bad, f_ok = sched.submit(too_long, DecodingOptions()), sched.submit(ok, DecodingOptions())
    sched.run_until_idle()
    with pytest.raises(Exception, match="prompt is 48 tokens"):
        f_bad.result()
    assert [int(t) for t in f_ok.result().text.split()] == net.reference_greedy([int(t) for t in ok], 20)


def _run(net: TinyDecoder, prompts, options, **kw) -> tuple[list[list[int]], AutoregressiveExecutor]:  # noqa: ANN001
    sched, ex = _scheduler(net, **kw)
    opts = options if isinstance(options, list) else [options] * len(prompts)
    futures = [sched.submit(p, o) for p, o in zip(prompts, opts, strict=True)]
    sched.run_until_idle()
    return [[int(t) for t in f.result().text.split()] for f in futures], ex


def test_grouped_query_attention_stores_kv_heads_only():
    net = TinyDecoder(seed=4, kv_heads=2)
    prompts = _prompts(6, seed=5)
    got, ex = _run(net, prompts, DecodingOptions(max_new_tokens=20))
    assert ex.cache.num_heads == 2 and ex.cache.k[0].shape[2:] == (2, D // HEADS)
    want = [net.reference_greedy([int(t) for t in p], 20) for p in prompts]
    assert got == want and len({tuple(g) for g in got}) >= 4


@pytest.mark.parametrize("kv_heads", [HEADS, 1])
def test_prompt_embeddings_replace_token_embeddings(kv_heads):
    """A window's ``embeds`` (a speech-LLM's audio in place of placeholder tokens) go into the
    prefill; rows with and without them share a prefill group."""
    net = TinyDecoder(seed=6, kv_heads=kv_heads)
    prompts = [np.array([5, 7, 7, 7, 9, 3], np.float32), np.array([5, 7, 7, 7, 9, 3], np.float32),
               np.array([4, 8, 8, 8, 2, 11], np.float32)]  # fmt: skip
    opts = [DecodingOptions(max_new_tokens=15, model_options={"embeds": [1, 2, 3]}),
            DecodingOptions(max_new_tokens=15),
            DecodingOptions(max_new_tokens=15, model_options={"embeds": [2, 3]})]  # fmt: skip
    got, _ = _run(net, prompts, opts)
    sm = TinyStepModel(net)
    want = []
    for k, (p, o) in enumerate(zip(prompts, opts, strict=True)):
        pos = o.model_options.get("embeds")
        feats = sm.encode((torch.tensor([float(k)]), torch.zeros(1)))[0]
        embeds = None if pos is None else (pos, feats[: len(pos)])
        want.append(net.reference_greedy([int(t) for t in p], 15, embeds=embeds))
    assert got == want
    assert got[0] != got[1]  # the embeddings changed what was decoded


def test_repetition_penalty_is_transformers_processor():
    net = TinyDecoder(seed=7, kv_heads=2)
    prompts = _prompts(4, seed=8)
    plain, _ = _run(net, prompts, DecodingOptions(max_new_tokens=25))
    opts = [DecodingOptions(max_new_tokens=25, model_options={"repetition_penalty": p}) for p in (1.5, 1.5, 0.7, 3.0)]
    got, _ = _run(net, prompts, opts)
    want = [net.reference_greedy([int(t) for t in p], 25, penalty=o.model_options["repetition_penalty"])
            for p, o in zip(prompts, opts, strict=True)]  # fmt: skip
    assert got == want and got != plain


def test_seeded_sampling_does_not_depend_on_the_batch():
    net = TinyDecoder(seed=9)
    prompts = _prompts(5, seed=10)

    def opts(seed):  # noqa: ANN001, ANN202
        return DecodingOptions(max_new_tokens=20, temperature=1.5, model_options={"seed": seed, "top_k": 0})

    together, _ = _run(net, prompts, [opts(s) for s in range(5)])
    alone = [_run(net, [p], opts(s), max_batch_size=1)[0][0] for s, p in enumerate(prompts)]
    assert together == alone
    again, _ = _run(net, prompts[:1], opts(0))
    other, _ = _run(net, prompts[:1], opts(1))
    greedy, _ = _run(net, prompts[:1], DecodingOptions(max_new_tokens=20))
    assert again[0] == together[0] and (other[0] != together[0] or greedy[0] != together[0])
