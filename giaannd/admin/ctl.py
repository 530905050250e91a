"""``giaannctl <noun> <verb>``: the operator's tool for the admin API (STYLE.md item 25).

Nothing here names a verb: the parser is generated from the operations table
(giaannd/operations.py: nouns, verbs, arguments, help) and one dispatch serves them all: build the
request from the arguments (path, query, JSON body), send it, follow the operation when the table
says so (``--wait`` / ``--no-wait``, giaannd/sdk/follow.py), and print the answer with the
table's renderer (giaannd/admin/render.py).

A refusal from the daemon is printed as the command and the daemon's own message, with exit
status 1: an unknown job, key or node says which (``not_found``), and a verb whose role does not
run on that node says so (``not_served``); no output is ever invented here. Arguments refused as
given (400, 403, 413: ``train start --epochs 0``) exit 2, as bad local input does. An answer the
table declares a state (``shows_status``: ``node health`` on a node not ready, 503) is printed as
a success is, with exit status 1.

Global flags, before the command words or after them (``giaannctl node status --json``), with
the same meaning: ``--addr`` (or ``GIAANNCTL_ADDR``), ``--token-file`` (or
``GIAANNCTL_TOKEN_FILE``), ``--data-dir`` (read both from a node's data directory; without any
of these, the host's only instance: giaannd/sdk/locate.py), ``--json``, ``--detailed`` (every
field, not the curated view) and ``--timeout``. The globals are declared on the top parser with
their defaults, and again on every command group and verb with no default at all (``SUPPRESS``),
so that one given after the words overrides and one left out changes nothing.
Exit statuses: 0 ok, 1 the operation failed, 2 usage or configuration error (one line on stderr,
``giaannctl: error: ...``), 130 interrupted (Ctrl-C, 128 + SIGINT as the shell reports it: while
following, the operation goes on on the daemon).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TypeAlias

from giaannd import __version__
from giaannd.admin.render import render
from giaannd.errors import EXIT_USAGE
from giaannd.operations import (
    ADMIN_ADDR_FILE,
    ADMIN_TOKEN_FILE,
    FOLLOWED,
    NOUNS,
    OPERATIONS,
    Arg,
    ArgType,
    Follow,
    Operation,
    Render,
    path_params,
)
from giaannd.sdk.client import Client
from giaannd.sdk.errors import ClientError, RequestError, UsageError
from giaannd.sdk.follow import follow
from giaannd.sdk.http import DEFAULT_TIMEOUT_S, check_timeout, fill_route
from giaannd.sdk.locate import DEFAULT_ADDR

__all__ = ["GLOBAL_FLAGS", "build_parser", "main", "run"]

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: Ctrl-C: 128 + SIGINT, the status a shell reports for a command SIGINT ended.
EXIT_INTERRUPTED: Final = 128 + signal.SIGINT


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, ``giaannctl: error: ...`` and where the help is (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"giaannctl: error: {message} (see '{self.prog} --help')\n")


class _Help(argparse.HelpFormatter):
    """argparse's help, plus ``(default: X)`` only where there is a default to show: not for
    None (the daemon's default applies, and the help says which), a switch's False or SUPPRESS."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or "%(default)" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            text += " (default: %(default)s)"
        return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    try:
        return check_timeout(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _named(text: str) -> str:
    """A node flag's value: an empty one (``--addr "$NODE"`` with NODE unset) is refused, not
    taken as no flag (which would fall through to another node: the only local instance)."""
    if not text:
        raise argparse.ArgumentTypeError("empty (give a value, or leave the flag out)")
    return text


def _bytes_rate(text: str) -> float | None:
    if text.lower() in ("none", "off", "unlimited"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate in bytes/s: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):  # NaN too; inf (and 1e999) would be sent as Infinity: not JSON
        raise argparse.ArgumentTypeError("a rate must be a finite number > 0 bytes/s (or 'none')")
    return value


#: How argparse reads each argument type (giaannd/operations.py ``ArgType``).
_PARSE: Final[Mapping[ArgType, Callable[[str], Any]]] = {
    "str": str, "int": int, "rate": _bytes_rate, "path": str, "existing-path": str, "file-text": str, "flag": bool}
#: The global flags' destinations: no operation argument may take one of these names.
GLOBAL_FLAGS: Final = frozenset({"addr", "token_file", "data_dir", "json", "detailed", "timeout"})
#: The follow flags (``Follow.when``) and their help.
_WAIT_HELP: Final[Mapping[str, str]] = {
    "--wait": "follow the operation's progress until it ends",
    "--no-wait": "print the job id and return"}


# -- the parser, from the table ------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """``giaannctl``'s parser: the global flags, then one sub-command per operation; each leaf
    sets ``op`` to its ``Operation`` and takes the global flags too (module docstring)."""
    p: argparse.ArgumentParser = _Parser(prog="giaannctl", description="Administer a giaannd node.",
                                         formatter_class=_Help)
    p.add_argument("--version", action="version", version=f"giaannctl {__version__}")
    _add_global_flags(p, top=True)
    groups: dict[tuple[str, ...], _Subparsers] = {(): p.add_subparsers(dest="noun", required=True, metavar="NOUN")}
    for op in OPERATIONS.values():
        if op.ctl:
            leaf = _group(groups, op.words[:-1]).add_parser(
                op.words[-1], help=op.help, description=op.help, formatter_class=_Help)
            _add_arguments(leaf, op)
            _add_global_flags(leaf, top=False)
            leaf.set_defaults(op=op)
    return p


def _add_global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The global flags: with their defaults on the top parser; with none (``SUPPRESS``) on a
    command group or verb, where they only override what was given before the words."""
    group = parser.add_argument_group("global options" if top else "global options (also before the command)")
    unset: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    group.add_argument("--addr", metavar="URL", type=_named, **unset, help=(
        f"admin API URL (env GIAANNCTL_ADDR; else DIR/{ADMIN_ADDR_FILE} with --data-dir; else {DEFAULT_ADDR})"))
    group.add_argument("--token-file", metavar="FILE", type=_named, **unset, help=(
        f"bearer token file (env GIAANNCTL_TOKEN_FILE; else DIR/{ADMIN_TOKEN_FILE} with --data-dir)"))
    group.add_argument("--data-dir", metavar="DIR", type=_named, **unset, help=(
        "read the address and token from this node's data directory (default: the node's, if "
        "it is the only giaannd on this host)"))
    group.add_argument("--json", action="store_true", **unset, help="machine-readable JSON output")
    group.add_argument("--detailed", action="store_true", **unset,
                       help="show every field of the answer, not the curated view")
    group.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                       default=DEFAULT_TIMEOUT_S if top else argparse.SUPPRESS, help="per-request bound")


def _group(groups: dict[tuple[str, ...], _Subparsers], words: tuple[str, ...]) -> _Subparsers:
    """The subparsers of command group ``words`` (``node``, ``node topology``), made on first use."""
    if words not in groups:
        parser = _group(groups, words[:-1]).add_parser(words[-1], help=NOUNS[" ".join(words)],
                                                       description=NOUNS[" ".join(words)], formatter_class=_Help)
        _add_global_flags(parser, top=False)
        groups[words] = parser.add_subparsers(dest=f"_{'_'.join(words)}", required=True, metavar="VERB")
    return groups[words]


def _add_arguments(parser: argparse.ArgumentParser, op: Operation) -> None:
    taken = GLOBAL_FLAGS & {arg.name for arg in op.args}
    if taken:
        raise ValueError(f"operation {op.id}: arguments {sorted(taken)} would shadow giaannctl's global flags")
    for arg in op.args:
        kw: dict[str, Any] = {"help": arg.help or None, "metavar": arg.metavar, "type": _PARSE[arg.type]}
        if arg.positional:
            parser.add_argument(arg.name, nargs="+" if arg.many else None, **kw)
        elif arg.type == "flag":  # no value; None (not sent) unless given
            parser.add_argument(arg.flag, dest=arg.name, action="store_const", const=arg.const, help=kw["help"])
        else:
            parser.add_argument(arg.flag, dest=arg.name, default=arg.default, **kw)
    if op.follow is not None and op.follow.when != "always":
        parser.add_argument(op.follow.when, action="store_true", help=_WAIT_HELP[op.follow.when])


# -- one dispatch for every operation ------------------------------------------------------

def run(c: Client, op: Operation, a: argparse.Namespace) -> Any:
    """Send ``op``'s request built from the parsed arguments ``a`` (if it has a route), then
    follow it when the table says so; returns what to render (the reply, or the followed
    operation's final document).

    Raises:
        ClientError: bad local input (exit 2), a failed request or a followed operation that failed.
    """
    if op.client:  # a verb the client does (report): no route of its own
        result = getattr(c, op.client)(*(getattr(a, arg.name) for arg in op.args))
        return {"path": str(result)} if isinstance(result, Path) else result
    _check_text(op, a)
    reply = _send(c, op, a) if op.path is not None else None
    if op.follow is None or not _following(op.follow, a):
        return reply
    return follow(c.api, op.follow.kind, _poll_params(op, op.follow, a, reply), progress=not a.json)


def _send(c: Client, op: Operation, a: argparse.Namespace) -> Any:
    assert op.method is not None and op.path is not None
    where: dict[str, dict[str, Any]] = {"path": {}, "query": {}, "body": {}}
    for arg in op.args:
        value = getattr(a, arg.name)
        if arg.positional or value is not None:  # an unset flag: the daemon's default applies
            where[arg.into][arg.wire] = _value(arg, value)
    path = fill_route(op.path, where["path"])  # UsageError: an empty word would name another route
    query = {k: str(v) for k, v in where["query"].items()} or None
    body = where["body"] if any(arg.into == "body" for arg in op.args) else None
    if op.render.kind == "prometheus":  # text, not JSON
        return c.call_text(op.method, path, body, query)
    return c.call(op.method, path, body, query)


def _value(arg: Arg, value: Any) -> Any:
    """What is sent for ``arg``: paths as typed (a relative one is the daemon's to place inside its
    corpus or export directory), files read.

    Raises:
        UsageError: a file that cannot be read or is not UTF-8 text.
    """
    if arg.type in ("path", "existing-path") and value is not None:
        path = Path(value)
        if not path.is_absolute():
            return value
        if arg.type == "existing-path" and not path.exists():
            raise UsageError(f"{arg.name} {path} does not exist")
        return str(path)
    if arg.type == "file-text":
        what = arg.name.replace("_", " ")
        try:
            text = Path(value).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UsageError(f"cannot read {what} {value}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"{what} {value} is not UTF-8 text (byte {exc.start})") from None
        if not text:
            raise UsageError(f"{what} {value} is empty")
        return text
    return value


def _check_text(op: Operation, a: argparse.Namespace) -> None:
    """Refuse an argument holding bytes that are not UTF-8: argv reaches Python with them as lone
    surrogates, which no request can carry (in a path parameter they raised UnicodeEncodeError).
    A ``file-text`` argument names a local file, read here: any name the file system takes.

    Raises:
        UsageError: naming the argument.
    """
    for arg in (x for x in op.args if x.type != "file-text"):
        value = getattr(a, arg.name)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise UsageError(f"{arg.name} {text!r} is not UTF-8 text") from None


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
            raise ClientError(f"giaannd answered {op.method} {op.path} without a {name}: {reply!r}")
    return params


# -- entry point -----------------------------------------------------------------------------

def _client(a: argparse.Namespace, op: Operation) -> Client:
    # ``--token-file`` and GIAANNCTL_TOKEN_FILE get their ``~`` expanded in giaannd/sdk/locate.py
    client = Client(a.addr, a.token_file, a.data_dir, timeout_s=a.timeout)
    if client.token_problem is not None and not (op.public or op.public_on_loopback):
        # /v1/health, and /metrics from loopback, need no token; everything else would be refused
        raise UsageError(client.token_problem)
    return client


def _render_spec(op: Operation, a: argparse.Namespace) -> Render:
    """How to show what ``run`` returned: a verb that followed another shows that one's final
    document (``train start`` shows the job as ``train status`` does)."""
    if op.follow is not None and _following(op.follow, a):
        return OPERATIONS[FOLLOWED[op.follow.kind]].render
    return op.render


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``giaannctl``; returns the exit status."""
    args = build_parser().parse_args(argv)
    op: Operation = args.op
    try:
        result = run(_client(args, op), op, args)
        text = render(_render_spec(op, args), result, as_json=args.json, detailed=args.detailed)
    except RequestError as exc:  # the daemon's own words: what it did not find, or does not serve
        if exc.status in op.shows_status and exc.doc:  # a state to show (a node not ready), exit 1
            text = render(_render_spec(op, args), exc.doc, as_json=args.json, detailed=args.detailed)
            _print(text)
            return exc.exit_code
        print(f"giaannctl: error: {op.command}: {exc.detail}", file=sys.stderr)
        return exc.exit_code
    except ClientError as exc:
        print(f"giaannctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("giaannctl: interrupted (the operation may continue on the daemon)", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print(text)
    return 0


def _print(text: str) -> None:
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `giaannctl metrics | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
