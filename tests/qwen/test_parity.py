"""Qwen2-Audio against transformers' own Qwen2AudioForConditionalGeneration and
Qwen2AudioProcessor, run here on the tiny random checkpoints of conftest.py: the same prompt ids
(placeholder expansion included), audio embeddings and prefill logits within tolerance, greedy
tokens identical to generate(), batched equal to one at a time, seeded sampling reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from oasr.checkpoint import load_model  # noqa: E402
from oasr.types import DecodingOptions, EngineConfig  # noqa: E402

pytestmark = pytest.mark.slow
N_NEW = 24


@pytest.fixture(scope="module")
def ours_chat(qwen_chat_dir):
    return load_model(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def ours_base(qwen_base_dir):
    return load_model(EngineConfig(ckpt_dir=str(qwen_base_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf_chat(qwen_chat_dir):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(qwen_chat_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(qwen_chat_dir)


@pytest.fixture(scope="module")
def hf_base(qwen_base_dir):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(qwen_base_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(qwen_base_dir)


def _chat_text(processor, instruction: str) -> str:
    conversation = [{"role": "user", "content": [{"type": "audio", "audio_url": "x.wav"},
                                                 {"type": "text", "text": instruction}]}]  # fmt: skip
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def _hf_inputs(processor, text: str, clip: np.ndarray):
    return processor(text=text, audio=[clip], sampling_rate=16000, return_tensors="pt")


def _hf_greedy(model, inputs, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False, **kw)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    stops = set(model.generation_config.eos_token_id)
    return new[: next((i for i, t in enumerate(new) if t in stops), len(new))]


def _our_prompt(model, options: DecodingOptions, clip: np.ndarray) -> list[int]:
    from oasr_models_qwen.nn import encoder_lengths

    ids, at = model.prompt_ids(options)
    frames = -(-len(clip) // 160)
    n = int(encoder_lengths(torch.tensor(frames))[1])
    return ids[:at] + [model.tokenizer.audio_id] * n + ids[at + 1 :]


def test_prompts_are_the_processors(ours_chat, hf_chat, ours_base, hf_base, clips):
    model, processor = hf_chat
    opts = DecodingOptions()
    text = _chat_text(processor, "Transcribe the speech.")
    assert ours_chat.prompt_text(opts) == text
    for clip in clips:
        assert _our_prompt(ours_chat, opts, clip) == _hf_inputs(processor, text, clip)["input_ids"][0].tolist()
    tr = DecodingOptions(task="translate", language="de")
    assert ours_chat.prompt_text(tr) == _chat_text(processor, "Translate the German speech into English.")
    assert ours_chat.prompt_text(DecodingOptions(prompt="What is said?")) == _chat_text(processor, "What is said?")
    # the base model: the model card's prompt, language tag when the language is given
    _, bproc = hf_base
    base = "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech: <|en|>"
    assert ours_base.prompt_text(DecodingOptions(language="en")) == base
    assert _our_prompt(ours_base, DecodingOptions(language="en"), clips[0]) == \
        _hf_inputs(bproc, base, clips[0])["input_ids"][0].tolist()  # fmt: skip


def test_audio_embeddings_and_logits_match(ours_chat, hf_chat, clips):
    from transformers.masking_utils import create_bidirectional_mask

    model, processor = hf_chat
    text = _chat_text(processor, "Transcribe the speech.")
    inputs = _hf_inputs(processor, text, clips[1])
    # the encoder + projector, as Qwen2AudioModel.forward runs them
    tower = model.model.audio_tower
    conv_len, n_audio = tower._get_feat_extract_output_lengths(inputs["feature_attention_mask"].sum(-1))
    mask2d = (torch.arange(1500)[None] < conv_len[:, None]).long()
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, 1500, 1), attention_mask=mask2d)
    with torch.no_grad():
        want = model.model.multi_modal_projector(tower(inputs["input_features"], attention_mask=mask).last_hidden_state)
    from oasr_models_qwen.engine_adapter import window_mel

    mel, frames = window_mel(torch.as_tensor(clips[1]), 128)
    assert frames == int(inputs["feature_attention_mask"].sum())
    torch.testing.assert_close(mel, inputs["input_features"][0], atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        got = ours_chat.network.encode(mel[None], torch.tensor([frames]))
    n = int(n_audio)
    torch.testing.assert_close(got[:, :n], want[:, :n], atol=2e-4, rtol=1e-3)
    assert got[:, :n].abs().mean() > 0.1  # not a degenerate output


def test_prompt_logits_match(ours_chat, hf_chat, clips):
    """The decoder over the whole prompt (audio embeddings in place of the placeholders, rotary
    positions, grouped heads) against transformers' forward."""
    from oasr.layers.attention import grouped_attention
    from oasr_models_qwen.engine_adapter import window_mel

    model, processor = hf_chat
    inputs = _hf_inputs(processor, _chat_text(processor, "Transcribe the speech."), clips[0])
    with torch.no_grad():
        want = model(**inputs).logits[0]
    ids = inputs["input_ids"]
    net = ours_chat.network
    mel, frames = window_mel(torch.as_tensor(clips[0]), 128)
    t = ids.shape[1]
    dims = net.config.text

    def attend(li, q, k, v):  # noqa: ANN001, ANN202, ARG001 - plain causal attention, no cache
        k = k.view(1, t, dims.kv_heads, dims.head_dim).transpose(1, 2)
        v = v.view(1, t, dims.kv_heads, dims.head_dim).transpose(1, 2)
        return grouped_attention(q, k, v, torch.ones(t, t, dtype=torch.bool).tril()[None, None])

    with torch.no_grad():
        audio = net.encode(mel[None], torch.tensor([frames]))[0]
        x = net.decoder.embed_tokens(ids)
        at = (ids[0] == ours_chat.tokenizer.audio_id).nonzero()[:, 0]
        x[0, at] = audio[: len(at)]
        got = net.logits(net.decoder(x, torch.arange(t)[None], attend))[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert want.std() > 1.0  # decisive logits, not a flat distribution


def test_greedy_tokens_equal_generate_chat(ours_chat, hf_chat, clips):
    model, processor = hf_chat
    text = _chat_text(processor, "Transcribe the speech.")
    want = [_hf_greedy(model, _hf_inputs(processor, text, c)) for c in clips]
    got = ours_chat.transcribe(clips, DecodingOptions(max_new_tokens=N_NEW))
    assert [t.segments[0].tokens for t in got] == want
    # the outputs mean something: varied tokens, long sequences
    assert len({tuple(w) for w in want}) == len(want) and all(len(set(w)) > 4 for w in want)
    assert [t.text for t in got] == [processor.tokenizer.decode(w, skip_special_tokens=True).strip() for w in want]
    # one at a time equals the batch
    alone = [ours_chat.transcribe([c], DecodingOptions(max_new_tokens=N_NEW))[0] for c in clips]
    assert [a.segments[0].tokens for a in alone] == want


def test_whole_30s_windows_equal_generate(ours_chat, hf_chat, clips):
    """Whole 30 s windows (the encoder runs without a padding mask; equal lengths share one
    log-mel batch) beside a short clip: greedy tokens identical to generate()."""
    model, processor = hf_chat
    rng = np.random.default_rng(5)
    t = np.arange(16000 * 30) / 16000
    full = [(0.3 * np.sin(2 * np.pi * f * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
            for f in (250.0, 390.0)]  # fmt: skip
    batch = [full[0], clips[0], full[1]]
    text = _chat_text(processor, "Transcribe the speech.")
    want = [_hf_greedy(model, _hf_inputs(processor, text, c)) for c in batch]
    got = ours_chat.transcribe(batch, DecodingOptions(max_new_tokens=N_NEW))
    assert [g.segments[0].tokens for g in got] == want
    assert want[0] != want[2] and all(len(w) > 4 for w in want)


def test_greedy_tokens_equal_generate_base_with_options(ours_base, hf_base, clips):
    model, processor = hf_base
    base = "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech:"
    want = [_hf_greedy(model, _hf_inputs(processor, base, c), repetition_penalty=1.3) for c in clips]
    opts = DecodingOptions(max_new_tokens=N_NEW, model_options={"repetition_penalty": 1.3})
    got = ours_base.transcribe(clips, opts)
    assert [t.segments[0].tokens for t in got] == want
    plain = [_hf_greedy(model, _hf_inputs(processor, base, c)) for c in clips]
    assert plain != want  # the penalty changed something


def test_seeded_sampling_is_reproducible(ours_chat, clips):
    def run(seed, clips=clips):  # noqa: ANN001, ANN202
        opts = DecodingOptions(max_new_tokens=N_NEW, temperature=1.0,
                               model_options={"seed": seed, "top_p": 0.95, "top_k": 50})  # fmt: skip
        return [t.segments[0].tokens for t in ours_chat.transcribe(clips, opts)]

    first = run(7)
    assert run(7) == first
    assert run(7, clips[:1]) == first[:1]  # does not depend on the batch
    assert run(8) != first
