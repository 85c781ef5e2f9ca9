"""OASR plugin: FunASR Paraformer (non-autoregressive CIF). The hook module is ``plugin``."""

__version__ = "0.1.0"
