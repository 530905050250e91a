"""giaannctl's human output (giaannd/admin/render.py): curated per operation by the table's render
spec, every field with --detailed, and never a Python repr (issue 18.4)."""

from __future__ import annotations

import json
import re

import pytest

from giaannd.admin.render import flatten, render, render_document, render_table, show
from giaannd.operations import OPERATIONS, Operation, Render

STATUS = {
    "node_name": "s1", "node_id": "u-1", "cluster": "c", "version": "0.1.0", "pid": 7, "state": "running",
    "draining": False, "uptime_s": 12.5, "roles": {"storage": "running"},
    "services": {
        "runtime": {"advertised": {"tcp": "tcp://127.0.0.1:1"}, "ring": {"digest": "ab", "standby": []},
                    "state": "running"},
        "storage": {"addresses": ["tcp://127.0.0.1:1"], "is_full": False, "counters": {"reads": 3, "errors": {}},
                    "state": "failed", "error": "RuntimeError('x')"},
    },
}
#: A reply with every kind of value a renderer meets.
AWKWARD = {"none": None, "yes": True, "no": False, "whole": 2.0, "ratio": 0.123456789, "rate": 1234567.891,
           "words": ["a", "b"], "empty": [], "nested": {"a": {"b": None}}, "nothing": {},
           "rows": [{"name": "x", "live": True, "meta": {"k": [1, 2]}, "err": None}],
           "named": {"x": {"state": "up", "deep": {"n": 1.5}}}}
#: What a Python repr leaks: None/True/False as words, or a list or dict literal.
REPR = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|\[|\{|'")


def _doc_ops() -> list[Operation]:
    return [op for op in OPERATIONS.values() if op.ctl and op.render.kind == "document"]


def test_render_values_as_people_read_them() -> None:
    assert [show(v) for v in (None, True, False, 2.0, 0.5, 1e-7, 1234567.891, float("inf"), 3, "x")] == \
        ["-", "yes", "no", "2", "0.5", "1e-07", "1234568", "inf", "3", "x"]
    assert show(["a", None, 1.0]) == "a, -, 1" and show([]) == "-" and show({}) == "-"
    assert show({"a": {"b": True}, "c": [1]}) == "a.b=yes, c=1"
    assert flatten({"ring": {"digest": "d", "standby": []}, "x": {}}) == \
        {"ring.digest": "d", "ring.standby": [], "x": {}}


@pytest.mark.parametrize("detailed", [False, True])
@pytest.mark.parametrize("op", _doc_ops(), ids=[op.id for op in _doc_ops()])
def test_render_no_operation_prints_a_python_repr(op: Operation, detailed: bool) -> None:
    doc = {**AWKWARD, **{f: AWKWARD["nested"] for f in op.render.fields},
           **{key: AWKWARD["named"] for key, _ in op.render.tables}}
    text = render(op.render, doc, as_json=False, detailed=detailed)
    assert not REPR.search(text), text
    assert json.loads(render(op.render, doc, as_json=True, detailed=detailed)) == doc  # --json: the reply


def test_render_awkward_document_in_full() -> None:
    assert render_document(AWKWARD).splitlines() == [
        "none: -", "yes: yes", "no: no", "whole: 2", "ratio: 0.123457", "rate: 1234568", "words: a, b",
        "empty: -", "nested.a.b: -", "nothing: -",
        "rows:", "  NAME  LIVE  META.K  ERR", "  x     yes   1, 2    -",
        "named.x.state: up", "named.x.deep.n: 1.5"]


def test_render_status_curated_then_detailed() -> None:
    spec = OPERATIONS["node.status"].render
    curated = render(spec, STATUS, as_json=False)
    assert curated.splitlines() == [
        "node_name: s1", "node_id: u-1", "cluster: c", "version: 0.1.0", "pid: 7", "state: running",
        "draining: no", "uptime_s: 12.5", "roles.storage: running", "services:",
        "  NAME     STATE    ERROR", "  runtime  running", "  storage  failed   RuntimeError('x')"]
    detailed = render(spec, STATUS, as_json=False, detailed=True).splitlines()
    for line in ("services.runtime.advertised.tcp: tcp://127.0.0.1:1", "services.runtime.ring.standby: -",
                 "services.storage.counters.reads: 3", "services.storage.is_full: no",
                 "services.storage.addresses: tcp://127.0.0.1:1"):
        assert line in detailed
    assert "counters" not in curated


def test_render_fields_order_and_pick_and_detailed_adds_the_rest() -> None:
    spec = Render(fields=("b", "ring"), tables=(("ring", ("name",)),))
    doc = {"a": 1, "b": None, "ring": [{"name": "n", "state": "active"}], "c": {"d": 2}}
    assert render_document(doc, spec).splitlines() == ["b: -", "ring:", "  NAME", "  n"]
    assert render_document(doc, spec, detailed=True).splitlines() == [
        "b: -", "ring:", "  NAME  STATE", "  n     active", "a: 1", "c.d: 2"]


def test_render_tables_pick_columns_and_detailed_shows_all() -> None:
    rows = [{"job_id": "j", "state": "running", "total": None, "result": {"rows": 3}, "extra": [1, 2]}]
    spec = Render(kind="table", rows="jobs", columns=("job_id", "total", "result", "missing"))
    assert render(spec, {"jobs": rows}, as_json=False).splitlines() == \
        ["JOB_ID  TOTAL  RESULT.ROWS", "j       -      3"]
    assert render(spec, {"jobs": rows}, as_json=False, detailed=True).splitlines()[0].split() == \
        ["JOB_ID", "STATE", "TOTAL", "RESULT.ROWS", "EXTRA"]
    assert json.loads(render(spec, {"jobs": rows}, as_json=True)) == rows
    assert render_table([]) == "(none)"


def test_render_members_list_is_its_curated_table() -> None:
    spec = OPERATIONS["members.list"].render
    member = {"name": "s1", "node_id": "u", "addr": "127.0.0.1:1", "status": "alive", "incarnation": 3,
              "roles": "storage", "data_plane": "tcp://x", "capacity_gib": 2.0, "weight": 1.0, "full": False}
    lines = render(spec, {"members": [member]}, as_json=False).splitlines()
    assert [line.split() for line in lines] == [["NAME", "STATUS", "ROLES", "ADDR", "DATA_PLANE"],
                                               ["s1", "alive", "storage", "127.0.0.1:1", "tcp://x"]]
    assert "INCARNATION" in render(spec, {"members": [member]}, as_json=False, detailed=True)


def test_render_topology_progress_shows_its_streams() -> None:
    spec = OPERATIONS["node.decommission"].render
    assert spec is OPERATIONS["node.topology.status"].render  # --wait shows the same document
    doc = {"op": "decommission", "state": "running", "error": None, "columns_total": 10, "columns_moved": 4,
           "lost_columns": 0, "bytes_total": 1000, "bytes_done": 250, "rate_bytes_s": 125.0, "eta_s": 6.0,
           "streams": [{"stream": "a->b", "state": "streaming", "bytes_total_estimate": 1000, "bytes_done": 250,
                        "rate_bytes_s": 125.0, "eta_s": 6.0, "items_acked": 2, "deltas": 0, "resent_items": 0,
                        "reconnects": 0, "error": None}]}
    text = render(spec, doc, as_json=False)
    assert "op: decommission" in text and "eta_s: 6" in text and "ITEMS_ACKED" not in text
    assert text.splitlines()[-2].split() == ["STREAM", "STATE", "BYTES_DONE", "BYTES_TOTAL_ESTIMATE",
                                             "RATE_BYTES_S", "ETA_S", "ERROR"]
    assert "ITEMS_ACKED" in render(spec, doc, as_json=False, detailed=True)


def test_render_metrics_json_is_valid_json_with_nan_and_infinities() -> None:
    """A gauge or quantile may be NaN or ±Inf in the exposition format; ``metrics --json`` printed
    them as the bare words NaN and Infinity, which no JSON parser takes."""
    text = "# TYPE g gauge\ng NaN\n# TYPE h gauge\nh +Inf\n# TYPE l gauge\nl -Inf\n# TYPE n gauge\nn 2.5\n"

    def strict(word: str) -> None:
        raise ValueError(f"not JSON: {word}")

    out = json.loads(render(Render(kind="prometheus"), text, as_json=True), parse_constant=strict)
    assert [f["samples"][0]["value"] for f in out] == ["NaN", "+Inf", "-Inf", 2.5]
