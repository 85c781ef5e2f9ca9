"""OASR plugin for icefall (k2-fsa) Zipformer models: CTC and transducer, offline and streaming."""

__version__ = "0.1.0"
