"""Every weight layout transformers has written for Qwen2-Audio maps onto the network's names
(the GPU machine's transformers 5.17 saves ``language_model.model.model.*``, 5.24 saves
``model.language_model.*``, the Hub releases ``language_model.model.*``)."""

from __future__ import annotations

import pytest

from oasr_models_qwen.checkpoints import normalize_name


@pytest.mark.parametrize(
    ("saved", "network"),
    [
        ("model.language_model.embed_tokens.weight", "decoder.embed_tokens.weight"),
        ("language_model.model.embed_tokens.weight", "decoder.embed_tokens.weight"),
        ("language_model.model.model.embed_tokens.weight", "decoder.embed_tokens.weight"),
        ("language_model.model.model.layers.0.mlp.up_proj.weight", "decoder.layers.0.mlp.up_proj.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.audio_tower.conv1.weight", "audio_tower.conv1.weight"),
        ("audio_tower.conv1.weight", "audio_tower.conv1.weight"),
        ("multi_modal_projector.linear.bias", "projector.bias"),
        ("model.multi_modal_projector.linear.weight", "projector.weight"),
        ("something.else", None),
    ],
)
def test_weight_names_of_every_transformers_layout(saved: str, network: str | None) -> None:
    assert normalize_name(saved) == network
