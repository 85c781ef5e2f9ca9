"""The ``oasr`` command line (Typer + rich). Importing this must not import torch."""
