"""giaannctl's command tree: every verb the issue names exists and parses; usage errors exit 2."""

from __future__ import annotations

import pytest

from giaannd.admin import ctl
from giaannd.admin.render import render_document
from giaannd.operations import OPERATIONS


@pytest.mark.parametrize("argv", [
    ["node", "status"], ["node", "join", "a:1", "b:2"], ["node", "leave"], ["node", "drain"],
    ["node", "decommission"], ["node", "removenode", "abc"], ["node", "repair"],
    ["members", "list"], ["ring", "show"], ["ring", "owners", "dog"], ["column", "info", "dog"],
    ["train", "start", "corpus.txt"], ["train", "status", "j1"], ["eval"], ["generate", "hi"],
    ["export", "out.bin"], ["keys", "list"], ["keys", "install", "k"], ["keys", "use", "k1"],
    ["keys", "remove", "k1"], ["metrics"],
])
def test_ctl_every_verb_parses_and_has_a_handler(argv: list[str]) -> None:
    args = ctl.build_parser().parse_args(["--json", *argv])
    words = tuple(argv[:len(args.op.words)])  # the command words, then its arguments
    assert args.op.words == words and args.op is OPERATIONS[".".join(words)]


@pytest.mark.parametrize("argv", [[], ["node"], ["node", "fly"], ["nosuch", "verb"]])
def test_ctl_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ctl.main(argv)
    assert info.value.code == 2


def test_ctl_missing_token_file_is_a_usage_error(tmp_path: object,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = ctl.main(["--addr", "127.0.0.1:9", "--token-file", "/nonexistent/token",
                     "keys", "list"])  # an operation that always needs the token
    assert code == 2
    assert "cannot read token file /nonexistent/token" in capsys.readouterr().err


def test_ctl_render_tables() -> None:
    text = render_document({"members": [{"name": "a", "state": "alive"},
                                    {"name": "bb", "state": "suspect", "extra": 1}]})
    assert text.splitlines() == ["NAME  STATE    EXTRA", "a     alive", "bb    suspect  1"]
    assert render_document({"members": []}) == "(none)"
    status = render_document({"node_name": "n", "services": {"s": {"state": "running"}},
                          "roles": {"storage": "running"}})
    assert "node_name: n" in status and "  storage: running" in status
