"""Printing of benchmark results: every bench prints Markdown tables (pasted into the README), or
with ``--json`` one JSON object per figure (``emit_figure``), for scripts that compare runs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

__all__ = ["emit_figure", "emit_figures", "print_table"]


def emit_figure(figure: str, value: float | None, target: str | None = None) -> None:
    """Print one figure as a JSON line ``{"figure", "value", "target"}``. ``target`` says the
    bound and its direction (``">= 0.6"``, ``"<= 1.5"``), or None where the issue sets none."""
    print(json.dumps({"figure": figure, "value": None if value is None else round(float(value), 4),
                      "target": target}))


def emit_figures(figures: Iterable[tuple[str, float | None, str | None]]) -> None:
    """``emit_figure`` of each ``(figure, value, target)``."""
    for figure, value, target in figures:
        emit_figure(figure, value, target)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header`` as a Markdown table headed ``### title``."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
