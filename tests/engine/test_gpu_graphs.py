"""CUDA-graph decoder steps give the eager steps' tokens (run on a GPU: pytest -m gpu)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graphs_match_eager(dtype):
    import numpy as np

    from benchmarks.synthetic import build_models
    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import DecodingOptions, EngineConfig

    _, asr = build_models("tiny", "cuda", dtype, 8, seed=3)
    tok = asr.tokenizer
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32) for s in (30, 12, 30, 7, 20)]
    opts = DecodingOptions.build(language="en", max_new_tokens=40, suppress_tokens=(tok.eot,),
                           no_speech_threshold=None, logprob_threshold=None,
                           compression_ratio_threshold=None)  # fmt: skip
    texts = {}
    for graphs in (False, True):
        sc = SchedulerConfig(max_batch_size=3, cuda_graphs=graphs)
        eng = ASREngine(EngineConfig(device="cuda", dtype=dtype, max_batch_size=3), model=asr,
                        scheduler_config=sc)  # fmt: skip
        outs = eng.transcribe_outputs(audios, decoding=opts)
        ex = eng.scheduler.executor
        assert (ex.stats["graph_replays"] > 0) == graphs
        texts[graphs] = [[t for s in o.transcript.segments for t in s.tokens] for o in outs]
        assert all(o.ok for o in outs)
    if dtype == "float32":
        assert texts[True] == texts[False]
    else:  # fp16: other GEMM shapes (padded batch, bucketed key length) may round differently
        pairs = [(a, b) for x, y in zip(texts[True], texts[False], strict=True) for a, b in zip(x, y, strict=False)]
        same = sum(a == b for a, b in pairs) / max(1, len(pairs))
        assert texts[True][0][:5] == texts[False][0][:5] and same >= 0.9, same


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encoder_lookahead_keeps_tokens():
    """Windows encoded ahead on the side stream, while rows decode, give the tokens of the
    plain schedule (fp32: same kernels, only the timing differs)."""
    import numpy as np

    from benchmarks.synthetic import build_models
    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import DecodingOptions, EngineConfig

    _, asr = build_models("tiny", "cuda", "float32", 2, seed=5)
    tok = asr.tokenizer
    rng = np.random.default_rng(1)
    audios = [(0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32)
              for s in (30, 12, 45, 7, 20, 30, 3)]  # fmt: skip
    opts = DecodingOptions.build(language="en", max_new_tokens=30, suppress_tokens=(tok.eot,),
                           no_speech_threshold=None, logprob_threshold=None,
                           compression_ratio_threshold=None)  # fmt: skip
    texts, overlapped = {}, {}
    for lookahead in (0, 2):
        sc = SchedulerConfig(max_batch_size=2, encoder_lookahead=lookahead, min_admit_group=1)
        eng = ASREngine(EngineConfig(device="cuda", dtype="float32", max_batch_size=2), model=asr,
                        scheduler_config=sc)  # fmt: skip
        outs = eng.transcribe_outputs(audios, decoding=opts)
        assert all(o.ok for o in outs)
        texts[lookahead] = [[t for s in o.transcript.segments for t in s.tokens] for o in outs]
        overlapped[lookahead] = eng.scheduler.executor.stats["overlapped_encodes"]
        eng.shutdown()
    assert overlapped[0] == 0 and overlapped[2] > 0
    assert texts[2] == texts[0]
