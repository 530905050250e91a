"""How giaannctl prints an answer: the renderers a ``Render`` in giaannd/operations.py names.

``--json`` prints the API's JSON (indented) except where the renderer says otherwise; without it
the output is for people: ``key: value`` lines and aligned tables. Pure functions of the reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from giaannd.operations import Render

__all__ = ["render", "render_document", "render_table"]


def render(spec: Render, result: Any, *, as_json: bool) -> str:
    """The text giaannctl prints for ``result`` (module docstring; ``Render`` for the kinds)."""
    if spec.kind == "prometheus":
        text = str(result)
        return json.dumps(_families(text), indent=2) if as_json else text.rstrip("\n")
    if spec.kind == "table":
        rows = list(result.get(spec.rows, [])) if isinstance(result, Mapping) else []
        if as_json:  # the rows with every field (scripts read them; the table picks columns)
            return json.dumps(rows, indent=2)
        return render_table([{k: r.get(k) for k in spec.columns} for r in rows] if spec.columns else rows)
    return json.dumps(result, indent=2) if as_json else render_document(result)


def _families(text: str) -> list[dict[str, Any]]:
    return [{"name": f.name, "type": f.type, "help": f.documentation,
             "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]}
            for f in text_string_to_metric_families(text)]


def _rows(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, Mapping) for v in value)


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Aligned columns under upper-case headers (the union of the rows' keys); None shows as -."""
    if not rows:
        return "(none)"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cells = [["-" if row.get(k, "") is None else str(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(r[i]) for r in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.upper().ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def render_document(result: Any) -> str:
    """``key: value`` lines; a mapping of mappings or a list of rows as an indented table, another
    mapping as indented lines. A document that is a single list of rows (``{"members": [...]}``)
    is that table."""
    if isinstance(result, str):
        return result.rstrip("\n")
    if isinstance(result, Mapping):
        if len(result) == 1 and _rows(next(iter(result.values()))):
            return render_table(next(iter(result.values())))
        lines = []
        for key, value in result.items():
            if isinstance(value, Mapping) and value and all(isinstance(v, Mapping) for v in value.values()):
                lines.append(f"{key}:")
                lines.append(render_table([{"name": k, **v} for k, v in value.items()]))
            elif isinstance(value, Mapping):
                lines.append(f"{key}:")
                lines.extend(f"  {k}: {v}" for k, v in value.items())
            elif _rows(value) and value:
                lines.append(f"{key}:")  # e.g. column info's owners, ring show's members
                lines.extend(f"  {line}" for line in render_table(value).splitlines())
            else:
                lines.append(f"{key}: {value}")
        return "\n".join(lines)
    if _rows(result):
        return render_table(result)
    return json.dumps(result, indent=2)
