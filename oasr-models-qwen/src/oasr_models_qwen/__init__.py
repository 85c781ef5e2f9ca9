"""OASR plugin: Qwen2-Audio (audio encoder + projector + Qwen2 decoder), registry key
``speech_llm``. The hook module is :mod:`oasr_models_qwen.plugin` (no torch import)."""

__all__: list[str] = []
