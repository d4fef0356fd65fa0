"""Wording shared by the command line's messages (torch-free)."""

from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """'1 MLA layer', '3 MLA layers', '1,024 windows'."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
