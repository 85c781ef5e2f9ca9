"""OASR plugin: WFST decoding graphs (``oasr graph build``) and a batched, streaming token-passing
decoder over them (GPU or CPU, PyTorch). See docs/wfst_decoder_gpu.md."""

__version__ = "0.1.0"
