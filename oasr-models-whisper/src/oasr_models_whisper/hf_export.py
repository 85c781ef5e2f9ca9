"""Any Whisper checkpoint OASR loads, as a ``transformers`` ``WhisperForConditionalGeneration``.

Used to run reference engines (the ``transformers`` ASR pipeline) on exactly the weights OASR
runs, e.g. the CTranslate2 tiny.en, which has no Hugging Face copy on disk::

    loaded = load_any(path)                       # or load_ct2 / load_hf / ...
    tok = WhisperASR.from_loaded(loaded).tokenizer     # OASR's tokenizer: the special ids
    model = to_hf_model(loaded, tok)              # fp32, CPU, eval
    model.generation_config = hf_generation_config(loaded, tok)
    hf_tokenizer(loaded)                          # WhisperTokenizerFast over tokenizer.json
    hf_state_dict(loaded.state_dict)              # the renaming alone

The renaming is the inverse of :func:`oasr_models_whisper.checkpoints._hf_name`, and checked
against it name by name. Two things OASR's naming leaves out, and how they come back:

* key biases: Whisper's key projections have no bias (HF's ``k_proj`` is ``bias=False``);
  CTranslate2 stores zero rows for them in its fused projections, which the loader drops.
* the output projection: Whisper ties it to the token embedding (CTranslate2 stores
  ``decoder/projection/weight`` as an alias of ``decoder/embeddings/weight``); OASR computes
  logits with ``decoder.embed_tokens``, so ``proj_out`` gets that same tensor.

``transformers`` is imported only inside the functions (it is not a dependency of the plugin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from oasr.errors import CheckpointError

if TYPE_CHECKING:
    from oasr_models_whisper.checkpoints import LoadedWhisper
    from oasr_models_whisper.tokenizer import WhisperTokenizer

#: OASR block module -> HF block module (inverse of ``checkpoints._HF_BLOCK``)
_TO_HF_BLOCK = (
    ("self_attn_norm", "self_attn_layer_norm"),
    ("cross_attn_norm", "encoder_attn_layer_norm"),
    ("cross_attn", "encoder_attn"),
    ("self_attn", "self_attn"),
    ("mlp_norm", "final_layer_norm"),
    ("mlp.fc1", "fc1"),
    ("mlp.fc2", "fc2"),
)


def hf_name(name: str) -> str:
    """OASR tensor name -> ``WhisperForConditionalGeneration`` state-dict name."""
    side, _, rest = name.partition(".")
    if side in ("encoder", "decoder"):
        if rest == "positional_embedding":
            return f"model.{side}.embed_positions.weight"
        if rest.startswith("final_norm."):
            return f"model.{side}.layer_norm.{rest.split('.', 1)[1]}"
        if rest.startswith(("conv1.", "conv2.", "embed_tokens.")):
            return f"model.{side}.{rest}"
        if rest.startswith("layers."):
            _, idx, sub = rest.split(".", 2)
            for ours, theirs in _TO_HF_BLOCK:
                if sub.startswith(ours + "."):
                    return f"model.{side}.layers.{idx}.{theirs}.{sub[len(ours) + 1 :]}"
    raise CheckpointError(f"no Hugging Face name for Whisper tensor {name!r}")


def hf_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OASR's normalized Whisper state dict renamed for ``WhisperForConditionalGeneration``,
    with ``proj_out.weight`` = the token embedding (tied, as OASR computes logits)."""
    from oasr_models_whisper.checkpoints import _hf_name

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        new = hf_name(name)
        if _hf_name(new) != name:  # the loader must read our name back as the original
            raise CheckpointError(f"{name!r} -> {new!r} does not round-trip through the HF loader")
        out[new] = tensor
    out["proj_out.weight"] = state["decoder.embed_tokens.weight"]
    return out


def hf_config(loaded: LoadedWhisper, tokenizer: WhisperTokenizer | None = None) -> Any:
    """A ``transformers.WhisperConfig`` for ``loaded``'s shapes (special ids from ``tokenizer``
    when given: tiny.en's end-of-text is 50256, the multilingual vocabularies' is 50257).
    Decoding settings live in :func:`hf_generation_config`, not here (transformers 5 warns
    about generation parameters in a model config)."""
    from transformers import WhisperConfig

    d = loaded.dims
    if d.n_audio_state != d.n_text_state:
        raise CheckpointError("transformers' Whisper has one d_model; this model has two widths")
    eot = tokenizer.eot if tokenizer is not None else (50257 if loaded.is_multilingual else 50256)
    sot = tokenizer.sot if tokenizer is not None else eot + 1
    return WhisperConfig(
        vocab_size=d.n_vocab, num_mel_bins=d.n_mels, d_model=d.n_audio_state,
        encoder_layers=d.n_audio_layer, decoder_layers=d.n_text_layer,
        encoder_attention_heads=d.n_audio_head, decoder_attention_heads=d.n_text_head,
        encoder_ffn_dim=4 * d.n_audio_state, decoder_ffn_dim=4 * d.n_text_state,
        max_source_positions=d.n_audio_ctx, max_target_positions=d.n_text_ctx,
        activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
        bos_token_id=sot, decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot,
    )  # fmt: skip


def to_hf_model(
    loaded: LoadedWhisper,
    tokenizer: WhisperTokenizer | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
) -> Any:
    """``WhisperForConditionalGeneration`` holding ``loaded``'s weights (cast to ``dtype``), in
    eval mode; every parameter comes from the checkpoint (strict load, nothing left at init)."""
    from transformers import WhisperForConditionalGeneration

    cfg = hf_config(loaded, tokenizer)
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(cfg)
    state = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in hf_state_dict(loaded.state_dict).items()
    }
    # proj_out and embed_tokens must stay one tensor after the load (assign=True adopts them)
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"HF Whisper: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval().requires_grad_(False)


def hf_generation_config(loaded: LoadedWhisper, tokenizer: WhisperTokenizer) -> Any:
    """Greedy, no timestamps, max 448 tokens, with the suppress lists OASR decodes with
    (``resolve_suppress_tokens`` over the checkpoint's non-speech list; ``<|endoftext|>`` and the
    space at the first step). English-only models start ``<|startoftranscript|><|notimestamps|>``
    (no language or task token exists for them); multilingual ones get ``lang_to_id`` and
    ``task_to_id`` so ``generate(language=..., task=...)`` works."""
    from transformers import GenerationConfig

    from oasr_models_whisper.decoding import resolve_suppress_tokens

    suppress = resolve_suppress_tokens(tokenizer, (-1,), loaded.suppress_tokens)
    fields: dict[str, Any] = {
        "decoder_start_token_id": tokenizer.sot,
        "bos_token_id": tokenizer.eot,
        "eos_token_id": tokenizer.eot,
        "pad_token_id": tokenizer.eot,
        "no_timestamps_token_id": tokenizer.no_timestamps,
        "prev_sot_token_id": tokenizer.sot_prev,
        "suppress_tokens": list(suppress),
        "begin_suppress_tokens": [tokenizer.encode(" ")[0], tokenizer.eot],
        "is_multilingual": loaded.is_multilingual,
        "max_length": loaded.dims.n_text_ctx,
        "max_initial_timestamp_index": 50,
        "return_timestamps": False,
        "do_sample": False,
        "num_beams": 1,
        "alignment_heads": loaded.alignment_heads.tolist(),
    }
    if loaded.is_multilingual:
        fields["lang_to_id"] = {f"<|{c}|>": t for c, t in tokenizer.language_tokens.items()}
        fields["task_to_id"] = {"transcribe": tokenizer.transcribe,
                                "translate": tokenizer.translate}  # fmt: skip
    return GenerationConfig(**fields)


def hf_tokenizer(loaded: LoadedWhisper) -> Any:
    """``WhisperTokenizerFast`` over the checkpoint's ``tokenizer.json``, with every special token
    of that file (``<|startoftranscript|>``, languages, tasks, ``<|notimestamps|>``, ...) registered
    as special: the ASR pipeline's decoding skips only ids in ``all_special_ids`` and takes ids
    above ``<|notimestamps|>`` for timestamps."""
    import json

    import transformers

    # transformers 5 keeps WhisperTokenizerFast as an alias of its (fast) WhisperTokenizer
    fast = getattr(transformers, "WhisperTokenizerFast", None) or transformers.WhisperTokenizer
    path = (loaded.tokenizer_files or {}).get("tokenizer.json")
    if path is None:
        raise CheckpointError("the checkpoint has no tokenizer.json for a transformers tokenizer")
    added = json.loads(path.read_text()).get("added_tokens", [])
    special = [a["content"] for a in added if a.get("special")]
    eot = "<|endoftext|>"
    extra = [t for t in special if t != eot]
    # transformers 5 calls them extra_special_tokens, 4.x additional_special_tokens
    for key in ("extra_special_tokens", "additional_special_tokens"):
        tok = fast(tokenizer_file=str(path), pad_token=eot, **{key: extra})
        if set(tok.convert_tokens_to_ids(special)) <= set(tok.all_special_ids):
            return tok
    raise CheckpointError(f"transformers did not register the special tokens of {path}")
