"""The `mamba-stream` command line."""

from mamba_stream.cli._main import main

__all__ = ["main"]
