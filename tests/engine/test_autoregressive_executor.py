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
    """Token + position embeddings, causal self-attention blocks, an output head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g))
        self.pos = torch.nn.Parameter(0.3 * torch.randn(CONTEXT, D, generator=g))
        self.qkv = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3 * D, D, generator=g) / D**0.5)
                                           for _ in range(LAYERS)])  # fmt: skip
        self.out = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)
                                           for _ in range(LAYERS)])  # fmt: skip
        self.head = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g) / D**0.5)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, D/H)
        b, t, _ = x.shape
        return x.view(b, t, HEADS, D // HEADS).transpose(1, 2)

    def layers(self, x: torch.Tensor, attend) -> torch.Tensor:  # noqa: ANN001
        b, t, _ = x.shape
        for li in range(LAYERS):
            q, k, v = torch.nn.functional.linear(x, self.qkv[li]).split(D, dim=-1)
            out = attend(li, self._split(q), k, v)
            x = x + torch.nn.functional.linear(out.transpose(1, 2).reshape(b, t, D), self.out[li])
        return torch.nn.functional.linear(x, self.head).float()

    def reference_greedy(self, prompt: list[int], budget: int) -> list[int]:
        """Recompute the whole sequence for every token: no cache, no batching."""
        seq = list(prompt)
        out: list[int] = []
        with torch.no_grad():
            while len(out) < budget and len(seq) < CONTEXT:
                tok = torch.tensor([seq])
                x = self.emb[tok] + self.pos[: len(seq)][None]

                def attend(li, q, k, v):  # noqa: ANN001, ANN202, ARG001
                    k, v = self._split(k), self._split(v)
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                nxt = int(self.layers(x, attend)[0, -1].argmax())
                out.append(nxt)
                seq.append(nxt)
                if nxt == STOP:
                    break
        return out


class TinyStepModel:
    """:class:`oasr.executors.autoregressive.StepModel` over :class:`TinyDecoder`."""

    num_layers, num_kv_heads, head_dim = LAYERS, HEADS, D // HEADS
    max_positions, vocab_size, cross_shape, extra_bytes = CONTEXT, VOCAB, None, 0

    def __init__(self, net: TinyDecoder) -> None:
        self.net = net
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs  # the prompt is all the decoder sees

    def project_cross(self, layer, features):  # noqa: ANN001, ANN201 - no cross-attention
        raise AssertionError("not called without cross_shape")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = self.net.emb[tokens] + self.net.pos[positions]
        return self.net.layers(x, ctx.self_attention)


class OneWindowDriver:
    """A request's audio array holds its prompt token ids; one window, then the result."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def accept(self, request) -> bool:  # noqa: ANN001
        return True

    def begin(self, requests, ex: AutoregressiveExecutor) -> None:  # noqa: ANN001
        for r in requests:
            ex.encode_later(Window(r))

    def encoder_inputs(self, windows) -> torch.Tensor:  # noqa: ANN001
        return torch.zeros(len(windows), 1, 1)

    def encoded(self, windows, features, ex: AutoregressiveExecutor) -> None:  # noqa: ANN001
        for k, w in enumerate(windows):
            w.features = features[k : k + 1]
            w.prompt = [int(t) for t in w.request.audio]
            w.sample_len = w.request.options.max_new_tokens or 20
            w.temperature = float(w.request.options.temperatures[0])
            w.top_k = 1 if w.temperature > 0 else None  # top-k 1 sampling is greedy
            w.stop_tokens = (STOP,)
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
