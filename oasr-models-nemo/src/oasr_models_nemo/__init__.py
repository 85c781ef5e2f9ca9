"""OASR plugin: NVIDIA FastConformer (Parakeet CTC / RNN-T / TDT and Nemotron streaming RNN-T)."""

__version__ = "0.1.0"
