"""The `mamba-stream` command line."""

from cli._main import main

__all__ = ["main"]
