"""giaannctl's command tree: every verb the issue names exists and parses; usage errors exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.admin import ctl
from giaannd.admin.render import render_document
from giaannd.operations import OPERATIONS
from giaannd.sdk.http import DEFAULT_TIMEOUT_S


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


@pytest.mark.parametrize("argv", [[], ["node"], ["node", "fly"], ["nosuch", "verb"], ["node", "status", "--nosuch"]])
def test_ctl_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ctl.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("giaannctl: error: ") and "--help" in err, err


def _exit(argv: list[str]) -> int:
    """``main``'s status, whether it returns it or argparse exits with it."""
    try:
        return ctl.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(("argv", "env", "error"), [
    (["--timeout", "-1"], {}, "argument --timeout: a timeout must be seconds > 0"),
    (["--timeout", "0"], {}, "argument --timeout: a timeout must be seconds > 0"),
    (["--timeout", "nan"], {}, "argument --timeout: a timeout must be seconds > 0"),
    (["--timeout", "1e12"], {}, "<= 86400"),
    (["--timeout", "soon"], {}, "argument --timeout: not a number of seconds: 'soon'"),
    (["--addr", "not a url"], {}, "--addr: 'not a url' is not an admin API address"),
    (["--addr", "http://127.0.0.1:99999"], {}, "--addr: 'http://127.0.0.1:99999' is not an admin API address"),
    (["--addr", "ftp://127.0.0.1:9"], {}, "the scheme must be http or https"),
    (["--addr", "http://127.0.0.1:9/v1?x=1"], {}, "give only the scheme, host and port"),
    (["--addr", "http://[::zz]:9"], {}, "is not an admin API address"),
    ([], {"GIAANNCTL_ADDR": "bad host:1"}, "GIAANNCTL_ADDR: 'bad host:1' is not an admin API address"),
])
def test_ctl_bad_timeout_or_address_is_a_one_line_usage_error(
        argv: list[str], env: dict[str, str], error: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 16.9: these crashed with a traceback (ValueError, http.client.InvalidURL)."""
    for name in ("GIAANNCTL_ADDR", "GIAANNCTL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    token = tmp_path / "token"
    token.write_text("t\n")
    for where in ("before", "after"):  # the global flags mean the same after the command words
        words = [*argv, "--token-file", str(token)]
        full = [*words, "node", "status"] if where == "before" else ["node", "status", *words]
        assert _exit(full) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("giaannctl: error: ") and error in err, err


def test_ctl_missing_token_file_is_a_usage_error(tmp_path: object,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = ctl.main(["--addr", "127.0.0.1:9", "--token-file", "/nonexistent/token",
                     "keys", "list"])  # an operation that always needs the token
    assert code == 2
    assert "cannot read token file /nonexistent/token" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--json", "--detailed", "--timeout", "5", "--addr", "h:1", "--token-file", "t", "--data-dir", "d",
     "node", "status"],
    ["node", "status", "--json", "--detailed", "--timeout", "5", "--addr", "h:1", "--token-file", "t",
     "--data-dir", "d"],
    ["node", "--json", "--detailed", "--timeout", "5", "status", "--addr", "h:1", "--token-file", "t",
     "--data-dir", "d"],
    ["--json", "--timeout", "9", "--addr", "x:2", "node", "status", "--detailed", "--timeout", "5", "--addr", "h:1",
     "--token-file", "t", "--data-dir", "d"],
])
def test_ctl_global_flags_mean_the_same_before_and_after_the_command(argv: list[str]) -> None:
    args = ctl.build_parser().parse_args(argv)
    assert (args.json, args.detailed, args.timeout, args.addr, args.token_file, args.data_dir) == \
        (True, True, 5.0, "h:1", "t", "d")
    assert args.op is OPERATIONS["node.status"]


def test_ctl_global_flags_left_out_keep_their_defaults() -> None:
    args = ctl.build_parser().parse_args(["train", "start", "c.txt", "--epochs", "2"])
    assert (args.json, args.detailed, args.timeout, args.addr, args.token_file, args.data_dir) == \
        (False, False, DEFAULT_TIMEOUT_S, None, None, None)
    assert args.epochs == 2 and args.corpus == "c.txt"


def test_ctl_help_shows_defaults_only_where_there_is_one(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["node", "--help"], *([*op.words, "--help"] for op in OPERATIONS.values() if op.ctl)):
        with pytest.raises(SystemExit):
            ctl.main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in out and "(default: False)" not in out, argv
    with pytest.raises(SystemExit):
        ctl.main(["--help"])
    assert f"(default: {DEFAULT_TIMEOUT_S})" in " ".join(capsys.readouterr().out.split())


def test_ctl_render_tables() -> None:
    text = render_document({"members": [{"name": "a", "state": "alive"},
                                    {"name": "bb", "state": "suspect", "extra": 1}]})
    assert text.splitlines() == ["NAME  STATE    EXTRA", "a     alive", "bb    suspect  1"]
    assert render_document({"members": []}) == "(none)"
    status = render_document({"node_name": "n", "services": {"s": {"state": "running"}},
                              "roles": {"storage": "running"}})
    assert status.splitlines() == ["node_name: n", "services.s.state: running", "roles.storage: running"]


def test_ctl_interrupt_while_following_exits_130(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during ``--wait`` / ``watch`` is the shell's 128 + SIGINT, one line, no traceback
    (it exited 1, the status of a failed operation)."""
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ctl, "follow", interrupted)
    token = tmp_path / "token"
    token.write_text("t\n")
    assert ctl.main(["--addr", "127.0.0.1:9", "--token-file", str(token), "train", "wait", "j1"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("giaannctl: interrupted") and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--addr", "--token-file", "--data-dir"])
def test_ctl_empty_node_flag_is_a_usage_error(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--addr "$NODE"`` with NODE unset was taken as no flag at all: giaannctl then went on to the
    environment, the data directory or the host's only instance, and drained that node instead."""
    for name in ("GIAANNCTL_ADDR", "GIAANNCTL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    data = tmp_path / "node"
    data.mkdir()
    (data / "admin.addr").write_text("http://127.0.0.1:9\n")
    (data / "admin.token").write_text("t\n")
    argv = ["--data-dir", str(data), flag, "", "node", "drain"]
    assert _exit(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"giaannctl: error: argument {flag}: ") and "empty" in err, err
