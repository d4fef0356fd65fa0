"""The `hybrid-attention` command line: one module per command, `main` the entry point."""

from hybrid_attention.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
