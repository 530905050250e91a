"""Printing of benchmark results: every bench prints Markdown tables (pasted into the README)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["print_table"]


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header`` as a Markdown table headed ``### title``."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
