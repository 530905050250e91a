"""``giaannctl <noun> <verb>``: the operator's tool for the admin API (STYLE.md item 25).

Every verb is one or a few admin API calls. Verbs whose route a node does not serve (its role is
not enabled, or that feature is not implemented yet) fail honestly: the daemon answers 404 and we
print "this node does not serve ..." with exit status 1; no output is ever invented here.

Global flags: ``--addr`` (or ``GIAANNCTL_ADDR``), ``--token-file`` (or ``GIAANNCTL_TOKEN_FILE``),
``--data-dir`` (read both from a node's data directory), ``--json``, ``--timeout``.
Exit statuses: 0 ok, 1 the operation failed, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from giaannd import __version__
from giaannd.admin.client import DEFAULT_TIMEOUT_S, AdminClient, CtlError, NotServedError
from giaannd.admin.progress import ProgressBar

__all__ = ["main"]

DEFAULT_ADDR = "http://127.0.0.1:7480"
DEFAULT_DATA_DIR = "/var/lib/giaannd"
#: How often ``train start`` polls the job; the bar redraws at most this often anyway.
JOB_POLL_S = 0.5
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "cancelled"})

Run = Callable[[AdminClient, argparse.Namespace], Any]
_VERBS: dict[tuple[str, str], Run] = {}


def _verb(noun: str, verb: str) -> Callable[[Run], Run]:
    def register(fn: Run) -> Run:
        _VERBS[(noun, verb)] = fn
        return fn
    return register


# -- verbs --------------------------------------------------------------------------------
# Each returns the decoded JSON reply (printed as JSON or rendered for humans) or a string.

@_verb("node", "status")
def _node_status(c: AdminClient, a: argparse.Namespace) -> Any:
    return c.json("GET", "/v1/status")


@_verb("members", "list")
def _members_list(c: AdminClient, a: argparse.Namespace) -> Any:
    return c.json("GET", "/v1/members")


@_verb("metrics", "")
def _metrics(c: AdminClient, a: argparse.Namespace) -> Any:
    raw, _ = c.request("GET", "/metrics")
    text = raw.decode()
    if not a.json:
        return text
    from prometheus_client.parser import text_string_to_metric_families
    return [{"name": f.name, "type": f.type, "help": f.documentation,
             "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]}
            for f in text_string_to_metric_families(text)]


def _simple(noun: str, verb: str, method: str, path: str,
            body: Callable[[argparse.Namespace], Any] | None = None) -> None:
    """Register a verb that is exactly one JSON call; ``{name}`` in ``path`` comes from args."""
    def run(c: AdminClient, a: argparse.Namespace) -> Any:
        url = path.format(**{k: _quote(str(v)) for k, v in vars(a).items()})
        return c.json(method, url, body(a) if body else None)
    _VERBS[(noun, verb)] = run


def _quote(segment: str) -> str:
    from urllib.parse import quote
    return quote(segment, safe="")


_simple("node", "join", "POST", "/v1/node/join", lambda a: {"seeds": a.seeds})
_simple("node", "leave", "POST", "/v1/node/leave")
_simple("node", "drain", "POST", "/v1/node/drain")
# Topology verbs (docs/topology.md): start the operation, optionally follow it with --wait.


def _topology_verb(verb: str, path: str, body: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """A topology verb: start the operation (it runs in the daemon), then with ``--wait`` follow
    its progress until it ends."""
    def run(c: AdminClient, a: argparse.Namespace) -> Any:
        doc = c.json("POST", path, body(a))
        return wait_for_topology(c, progress=not a.json) if a.wait else doc
    _VERBS[("node", verb)] = run


def _rate(a: argparse.Namespace) -> dict[str, Any]:
    return {} if a.rate is None else {"rate_bytes_s": a.rate}


_topology_verb("join-ring", "/v1/node/join-ring", _rate)
_topology_verb("decommission", "/v1/node/decommission", _rate)
_topology_verb("removenode", "/v1/node/removenode", lambda a: {"node_id": a.node_id})
_topology_verb("replace", "/v1/node/replace", lambda a: {"node_id": a.node_id})


@_verb("node", "topology")
def _node_topology(c: AdminClient, a: argparse.Namespace) -> Any:
    if a.action == "status":
        return c.json("GET", "/v1/node/topology")
    if a.action == "watch":
        return wait_for_topology(c, progress=not a.json)
    if a.action == "rate":
        if a.value is None:
            raise CtlError("node topology rate needs BYTES_PER_S (or 'none' for unthrottled)", 2)
        return c.json("POST", "/v1/node/topology/rate", {"rate_bytes_s": a.value})
    return c.json("POST", f"/v1/node/topology/{a.action}")


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


def wait_for_topology(c: AdminClient, *, progress: bool, poll_s: float = JOB_POLL_S,
                      stream: Any = None) -> Any:
    """Poll ``/v1/node/topology`` until the operation ends, drawing a byte progress bar.

    Raises:
        CtlError: it failed or was cancelled (exit 1).
    """
    return _follow(c, "/v1/node/topology", ("done", "failed", "cancelled"), "done",
                   lambda d: str(d.get("op", "topology")),
                   lambda d: (int(d.get("bytes_done", 0)), int(d.get("bytes_total", 0)) or None, "B"),
                   lambda d: f"topology operation {d.get('op')}",
                   progress=progress, poll_s=poll_s, stream=stream)


_simple("node", "repair", "POST", "/v1/node/repair")
_simple("ring", "show", "GET", "/v1/ring")
_simple("ring", "owners", "GET", "/v1/ring/owners/{column}")
_simple("column", "info", "GET", "/v1/columns/{column}")
_simple("train", "status", "GET", "/v1/jobs/{job_id}")
_simple("eval", "", "POST", "/v1/eval", lambda a: {
    "corpus": str(Path(a.corpus).resolve()) if a.corpus else None, "limit": a.limit})
_simple("generate", "", "POST", "/v1/generate", lambda a: {
    "prompt": a.prompt, "max_tokens": a.max_tokens})
_simple("export", "", "POST", "/v1/export", lambda a: {"path": str(Path(a.path).resolve())})
_simple("keys", "list", "GET", "/v1/keys")
_simple("keys", "install", "POST", "/v1/keys", lambda a: {"key": _read_key(a.key_file)})
_simple("keys", "use", "POST", "/v1/keys/{key_id}/use")
_simple("keys", "remove", "DELETE", "/v1/keys/{key_id}")


def _read_key(path: str) -> str:
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise CtlError(f"cannot read key file {path}: {exc.strerror}", 2) from None
    if not key:
        raise CtlError(f"key file {path} is empty", 2)
    return key


@_verb("train", "start")
def _train_start(c: AdminClient, a: argparse.Namespace) -> Any:
    corpus = Path(a.corpus).resolve()
    if not corpus.exists():
        raise CtlError(f"corpus {corpus} does not exist", 2)
    job = c.json("POST", "/v1/train", {"corpus": str(corpus), "epochs": a.epochs})
    if not isinstance(job, dict) or "job_id" not in job:
        raise CtlError(f"giaannd answered POST /v1/train without a job_id: {job!r}")
    if a.no_wait:
        return job
    return wait_for_job(c, str(job["job_id"]), progress=not a.json)


@_verb("train", "list")
def _train_list(c: AdminClient, a: argparse.Namespace) -> Any:
    """Every job of the node, one row each (a job resumed after a restart shows where from)."""
    jobs = c.json("GET", "/v1/jobs").get("jobs", [])
    if a.json:
        return jobs
    keys = ("job_id", "state", "done", "total", "resumed_from", "resumes", "sentences_per_s", "error")
    return [{k: j.get(k) for k in keys} for j in jobs]


@_verb("train", "resume")
def _train_resume(c: AdminClient, a: argparse.Namespace) -> Any:
    """Resume a failed journaled job (same writer id, from its cursor), then follow it."""
    job = c.json("POST", f"/v1/jobs/{_quote(a.job_id)}/resume")
    if a.no_wait:
        return job
    return wait_for_job(c, a.job_id, progress=not a.json)


@_verb("train", "wait")
def _train_wait(c: AdminClient, a: argparse.Namespace) -> Any:
    """Attach the progress bar to a running job (e.g. one the node resumed on start)."""
    return wait_for_job(c, a.job_id, progress=not a.json)


def wait_for_job(c: AdminClient, job_id: str, *, progress: bool,
                 poll_s: float = JOB_POLL_S, stream: Any = None) -> Any:
    """Poll ``/v1/jobs/{job_id}`` until it ends, drawing a progress bar; returns the final status.

    Raises:
        CtlError: the job failed or was cancelled (exit 1).
    """
    def label(status: Mapping[str, Any]) -> str:  # a resumed job says so (its count starts there)
        resumed = status.get("resumed_from")
        return f"job {job_id}" + (f" (resumed at {resumed})" if resumed is not None else "")

    return _follow(c, f"/v1/jobs/{_quote(job_id)}", TERMINAL_JOB_STATES, "succeeded", label,
                   lambda d: (int(d.get("done", 0)), d.get("total"), str(d.get("unit", "items"))),
                   lambda d: f"job {job_id}", progress=progress, poll_s=poll_s, stream=stream)


def _follow(c: AdminClient, path: str, terminal: Collection[str], ok: str,
            label: Callable[[Mapping[str, Any]], str],
            count: Callable[[Mapping[str, Any]], tuple[int, int | None, str]],
            what: Callable[[Mapping[str, Any]], str], *, progress: bool, poll_s: float,
            stream: Any) -> Any:
    """Poll ``path`` until its ``state`` is terminal, drawing a bar; the final document, or
    CtlError (exit 1) when it ended in another state than ``ok``."""
    bar: ProgressBar | None = None
    while True:
        doc = c.json("GET", path)
        if progress and bar is None:
            bar = ProgressBar(stream or sys.stderr, label(doc))
        if bar is not None:
            bar.update(*count(doc))
        state = doc.get("state")
        if state in terminal:
            if bar is not None:
                bar.close(str(state))
            if state != ok:
                raise CtlError(f"{what(doc)} {state}: {doc.get('error') or 'no reason given'}")
            return doc
        time.sleep(poll_s)


# -- output -------------------------------------------------------------------------------

def _render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "(none)"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cells = [["-" if row.get(k, "") is None else str(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(r[i]) for r in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.upper().ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result.rstrip("\n")
    if isinstance(result, Mapping):
        if set(result) == {"members"} and isinstance(result["members"], list):
            return _render_table(result["members"])
        lines = []
        for key, value in result.items():
            if isinstance(value, Mapping) and value and all(
                    isinstance(v, Mapping) for v in value.values()):
                lines.append(f"{key}:")
                lines.append(_render_table([{"name": k, **v} for k, v in value.items()]))
            elif isinstance(value, Mapping):
                lines.append(f"{key}:")
                lines.extend(f"  {k}: {v}" for k, v in value.items())
            elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
                lines.append(f"{key}:")  # e.g. column info's owners, ring show's members
                lines.extend(f"  {line}" for line in _render_table(value).splitlines())
            else:
                lines.append(f"{key}: {value}")
        return "\n".join(lines)
    if isinstance(result, list) and all(isinstance(r, Mapping) for r in result):
        return _render_table(result)
    return json.dumps(result, indent=2)


# -- arguments ----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="giaannctl", description="Administer a giaannd node.",
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"giaannctl {__version__}")
    p.add_argument("--addr", help=f"admin API URL (env GIAANNCTL_ADDR; default {DEFAULT_ADDR}, "
                   "or <data-dir>/admin.addr with --data-dir)")
    p.add_argument("--token-file", help="bearer token file (env GIAANNCTL_TOKEN_FILE; default "
                   f"{DEFAULT_DATA_DIR}/admin.token, or <data-dir>/admin.token with --data-dir)")
    p.add_argument("--data-dir", help="read the address and token from this node's data dir")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request seconds")
    nouns = p.add_subparsers(dest="noun", required=True, metavar="NOUN")

    def noun(name: str, help: str) -> Any:
        return nouns.add_parser(name, help=help, formatter_class=fmt).add_subparsers(
            dest="verb", required=True, metavar="VERB")

    node = noun("node", "this node: status and lifecycle")
    node.add_parser("status", help="node name, id, roles, uptime and services' health")
    node.add_parser("join", help="join a cluster through seeds").add_argument(
        "seeds", nargs="+", help="host:port of existing members")
    node.add_parser("leave", help="leave the cluster gracefully and stop")
    node.add_parser("drain", help="hand off replicas and stop accepting work")
    for verb, help_text, arg in (
            ("join-ring", "(topology) this standby storage node takes its share: streamed from "
                          "the current owners, then switched in", None),
            ("decommission", "(topology) stream this node's columns away, then drop it from the "
                             "ring (it stays up as a standby member: stop it after)", None),
            ("removenode", "(topology) re-replicate a dead node's columns from the survivors and "
                           "drop it from the ring", "node_id"),
            ("replace", "(topology) this standby node takes over a dead node's columns",
             "node_id")):
        sub = node.add_parser(verb, help=help_text)
        if arg:
            sub.add_argument(arg, metavar="NODE")
        if verb in ("join-ring", "decommission"):
            sub.add_argument("--rate", type=_bytes_rate, default=None, metavar="BYTES_PER_S",
                             help="throttle the streams (all of them together)")
        sub.add_argument("--wait", action="store_true",
                         help="follow the operation's progress until it ends")
    topo = node.add_parser("topology", help="(topology) the running or last operation: status, "
                                            "watch, pause, resume, cancel, rate BYTES_PER_S|none")
    topo.add_argument("action", choices=["status", "watch", "pause", "resume", "cancel", "rate"])
    topo.add_argument("value", nargs="?", type=_bytes_rate, default=None, metavar="BYTES_PER_S")
    node.add_parser("repair", help="(topology) deliver hints, rebuild this node's missing "
                                   "batches from its peers' logs, compare its rows with theirs")
    noun("members", "cluster membership").add_parser("list", help="the member table")
    ring = noun("ring", "placement")
    ring.add_parser("show", help="the placement in force, the storage ring (entries, digest), "
                    "the cutover override and the standby storage members")
    ring.add_parser("owners", help="owners of one column").add_argument(
        "column", help="column id or concept word")
    noun("column", "concept columns").add_parser("info", help="size and replicas of a column") \
        .add_argument("column", help="column id or concept word")
    train = noun("train", "training jobs")
    start = train.add_parser("start", help="train on a corpus with a live progress bar")
    start.add_argument("corpus", help="corpus file, readable by the daemon")
    start.add_argument("--epochs", type=int, default=1)
    start.add_argument("--no-wait", action="store_true", help="print the job id and return")
    train.add_parser("status", help="status of a job").add_argument("job_id")
    train.add_parser("list", help="every job of the node (resumed ones show resumed_from)")
    train.add_parser("wait", help="follow a running job with a progress bar").add_argument("job_id")
    resume = train.add_parser("resume", help="resume a failed job from its journal (nothing counted twice)")
    resume.add_argument("job_id")
    resume.add_argument("--no-wait", action="store_true", help="print the job id and return")
    # Single-word commands (no verb): `giaannctl eval`, `generate`, `export`, `metrics`.
    ev = nouns.add_parser("eval", help="top-1 next-token accuracy", formatter_class=fmt)
    ev.add_argument("--corpus", help="held-out sentences (default: the daemon's held-out set)")
    ev.add_argument("--limit", type=int, default=None, help="evaluate at most N sentences")
    gen = nouns.add_parser("generate", help="generate text from a prompt", formatter_class=fmt)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=20)
    nouns.add_parser("export", help="write the model to a file").add_argument("path")
    keys = noun("keys", "cluster keys")
    keys.add_parser("list", help="installed keys and the one in use")
    keys.add_parser("install", help="install a key from a file").add_argument("key_file")
    keys.add_parser("use", help="make an installed key primary").add_argument("key_id")
    keys.add_parser("remove", help="remove a key that is not in use").add_argument("key_id")
    nouns.add_parser("metrics", help="this node's Prometheus metrics")
    for name in ("eval", "generate", "export", "metrics"):
        nouns.choices[name].set_defaults(verb="")
    return p


def _client(a: argparse.Namespace) -> AdminClient:
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
        if a.noun != "metrics":  # /metrics is tokenless from loopback
            raise CtlError(f"cannot read token file {token_file}: {exc.strerror} "
                           "(use --token-file or GIAANNCTL_TOKEN_FILE)", 2) from None
        token = None
    return AdminClient(addr or DEFAULT_ADDR, token, a.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``giaannctl``; returns the exit status."""
    args = _parser().parse_args(argv)
    command = f"{args.noun} {args.verb}".strip()
    try:
        result = _VERBS[(args.noun, args.verb)](_client(args), args)
    except NotServedError as exc:
        print(f"giaannctl: error: this node does not serve '{command}' ({exc})", file=sys.stderr)
        return exc.exit_code
    except CtlError as exc:
        print(f"giaannctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("giaannctl: interrupted (the operation may continue on the daemon)", file=sys.stderr)
        return 1
    try:
        if args.json and not isinstance(result, str):
            print(json.dumps(result, indent=2))
        else:
            print(_render(result))
        sys.stdout.flush()
    except BrokenPipeError:  # `giaannctl metrics | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
