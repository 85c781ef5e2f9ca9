"""Example OASR plugin. Nothing heavy is imported here or in ``plugin``."""
