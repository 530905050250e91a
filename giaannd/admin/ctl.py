"""``giaannctl <noun> <verb>``: the operator's tool for the admin API (STYLE.md item 25).

Nothing here names a verb: the parser is generated from the operations table
(giaannd/operations.py: nouns, verbs, arguments, help) and one dispatch serves them all: build the
request from the arguments (path, query, JSON body), send it, follow the operation when the table
says so (``--wait`` / ``--no-wait``, giaannd/admin/follow.py), and print the answer with the
table's renderer (giaannd/admin/render.py).

Verbs whose route a node does not serve (its role is not enabled, or that feature is not
implemented yet) fail honestly: the daemon answers 404 and we print "this node does not serve ..."
with exit status 1; no output is ever invented here.

Global flags: ``--addr`` (or ``GIAANNCTL_ADDR``), ``--token-file`` (or ``GIAANNCTL_TOKEN_FILE``),
``--data-dir`` (read both from a node's data directory), ``--json``, ``--timeout``.
Exit statuses: 0 ok, 1 the operation failed, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias

from giaannd import __version__
from giaannd.admin.client import DEFAULT_TIMEOUT_S, AdminClient, CtlError, NotServedError
from giaannd.admin.follow import follow
from giaannd.admin.render import render
from giaannd.operations import FOLLOWED, NOUNS, OPERATIONS, Arg, ArgType, Follow, Operation, fill_path, path_params

__all__ = ["build_parser", "main", "run"]

DEFAULT_ADDR = "http://127.0.0.1:7480"
DEFAULT_DATA_DIR = "/var/lib/giaannd"
_FORMAT = argparse.ArgumentDefaultsHelpFormatter
_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _bytes_rate(text: str) -> float | None:
    if text.lower() in ("none", "off", "unlimited"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate in bytes/s: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("a rate must be > 0 bytes/s (or 'none')")
    return value


#: How argparse reads each argument type (giaannd/operations.py ``ArgType``).
_PARSE: Final[Mapping[ArgType, Callable[[str], Any]]] = {
    "str": str, "int": int, "rate": _bytes_rate, "path": str, "existing-path": str, "file-text": str, "flag": bool}
#: The follow flags (``Follow.when``) and their help.
_WAIT_HELP: Final[Mapping[str, str]] = {
    "--wait": "follow the operation's progress until it ends",
    "--no-wait": "print the job id and return"}


# -- the parser, from the table ------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """``giaannctl``'s parser: the global flags, then one sub-command per operation; each leaf
    sets ``op`` to its ``Operation``."""
    p = argparse.ArgumentParser(prog="giaannctl", description="Administer a giaannd node.",
                                formatter_class=_FORMAT)
    p.add_argument("--version", action="version", version=f"giaannctl {__version__}")
    p.add_argument("--addr", help=f"admin API URL (env GIAANNCTL_ADDR; default {DEFAULT_ADDR}, "
                   "or <data-dir>/admin.addr with --data-dir)")
    p.add_argument("--token-file", help="bearer token file (env GIAANNCTL_TOKEN_FILE; default "
                   f"{DEFAULT_DATA_DIR}/admin.token, or <data-dir>/admin.token with --data-dir)")
    p.add_argument("--data-dir", help="read the address and token from this node's data dir")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request seconds")
    groups: dict[tuple[str, ...], _Subparsers] = {(): p.add_subparsers(dest="noun", required=True, metavar="NOUN")}
    for op in OPERATIONS.values():
        if op.ctl:
            leaf = _group(groups, op.words[:-1]).add_parser(
                op.words[-1], help=op.help, description=op.help, formatter_class=_FORMAT)
            _add_arguments(leaf, op)
            leaf.set_defaults(op=op)
    return p


def _group(groups: dict[tuple[str, ...], _Subparsers], words: tuple[str, ...]) -> _Subparsers:
    """The subparsers of command group ``words`` (``node``, ``node topology``), made on first use."""
    if words not in groups:
        parser = _group(groups, words[:-1]).add_parser(words[-1], help=NOUNS[" ".join(words)],
                                                       formatter_class=_FORMAT)
        groups[words] = parser.add_subparsers(dest=f"_{'_'.join(words)}", required=True, metavar="VERB")
    return groups[words]


def _add_arguments(parser: argparse.ArgumentParser, op: Operation) -> None:
    for arg in op.args:
        kw: dict[str, Any] = {"help": arg.help or None, "metavar": arg.metavar, "type": _PARSE[arg.type]}
        if arg.positional:
            parser.add_argument(arg.name, nargs="+" if arg.many else None, **kw)
        elif arg.type == "flag":  # no value; None (not sent) unless given
            parser.add_argument(arg.flag, dest=arg.name, action="store_const", const=True, help=kw["help"])
        else:
            parser.add_argument(arg.flag, dest=arg.name, default=arg.default, **kw)
    if op.follow is not None and op.follow.when != "always":
        parser.add_argument(op.follow.when, action="store_true", help=_WAIT_HELP[op.follow.when])


# -- one dispatch for every operation ------------------------------------------------------

def run(c: AdminClient, op: Operation, a: argparse.Namespace) -> Any:
    """Send ``op``'s request built from the parsed arguments ``a`` (if it has a route), then
    follow it when the table says so; returns what to render (the reply, or the followed
    operation's final document).

    Raises:
        CtlError: bad local input (exit 2), a failed request or a followed operation that failed.
    """
    reply = _send(c, op, a) if op.path is not None else None
    if op.follow is None or not _following(op.follow, a):
        return reply
    return follow(c, op.follow.kind, _poll_params(op, op.follow, a, reply), progress=not a.json)


def _send(c: AdminClient, op: Operation, a: argparse.Namespace) -> Any:
    assert op.method is not None and op.path is not None
    where: dict[str, dict[str, Any]] = {"path": {}, "query": {}, "body": {}}
    for arg in op.args:
        value = getattr(a, arg.name)
        if arg.positional or value is not None:  # an unset flag: the daemon's default applies
            where[arg.into][arg.wire] = _value(arg, value)
    path = fill_path(op.path, where["path"])
    query = {k: str(v) for k, v in where["query"].items()} or None
    body = where["body"] if any(arg.into == "body" for arg in op.args) else None
    if op.render.kind == "prometheus":  # text, not JSON
        return c.request(op.method, path, body, query)[0].decode()
    return c.json(op.method, path, body, query)


def _value(arg: Arg, value: Any) -> Any:
    """What is sent for ``arg``: paths as typed (a relative one is the daemon's to place inside its
    corpus or export directory), files read."""
    if arg.type in ("path", "existing-path") and value is not None:
        path = Path(value)
        if not path.is_absolute():
            return value
        if arg.type == "existing-path" and not path.exists():
            raise CtlError(f"{arg.name} {path} does not exist", 2)
        return str(path)
    if arg.type == "file-text":
        what = arg.name.replace("_", " ")
        try:
            text = Path(value).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CtlError(f"cannot read {what} {value}: {exc.strerror}", 2) from None
        if not text:
            raise CtlError(f"{what} {value} is empty", 2)
        return text
    return value


def _following(f: Follow, a: argparse.Namespace) -> bool:
    if f.when == "--wait":
        return bool(a.wait)
    return f.when == "always" or not a.no_wait


def _poll_params(op: Operation, f: Follow, a: argparse.Namespace, reply: Any) -> dict[str, str]:
    """The followed operation's path parameters: from the reply to ``op``'s own request
    (``train start`` answers the new job's id), else from ``op``'s arguments (``train wait``)."""
    poll = OPERATIONS[FOLLOWED[f.kind]]
    params: dict[str, str] = {}
    for name in path_params(poll.path or ""):
        if op.path is None:
            params[name] = str(getattr(a, next(x.name for x in op.args if x.wire == name)))
        elif isinstance(reply, Mapping) and reply.get(name) is not None:
            params[name] = str(reply[name])
        else:
            raise CtlError(f"giaannd answered {op.method} {op.path} without a {name}: {reply!r}")
    return params


# -- entry point -----------------------------------------------------------------------------

def _client(a: argparse.Namespace, op: Operation) -> AdminClient:
    env = os.environ
    data_dir = Path(a.data_dir) if a.data_dir else None
    addr = a.addr or env.get("GIAANNCTL_ADDR")
    if addr is None and data_dir is not None:
        try:
            addr = (data_dir / "admin.addr").read_text().strip()
        except OSError as exc:
            raise CtlError(f"cannot read {data_dir / 'admin.addr'}: {exc.strerror} "
                           "(is the daemon running?)") from None
    token_file = a.token_file or env.get("GIAANNCTL_TOKEN_FILE") or str(
        (data_dir or Path(DEFAULT_DATA_DIR)) / "admin.token")
    try:
        token: str | None = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        if not op.public_on_loopback:  # /metrics is tokenless from loopback
            raise CtlError(f"cannot read token file {token_file}: {exc.strerror} "
                           "(use --token-file or GIAANNCTL_TOKEN_FILE)", 2) from None
        token = None
    return AdminClient(addr or DEFAULT_ADDR, token, a.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``giaannctl``; returns the exit status."""
    args = build_parser().parse_args(argv)
    op: Operation = args.op
    try:
        text = render(op.render, run(_client(args, op), op, args), as_json=args.json)
    except NotServedError as exc:
        print(f"giaannctl: error: this node does not serve '{op.command}' ({exc})", file=sys.stderr)
        return exc.exit_code
    except CtlError as exc:
        print(f"giaannctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("giaannctl: interrupted (the operation may continue on the daemon)", file=sys.stderr)
        return 1
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `giaannctl metrics | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
