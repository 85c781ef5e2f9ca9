"""OASR plugin: Whisper. Heavy modules (torch) are imported only when a spec is resolved."""
