"""How giaannctl prints an answer: the renderers a ``Render`` in giaannd/operations.py names.

``--json`` prints the API's JSON (indented) except where the renderer says otherwise. Without it
the output is for people and never a Python repr: ``key: value`` lines and aligned tables, None
as ``-``, booleans as yes/no, whole floats without ``.0``, lists joined with ``, ``, nested
mappings flattened to dotted keys (``ring.digest: ...``) and lists of rows as tables. The curated
view shows what the operation's ``Render`` names (its ``fields``, its tables' ``columns``), the
way nodetool and consul curate theirs; ``--detailed`` shows every field. Pure functions of the
reply: the per-verb choices are data in the operations table, none of them code here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from giaannd.operations import Render
from giaannd.sdk.errors import ClientError

__all__ = ["flatten", "render", "render_document", "render_table", "show"]

#: How an absent value (None) shows; an empty list or mapping shows the same way.
NONE: Final = "-"
#: A table without rows.
NO_ROWS: Final = "(none)"
_DOCUMENT: Final = Render()


def render(spec: Render, result: Any, *, as_json: bool, detailed: bool = False) -> str:
    """The text giaannctl prints for ``result`` (module docstring; ``Render`` for the kinds).

    Raises:
        ClientError: ``--json`` of a ``prometheus`` answer that is not Prometheus text (another
            service answering on the admin port, a proxy's error page).
    """
    if spec.kind == "prometheus":
        text = str(result)
        return json.dumps(_families(text), indent=2) if as_json else text.rstrip("\n")
    if spec.kind == "table":
        rows = list(result.get(spec.rows, [])) if isinstance(result, Mapping) else []
        if as_json:  # the rows with every field (scripts read them; the table picks columns)
            return json.dumps(rows, indent=2)
        return render_table(rows, () if detailed else spec.columns)
    return json.dumps(result, indent=2) if as_json else render_document(result, spec, detailed=detailed)


def _families(text: str) -> list[dict[str, Any]]:
    try:
        return [{"name": f.name, "type": f.type, "help": f.documentation,
                 "samples": [{"name": s.name, "labels": s.labels, "value": _sample_value(s.value)}
                             for s in f.samples]}
                for f in text_string_to_metric_families(text)]
    except ValueError as exc:  # the parser's one error, whatever the garbage
        raise ClientError(f"the answer is not Prometheus text (is this giaannd's admin address?): {exc}") from None


def _sample_value(value: float) -> float | str:
    """A sample's value for JSON, which has no NaN or infinities: those as the exposition format
    writes them (``NaN``, ``+Inf``, ``-Inf``), as Prometheus's own HTTP API does."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


# -- values ----------------------------------------------------------------------------------

def show(value: Any) -> str:
    """One value as a person reads it (module docstring)."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={show(v)}" for k, v in flatten(value).items()) or NONE
    if isinstance(value, (list, tuple)):
        return ", ".join(show(v) for v in value) or NONE
    return str(value)


def _number(value: float) -> str:
    """Six significant digits, no exponent for big values (a rate in bytes/s), no ``.0``."""
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1e5 else f"{value:.6g}"


def flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"ring": {"digest": d}}`` -> ``{"ring.digest": d}``; other values (lists included) and
    empty mappings are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _select(keys: Iterable[str], wanted: Sequence[str]) -> list[str]:
    """The ``keys`` that ``wanted`` names, in ``wanted``'s order: a name picks itself and, when it
    was a mapping before flattening, its dotted keys (``ring`` picks ``ring.digest``)."""
    keys = list(keys)
    return list(dict.fromkeys(k for w in wanted for k in keys if k == w or k.startswith(f"{w}.")))


# -- tables and documents ---------------------------------------------------------------------

def _rows(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, Mapping) for v in value)


def _named_rows(value: Any) -> bool:
    """A mapping of name -> mapping (status's ``services``): a table with a NAME column."""
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, Mapping) for v in value.values())


def render_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = ()) -> str:
    """Aligned columns under upper-case headers: ``columns`` (those the rows have; nested cells
    flattened to dotted columns), or every column the rows have, in order of appearance."""
    if not rows:
        return NO_ROWS
    flat = [flatten(row) for row in rows]
    keys = list(dict.fromkeys(k for row in flat for k in row))
    if columns:
        keys = _select(keys, columns) or keys
    cells = [[show(row[k]) if k in row else "" for k in keys] for row in flat]
    widths = [max(len(k), *(len(r[i]) for r in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.upper().ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def render_document(result: Any, spec: Render = _DOCUMENT, *, detailed: bool = False) -> str:
    """``key: value`` lines in the order of ``spec.fields`` (only those unless ``detailed``).
    A list of rows is an indented table; a key of ``spec.tables`` is a table of its columns
    (every column when ``detailed``); other mappings are flattened to dotted keys. A document
    that is one list of rows (``{"members": [...]}``) is that table."""
    if isinstance(result, str):
        return result.rstrip("\n")
    if _rows(result):
        return render_table(result)
    if not isinstance(result, Mapping):
        return show(result)
    tables = {} if detailed else dict(spec.tables)
    if len(result) == 1:
        ((key, value),) = result.items()
        if _rows(value):
            return render_table(value, tables.get(key, ()))
    keys = list(result)
    if spec.fields:
        chosen = [k for k in spec.fields if k in result]
        keys = chosen + [k for k in keys if k not in chosen] if detailed else chosen
    lines: list[str] = []
    for key in keys:
        lines += _entry(key, result[key], tables.get(key))
    return "\n".join(lines)


def _entry(key: str, value: Any, columns: tuple[str, ...] | None) -> list[str]:
    """The lines of one key of a document (``render_document``)."""
    if isinstance(value, (list, Mapping)) and not value:
        return [f"{key}: {NONE}"]
    if columns is not None and _named_rows(value):
        rows = [{"name": name, **flatten(row)} for name, row in value.items()]
        return [f"{key}:", *_indent(render_table(rows, ("name", *columns)))]
    if _rows(value):
        return [f"{key}:", *_indent(render_table(value, columns or ()))]
    if isinstance(value, Mapping):
        return [f"{name}: {show(v)}" for name, v in flatten(value, f"{key}.").items()]
    return [f"{key}: {show(value)}"]


def _indent(text: str) -> list[str]:
    return [f"  {line}" for line in text.splitlines()]
