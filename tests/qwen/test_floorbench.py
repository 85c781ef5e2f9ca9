"""benchmarks.floorbench's arithmetic (CPU): the workload's dimensions, FLOP and byte counts
against numbers worked out by hand from the 7B shapes, and the command line without a GPU."""

from __future__ import annotations

import pytest

from benchmarks import floorbench as fb

W = fb.workload()


def test_workload_dims_and_prompt_length():
    import torch

    from oasr_models_qwen.nn import encoder_lengths

    assert fb.audio_lengths(3000) == (1500, 750)
    conv, tokens = encoder_lengths(torch.tensor([3000]))
    assert (int(conv), int(tokens)) == (1500, 750)
    assert W["prompt"] == 750 + 91 and W["frames"] == 1500
    assert (W["d"], W["enc_layers"], W["enc_heads"], W["ffn"]) == (1280, 32, 20, 5120)
    assert (W["hidden"], W["inter"], W["layers"], W["heads"]) == (4096, 11008, 32, 32)
    assert W["head_dim"] == 128
    assert (W["kv_width"], W["vocab"]) == (4096, 156032)


def test_text_tokens_match_qwenbench_prompt():
    """91 = qwenbench's chat prompt in its byte-level tokenizer, besides the one <|AUDIO|>."""
    pytest.importorskip("tokenizers")
    from benchmarks.qwenbench import bench_tokenizer
    from oasr_models_qwen.tokenizer import DEFAULT_CHAT_TEMPLATE, QwenTokenizer, build_prompt

    tok = QwenTokenizer(bench_tokenizer(512))
    text = build_prompt(chat=True, task="transcribe", language=None, prompt=None,
                        chat_template=DEFAULT_CHAT_TEMPLATE)  # fmt: skip
    ids = tok.encode(text)
    assert ids.count(tok.audio_id) == 1
    assert len(ids) - 1 == 91


def test_kv_read_bytes():
    steps = fb.kv_read_bytes(W)
    assert len(steps) == 99  # 100 tokens: the prefill samples the first
    per_position = 32 * 2 * 32 * 4096 * 2  # layers x (K, V) x rows x kv width x bf16
    assert per_position == 16_777_216
    assert steps[0] == per_position * 842 == 14_126_415_872  # 841 prompt + the step's own token
    assert steps[-1] == per_position * 940
    assert sum(steps) == per_position * (842 + 940) * 99 // 2 == 1_479_901_446_144


def test_flop_counts():
    assert fb.linear_flops(26912, 4096, 12288) == 2 * 26912 * 4096 * 12288
    assert fb.attention_flops(32, 20, 1500, 1500, 64, False) == 4 * 32 * 20 * 1500 * 1500 * 64
    assert fb.attention_flops(1, 1, 4, 4, 1, True) == 4 * (1 + 2 + 3 + 4)
    assert fb.attention_flops(1, 1, 2, 5, 1, True) == 4 * (4 + 5)  # the last 2 queries of 5 keys
    last_query = fb.attention_flops(32, 32, 1, 841, 128, True)  # sees every key
    assert last_query == fb.attention_flops(32, 32, 1, 841, 128, False)


def test_elementwise_bytes():
    n, d, f = 32 * 1500, 1280, 5120
    # GELU after each conv (3000, then 1500 frames), the transpose, + positions
    stem = 2 * 32 * d * 3000 + 3 * 2 * n * d
    tail = n * d + n * d // 2 + 2 * (n * d // 2)  # pooling reads n, writes n/2; final LayerNorm
    enc = 2 * (stem + 32 * (2 * 4 * n * d + 2 * n * f) + tail)
    assert fb.encoder_elementwise_bytes(W) == enc == 64_450_560_000

    # add + norm x2, rotary q and k, K/V store, silu(gate) * up
    per_token = 2 * 4 * 4096 + 2 * 8192 + 4 * 4096 + 3 * 11008
    assert per_token == 98_560
    t = 32 * 841
    last = t * (2 * 8192 + 4 * 4096) + 32 * (2 * 4 * 4096 + 3 * 11008)
    pre = 2 * (4 * t * 4096 + 31 * t * per_token + last)
    assert fb.prefill_elementwise_bytes(W) == pre == 167_101_464_576
    assert fb.decode_step_elementwise_bytes(W) == 2 * (4 * 32 * 4096 + 32 * 32 * per_token)


def test_phases_and_table():
    oasr = fb.parse_phases(fb.OASR_PHASES)
    assert oasr["encoder"] == 0.1446 and oasr["decode_steps"] == 0.8865 and oasr["wall"] == 1.6242
    with pytest.raises(ValueError, match="wall"):
        fb.parse_phases("encoder=1,prefill=1,decode_steps=1,sampling=1")
    floor = {"encoder": 0.1, "prefill": 0.5, "decode": 0.594, "sampling": 0.01}
    rows = {name: (f, o) for name, f, o in fb.table_rows(floor, oasr, 99)}
    assert rows["  per decode step (ms)"] == pytest.approx((6.0, 8.954545), rel=1e-6)
    assert rows["total (s)"] == pytest.approx((1.194, 1.6242))
    other = rows["features + host, not modelled (s)"]
    assert other[0] is None and other[1] == pytest.approx(1.6242 - 0.1446 - 0.5578 - 0.8865)


def test_cli_without_gpu(monkeypatch, capsys):
    import torch

    with pytest.raises(SystemExit) as e:
        fb.main(["--help"])
    assert e.value.code == 0 and "--oasr-phases" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        fb.main(["--oasr-phases", "encoder=1"])
    assert e.value.code == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        fb.main([])
