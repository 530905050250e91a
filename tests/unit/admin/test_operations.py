"""The admin surface declared once (giaannd/operations.py): the table is coherent, giaannctl's
generated parser takes every operation with its arguments and sends what the table declares, the
AdminApi binds only declared operations, and docs/operations.md's table is current."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from giaannd.admin import ctl
from giaannd.admin.api import AdminApi
from giaannd.admin.render import render
from giaannd.metrics import Metrics
from giaannd.operations import (
    FOLLOWED,
    OPERATIONS,
    SERVICES,
    Arg,
    Follow,
    Operation,
    Render,
    fill_path,
    index_operations,
    match_path,
    operations_of,
    path_params,
    split_path,
)
from giaannd.sdk.errors import ClientError
from tools import gen_operations_docs

CTL_OPS = [op for op in OPERATIONS.values() if op.ctl]


def _ids(ops: list[Operation]) -> list[str]:
    return [op.id for op in ops]


def test_operations_table_declares_each_route_and_verb_once() -> None:
    routes = [(op.method, op.path) for op in OPERATIONS.values() if op.path is not None]
    assert len(routes) == len(set(routes))
    commands = [op.command for op in CTL_OPS]
    assert len(commands) == len(set(commands))
    assert all(op.service in SERVICES for op in OPERATIONS.values())
    assert {op.id for op in OPERATIONS.values()} == set(OPERATIONS)
    # the routes the daemon served before the table, each still declared (one per line of work)
    for method, path in [("GET", "/v1/status"), ("GET", "/v1/members"), ("GET", "/metrics"), ("GET", "/"),
                         ("POST", "/v1/node/join"), ("POST", "/v1/node/leave"), ("POST", "/v1/node/drain"),
                         ("GET", "/v1/keys"), ("POST", "/v1/keys"), ("POST", "/v1/keys/{key_id}/use"),
                         ("DELETE", "/v1/keys/{key_id}"), ("GET", "/v1/ring"), ("GET", "/v1/ring/owners/{column}"),
                         ("GET", "/v1/columns/{column}"), ("POST", "/v1/node/decommission"),
                         ("POST", "/v1/node/removenode"), ("POST", "/v1/node/join-ring"), ("POST", "/v1/node/replace"),
                         ("POST", "/v1/node/repair"), ("GET", "/v1/node/topology"), ("POST", "/v1/train"),
                         ("GET", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"), ("POST", "/v1/jobs/{job_id}/resume"),
                         ("POST", "/v1/eval"), ("POST", "/v1/generate"), ("POST", "/v1/export")]:
        assert (method, path) in routes
    for action in ("pause", "resume", "cancel", "rate"):  # was one POST /v1/node/topology/{action}
        assert ("POST", f"/v1/node/topology/{action}") in routes


_OK = Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x/{a}",
                args=(Arg(name="a", positional=True, into="path"),))


@pytest.mark.parametrize(("table", "nouns", "error"), [
    ([_OK, _OK], {"x": ""}, "declared twice"),
    ([_OK, Operation(noun="x", verb="other", help="h", service="admin", method="GET", path="/v1/x/{a}",
                     args=_OK.args)], {"x": ""}, "route GET /v1/x/{a} is declared twice"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x/{a}")], {"x": ""},
     "needs exactly the arguments"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x",
                args=(Arg(name="a", positional=True, into="path"),))], {"x": ""}, "needs exactly the arguments"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET")], {"x": ""}, "go together"),
    ([Operation(noun="x", verb="idle", help="h", service="admin")], {"x": ""}, "must always follow"),
    ([_OK], {}, "has no help in NOUNS"),
    ([_OK, Operation(noun="x get", verb="more", help="h", service="admin", method="GET", path="/v1/y")],
     {"x": "", "x get": ""}, "both a command and a command group"),
    ([Operation(noun="w", verb="", help="h", service="admin", args=(Arg(name="a", positional=True, into="path"),),
                follow=Follow(kind="job", when="always"))], {}, "follows train.status, which is not declared"),
    ([Operation(noun="x", verb="set", help="h", service="admin", method="POST", path="/v1/x", public=True)],
     {"x": ""}, "only a GET may be public"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x", public=True,
                public_on_loopback=True)], {"x": ""}, "only a GET may be public"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x",
                render=Render(kind="table"))], {"x": ""}, "a table renders the rows under `rows`"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x",
                render=Render(rows="items"))], {"x": ""}, "only a table has rows"),
    ([Operation(noun="x", verb="get", help="h", service="admin", method="GET", path="/v1/x",
                render=Render(fields=("a",), tables=(("b", ("c",)),)))], {"x": ""}, "render tables ['b'] are not"),
])
def test_operations_index_refuses_incoherent_tables(table: list[Operation], nouns: dict[str, str],
                                                    error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        index_operations(table, nouns)


def test_operations_paths_are_filled_and_matched_per_segment() -> None:
    assert path_params("/v1/jobs/{job_id}/resume") == ("job_id",)
    assert fill_path("/v1/ring/owners/{column}", {"column": "a b/c"}) == "/v1/ring/owners/a%20b%2Fc"
    assert fill_path("/", {}) == "/"
    template = split_path("/v1/jobs/{job_id}/resume")
    assert match_path(template, split_path("/v1/jobs/j1/resume")) == {"job_id": "j1"}
    assert match_path(template, split_path("/v1/jobs/j1")) is None
    assert match_path(template, split_path("/v1/jobs/j1/cancel")) is None


# -- giaannctl: generated parser, one dispatch ---------------------------------------------

@pytest.mark.parametrize("op", CTL_OPS, ids=_ids(CTL_OPS))
def test_ctl_help_of_every_operation_exits_0(op: Operation, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ctl.main([*op.words, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"usage: giaannctl {op.command}" in out and op.help in out
    for arg in op.args:
        assert (arg.metavar or arg.name) in out if arg.positional else arg.flag in out
        assert arg.help in out and (arg.default is None or f"(default: {arg.default})" in out)
    if op.follow is not None and op.follow.when != "always":
        assert op.follow.when in out


class FakeClient:
    """Records requests; answers a job id to a start, and a finished document to a poll."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any, Any]] = []

    def json(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
        self.requests.append((method, path, body, query))
        if method == "GET" and path.startswith("/v1/jobs/"):
            return {"state": "succeeded", "done": 1, "total": 1}
        if method == "GET" and path == "/v1/node/topology":
            return {"state": "done", "op": "join"}
        return {"job_id": "job 1"}

    def request(self, method: str, path: str, body: Any = None, query: Any = None) -> tuple[bytes, str]:
        self.requests.append((method, path, body, query))
        return b"# TYPE up gauge\nup 1\n", "text/plain"

    # giaannd.Client's surface, which giaannctl uses: call / call_text, and the raw API for polling
    def call(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
        return self.json(method, path, body, query)

    def call_text(self, method: str, path: str, body: Any = None, query: Any = None) -> str:
        return self.request(method, path, body, query)[0].decode()

    @property
    def api(self) -> FakeClient:
        return self

    def report(self, path: str) -> Path:  # a client-side verb: recorded as a call to the method
        self.requests.append(("client", "report", path, None))
        return Path(path)


def _sample(arg: Arg, tmp_path: Path) -> tuple[str, Any]:
    """(what to type, what should be sent) for ``arg``."""
    if arg.type == "int":
        return "7", 7
    if arg.type == "rate":
        return "1000", 1000.0
    if arg.type == "path":
        return "rel/out", "rel/out"  # sent as typed: the daemon places it in its directory
    if arg.type == "existing-path":
        (tmp_path / "corpus.txt").write_text("a\n")
        return str(tmp_path / "corpus.txt"), str(tmp_path / "corpus.txt")
    if arg.type == "file-text":
        (tmp_path / "key").write_text("S2V5\n")
        return str(tmp_path / "key"), "S2V5"
    return "a b/c", "a b/c"


@pytest.mark.parametrize("op", CTL_OPS, ids=_ids(CTL_OPS))
def test_ctl_every_operation_parses_and_sends_what_the_table_declares(op: Operation, tmp_path: Path) -> None:
    argv, sent = [*op.words], {}
    for arg in op.args:
        typed, value = _sample(arg, tmp_path)
        if arg.type == "flag":
            argv.append(arg.flag)
            sent[arg.wire] = arg.const  # a later flag of the same key wins, as in the request
            continue
        argv += [typed, typed] if arg.many else [typed] if arg.positional else [arg.flag, typed]
        sent[arg.wire] = [value, value] if arg.many else value
    args = ctl.build_parser().parse_args(argv)
    assert args.op is op
    client = FakeClient()
    ctl.run(client, op, args)  # type: ignore[arg-type]
    requests = iter(client.requests)
    if op.client:
        assert next(requests) == ("client", op.client, *(sent[a.wire] for a in op.args), None)
    if op.path is not None:
        method, path, body, query = next(requests)
        assert (method, path) == (op.method, fill_path(op.path, sent))
        assert body == ({a.wire: sent[a.wire] for a in op.args if a.into == "body"}
                        if any(a.into == "body" for a in op.args) else None)
        assert query == ({a.wire: str(sent[a.wire]) for a in op.args if a.into == "query"} or None)
    follows = op.follow is not None and op.follow.when in ("always", "--no-wait")
    if follows:
        assert op.follow is not None
        poll = OPERATIONS[FOLLOWED[op.follow.kind]]
        assert poll.path is not None
        params = sent if op.path is None else {"job_id": "job 1"}
        assert next(requests)[:2] == ("GET", fill_path(poll.path, params))
    assert next(requests, None) is None


def test_ctl_flags_left_unset_are_not_sent_and_follow_flags_switch() -> None:
    client = FakeClient()
    op = OPERATIONS["node.decommission"]
    ctl.run(client, op, ctl.build_parser().parse_args(["node", "decommission"]))  # type: ignore[arg-type]
    assert client.requests == [("POST", "/v1/node/decommission", {}, None)]
    ctl.run(client, op, ctl.build_parser().parse_args(["node", "decommission", "--wait"]))  # type: ignore[arg-type]
    assert [r[:2] for r in client.requests[1:]] == [("POST", "/v1/node/decommission"), ("GET", "/v1/node/topology")]
    client = FakeClient()
    rate = ctl.build_parser().parse_args(["node", "topology", "rate", "none"])
    ctl.run(client, rate.op, rate)  # type: ignore[arg-type]
    assert client.requests == [("POST", "/v1/node/topology/rate", {"rate_bytes_s": None}, None)]
    client = FakeClient()
    start = ctl.build_parser().parse_args(["train", "start", __file__, "--no-wait"])
    assert ctl.run(client, start.op, start) == {"job_id": "job 1"}  # type: ignore[arg-type]
    assert len(client.requests) == 1


def test_ctl_follow_needs_the_id_in_the_reply(tmp_path: Path) -> None:
    class NoId(FakeClient):
        def json(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
            return {"accepted": True}

    args = ctl.build_parser().parse_args(["train", "start", __file__])
    with pytest.raises(ClientError, match="answered POST /v1/train without a job_id"):
        ctl.run(NoId(), args.op, args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "error"), [
    (["keys", "install", "/nonexistent/key"], "cannot read key file /nonexistent/key"),
    (["train", "start", "/nonexistent/corpus"], "corpus /nonexistent/corpus does not exist"),
])
def test_ctl_local_input_errors_exit_2(argv: list[str], error: str) -> None:
    args = ctl.build_parser().parse_args(argv)
    with pytest.raises(ClientError, match=error) as info:
        ctl.run(FakeClient(), args.op, args)  # type: ignore[arg-type]
    assert info.value.exit_code == 2


@pytest.mark.parametrize("argv", [["node", "topology", "rate"], ["node", "topology", "rate", "-5"],
                                  ["node", "topology", "rate", "nan"], ["node", "decommission", "--rate", "NaN"],
                                  ["node", "topology", "fly"], ["generate"], ["node", "join"]])
def test_ctl_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ctl.build_parser().parse_args(argv)
    assert info.value.code == 2


def test_ctl_table_renderer_shows_columns_and_json_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    op = OPERATIONS["train.list"]
    job = {"job_id": "j1", "state": "running", "done": 3, "total": None, "secret": "x"}

    class Jobs(FakeClient):
        def json(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
            return {"jobs": [job]}

    args = argparse.Namespace(op=op, json=False)
    text = render(op.render, ctl.run(Jobs(), op, args), as_json=False)  # type: ignore[arg-type]
    assert text.splitlines()[0].split()[:4] == ["JOB_ID", "STATE", "DONE", "TOTAL"] and "secret" not in text
    assert render(op.render, {"jobs": [job]}, as_json=True).count('"secret"') == 1


# -- the admin API binds declared operations only --------------------------------------------

def test_admin_api_binds_declared_operations_once_and_knows_what_is_unbound() -> None:
    api = AdminApi(token="t", metrics=Metrics(), status=lambda: {})
    assert api.unbound("admin") == []
    storage = [op.id for op in operations_of("storage")]
    assert api.unbound("storage") == storage and "node.topology.watch" not in storage  # no route of its own
    with pytest.raises(RuntimeError, match="started without binding its admin operations node.join-ring"):
        api.require_bound("storage")

    async def handler(request: Any, params: Any) -> Any:
        return {}

    for op_id in storage:
        api.bind(op_id, handler)
    api.require_bound("storage")
    api.require_bound("jobs")  # a service no operation names: nothing to check
    with pytest.raises(ValueError, match="already bound"):
        api.bind("node.repair", handler)
    with pytest.raises(ValueError, match="not declared"):
        api.bind("node.fly", handler)
    with pytest.raises(ValueError, match="not declared"):
        api.bind("train.wait", handler)  # a verb without a route cannot be bound


# -- docs/operations.md --------------------------------------------------------------------

def test_operations_docs_are_up_to_date() -> None:
    assert gen_operations_docs.main(["--check"]) == 0


def test_operations_docs_check_fails_on_a_stale_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = gen_operations_docs.DEFAULT_OUTPUT.read_text()
    stale = tmp_path / "operations.md"
    stale.write_text(page.replace("| `node` | `repair` |", "| `node` | `mend` |"))
    assert gen_operations_docs.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen_operations_docs.main([str(stale)]) == 0
    assert stale.read_text() == page
    (tmp_path / "bare.md").write_text("no markers\n")
    assert gen_operations_docs.main(["--check", str(tmp_path / "bare.md")]) == 1


def test_operations_docs_list_every_operation() -> None:
    table = gen_operations_docs.render_table()
    for op in OPERATIONS.values():
        assert f"`{op.path}`" in table if op.path else (
            f"`Client.{op.client}`" in table if op.client else f"`{op.verb}`" in table)
    assert len(table.splitlines()) == 2 + len(OPERATIONS)


def test_ctl_query_arguments_go_in_the_query_string() -> None:
    op = Operation(noun="x", verb="q", help="h", service="admin", method="GET", path="/v1/x/{name}",
                   args=(Arg(name="name", positional=True, into="path"), Arg(name="limit", type="int", into="query"),
                         Arg(name="kind", into="query")))
    client = FakeClient()
    ctl.run(client, op, argparse.Namespace(name="a", limit=5, kind=None, json=False))  # type: ignore[arg-type]
    assert client.requests == [("GET", "/v1/x/a", None, {"limit": "5"})]
