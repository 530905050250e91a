"""The admin surface, declared once: every operation of the admin API and of ``giaannctl``.

Theory of operation
-------------------
An ``Operation`` is one thing an operator can ask a node: its ``giaannctl`` words (noun, verb),
its HTTP route (method, path template), the arguments (where each goes: path, query or JSON
body), the service that serves it, its help text, and how ``giaannctl`` shows the answer. Three
things are generated from ``OPERATIONS`` and nothing else, so they cannot disagree:

- the admin API's route table: a service binds a handler to an operation *id*
  (``ctx.admin.bind("node.decommission", handler)``); the method and path come from here, an id
  that is not declared is refused, and a service named after a role (``SERVICES``) that starts
  without binding all of its operations fails the daemon's startup (giaannd/admin/api.py,
  giaannd/daemon.py);
- ``giaannctl``'s argument parser and its one generic dispatch (giaannd/admin/ctl.py);
- the operations table of docs/operations.md (``python -m tools.gen_operations_docs``).

Two verbs have no route of their own: ``train wait`` and ``node topology watch`` only *follow*
another operation (poll it until a terminal state, with a progress bar). ``Follow`` says which;
``train start`` and the topology verbs follow after their own request unless told otherwise.

This module is pure data and pure functions, in the base layer: storage and compute sit below the
admin package (pyproject.toml, import layers) and still bind by id. Ids are the command words
joined by dots (``node.topology.pause``); the ids and paths are the admin API's contract with
older ``giaannctl`` binaries, so change them only with a compatibility note.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol
from urllib.parse import quote

__all__ = [
    "ADMIN_ADDR_FILE",
    "ADMIN_TOKEN_FILE",
    "FOLLOWED",
    "NOUNS",
    "OPERATIONS",
    "SERVED_BY",
    "SERVICES",
    "Arg",
    "ArgType",
    "Binder",
    "Follow",
    "Handler",
    "Operation",
    "Render",
    "fill_path",
    "index_operations",
    "match_path",
    "operations_of",
    "path_params",
    "split_path",
]

#: The files in a node's data directory through which giaannctl finds it (``--data-dir``): the
#: admin URL actually bound (written by the daemon at start, removed on a clean exit) and the
#: bearer token (unless ``admin.token-file`` names another file).
ADMIN_ADDR_FILE: Final = "admin.addr"
ADMIN_TOKEN_FILE: Final = "admin.token"

#: The services that bind operations: the admin API itself, membership (every giaannd node) and
#: the two roles. A service whose ``name`` is one of these must bind all of its operations.
Service = Literal["admin", "membership", "storage", "compute"]
SERVICES: Final[tuple[Service, ...]] = ("admin", "membership", "storage", "compute")
#: Who serves a service's operations, in words (the docs' "served by" column).
SERVED_BY: Final[Mapping[Service, str]] = {
    "admin": "any node", "membership": "any node (membership)",
    "storage": "storage nodes", "compute": "compute nodes"}

#: How giaannctl reads an argument and what it sends: ``rate`` is bytes/s or ``none`` (a number
#: or null); ``path`` is sent absolute as typed, or relative as typed (the daemon takes a relative
#: path inside its corpus or export directory, never giaannctl's working directory);
#: ``existing-path`` must also exist when absolute; ``file-text`` sends the file's text (a key);
#: ``flag`` is a switch taking no value, sent as true when given (left out otherwise).
ArgType = Literal["str", "int", "rate", "path", "existing-path", "file-text", "flag"]

#: A handler: (request, the path template's parameters) -> a JSON-able body or an aiohttp response.
Handler = Callable[[Any, Mapping[str, str]], Awaitable[Any]]


class Binder(Protocol):
    """What a service binds its handlers through (the ``AdminApi``, or a test's fake)."""

    def bind(self, op_id: str, handler: Handler) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Arg:
    """One argument of an operation: a giaannctl positional or ``--flag``, sent in the request.

    ``name`` is the argparse destination and, unless ``key`` is set, the path parameter or the
    JSON/query key. A flag whose value is None is left out of the request (the daemon applies its
    default); a positional is always sent (``node topology rate none`` sends ``null``).
    """

    name: str
    help: str = ""
    positional: bool = False
    type: ArgType = "str"
    default: int | str | None = None
    #: A positional taking one or more values, sent as a list (``node join SEED...``).
    many: bool = False
    metavar: str | None = None
    into: Literal["path", "query", "body"] = "body"
    key: str = ""
    #: What a ``flag`` sends when given (``train start --local`` sends ``cluster: false``).
    const: bool = True

    @property
    def wire(self) -> str:
        """The name in the path template, query or JSON body."""
        return self.key or self.name

    @property
    def flag(self) -> str:
        """``--max-tokens`` for ``max_tokens`` (flags are kebab-case, STYLE.md item 25)."""
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True, kw_only=True, slots=True)
class Render:
    """How giaannctl shows the answer (giaannd/admin/render.py): the curated view by default,
    every field with ``--detailed``, the API's JSON with ``--json``.

    ``document``: ``key: value`` lines in the order of ``fields`` (only those, unless
    ``--detailed``: then the rest follow); nested mappings flattened to dotted keys
    (``ring.digest``), lists of rows as indented tables, and each key named in ``tables`` (a list
    of rows, or a mapping of name -> mapping such as status's ``services``) as a table of only
    those columns (every column with ``--detailed``). ``--json``: the reply.
    ``table``: the rows under ``rows``, only ``columns`` (every column with ``--detailed``;
    ``--json``: the rows, all fields). ``prometheus``: the text as is (``--json``: parsed into
    metric families).
    """

    kind: Literal["document", "table", "prometheus"] = "document"
    rows: str = ""
    columns: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    tables: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Follow:
    """Poll an operation until it ends, drawing a progress bar (giaannd/sdk/follow.py).

    ``kind`` names what is followed: ``job`` polls ``train status``, ``topology`` polls
    ``node topology status`` (``FOLLOWED``). ``when``: ``always``; ``--wait`` (only with that
    flag); ``--no-wait`` (unless that flag). The poll's path parameters come from the reply of
    the operation's own request (``train start`` answers ``{"job_id"}``) or, for a verb without
    a route, from its arguments (``train wait JOB_ID``).
    """

    kind: Literal["job", "topology"]
    when: Literal["always", "--wait", "--no-wait"]


DOCUMENT: Final = Render()


@dataclass(frozen=True, kw_only=True, slots=True)
class Operation:
    """One admin operation (module docstring). ``method``/``path`` are None for a verb that only
    follows another, or one the client does (``client``); ``ctl=False`` for a route giaannctl
    has no verb for (the HTML page)."""

    noun: str
    verb: str
    help: str
    service: Service
    method: str | None = None
    path: str | None = None
    args: tuple[Arg, ...] = ()
    render: Render = DOCUMENT
    follow: Follow | None = None
    #: Tokenless from loopback unless ``admin.metrics-require-token`` (giaannd/admin/api.py): the
    #: read-only views a browser or a node-local scraper fetches without a bearer token (the
    #: status page and the JSON it polls, ``/metrics``).
    public_on_loopback: bool = False
    #: Tokenless from any address (``GET /v1/health``, for load balancers and systemd checks):
    #: only for a GET whose answer reveals nothing an unauthenticated caller should not know.
    public: bool = False
    #: HTTP statuses whose answer is the node's state to show, not only a refusal: giaannctl
    #: prints its document as it prints a success, then exits 1 (``node health`` on a node that
    #: is starting or draining answers 503 with ``{"status": "draining"}``).
    shows_status: tuple[int, ...] = ()
    ctl: bool = True
    #: A verb giaannctl does in the Python client, with no route of its own: the name of the
    #: ``giaannd.Client`` method it calls with its arguments (``report PATH``: ``Client.report``,
    #: which reads the routes it needs). Empty for every operation with a route.
    client: str = ""
    words: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(f"{self.noun} {self.verb}".split()))

    @property
    def id(self) -> str:
        """``node.topology.pause``: the command words joined by dots."""
        return ".".join(self.words)

    @property
    def command(self) -> str:
        """``node topology pause``, as typed after ``giaannctl``."""
        return " ".join(self.words)


def split_path(path: str) -> tuple[str, ...]:
    """The non-empty segments of a path or template."""
    return tuple(p for p in path.split("/") if p)


def path_params(template: str) -> tuple[str, ...]:
    """The ``{name}`` segments of a template, in order."""
    return tuple(s[1:-1] for s in split_path(template) if s.startswith("{") and s.endswith("}"))


def match_path(template: Sequence[str], parts: Sequence[str]) -> dict[str, str] | None:
    """The parameters if ``parts`` (a split path) matches ``template`` (a split template): a
    ``{name}`` segment matches any one segment, any other must be equal. None otherwise."""
    if len(parts) != len(template):
        return None
    params: dict[str, str] = {}
    for want, got in zip(template, parts):
        if want.startswith("{") and want.endswith("}"):
            params[want[1:-1]] = got
        elif want != got:
            return None
    return params


def fill_path(template: str, values: Mapping[str, Any]) -> str:
    """``template`` with each ``{name}`` segment replaced by ``values[name]``, percent-encoded so a
    value (a concept word, a key id) is always exactly one segment."""
    return "/" + "/".join(quote(str(values[s[1:-1]]), safe="") if s.startswith("{") and s.endswith("}")
                          else s for s in split_path(template))


def _pos(text: str, metavar: str | None = None) -> Arg:
    return Arg(name=text, positional=True, metavar=metavar)


_RATE_HELP = "throttle the streams (all of them together)"
_COLUMN = Arg(name="column", positional=True, into="path", help="column id (decimal or 0x) or concept word")
_JOB = Arg(name="job_id", positional=True, into="path")
_KEY = Arg(name="key_id", positional=True, into="path")

# What giaannctl shows of each answer without --detailed (Render): the fields an operator reads
# first, the way nodetool and consul curate theirs; --detailed and --json show everything.
_STATUS = Render(fields=("node_name", "node_id", "cluster", "version", "pid", "state", "draining", "uptime_s",
                         "roles", "services"), tables=(("services", ("state", "error")),))
#: A topology operation's progress (every topology verb answers it; ``--wait`` follows it).
_TOPOLOGY = Render(fields=("op", "state", "error", "columns_moved", "columns_total", "lost_columns", "bytes_done",
                           "bytes_total", "rate_bytes_s", "eta_s", "streams"),
                   tables=(("streams", ("stream", "state", "bytes_done", "bytes_total_estimate", "rate_bytes_s",
                                        "eta_s", "error")),))
#: A training job (``train status``; ``train start`` / ``wait`` / ``resume`` follow it).
_JOB_DOC = Render(fields=("job_id", "kind", "state", "error", "done", "total", "unit", "trained", "skipped",
                          "sentences_per_s", "elapsed_s", "resumed_from", "resumes", "result", "cluster", "phase",
                          "by_node"),
                  tables=(("by_node", ("sentences", "windows", "leases_held", "leases_expired",
                                       "leases_taken_over")),))

#: Help of the command groups (a noun with verbs); single-word commands use their own help.
NOUNS: Final[Mapping[str, str]] = {
    "node": "this node: status and lifecycle",
    "node topology": "(topology) the running or last topology operation of this node",
    "node registers": "(topology) this storage node's replicated registers",
    "members": "cluster membership",
    "ring": "placement",
    "column": "concept columns",
    "train": "training jobs",
    "evals": "the evaluation history",
    "keys": "cluster keys",
}

_TABLE: Final[tuple[Operation, ...]] = (
    Operation(noun="node", verb="status", service="admin", method="GET", path="/v1/status", render=_STATUS,
              public_on_loopback=True,
              help="node name and id, cluster, version, pid, state, uptime, roles and each service's health"),
    Operation(noun="node", verb="health", service="admin", method="GET", path="/v1/health", public=True,
              render=Render(fields=("status",)), shows_status=(503,),
              help="ready, starting or draining (exit status 1 unless ready); GET /v1/health needs no token "
                   "and answers 200 only when ready, for load balancers and systemd checks"),
    Operation(noun="node", verb="join", service="membership", method="POST", path="/v1/node/join",
              args=(Arg(name="seeds", positional=True, many=True, metavar="SEED",
                        help="host:port of existing members"),),
              help="join a cluster through seeds (their gossip host:port)"),
    Operation(noun="node", verb="leave", service="membership", method="POST", path="/v1/node/leave",
              help="leave the cluster gracefully and stop the daemon"),
    Operation(noun="node", verb="drain", service="membership", method="POST", path="/v1/node/drain",
              help="refuse writes, keep serving reads and gossip the node as full, to hand off its work"),
    Operation(noun="node", verb="join-ring", service="storage", method="POST", path="/v1/node/join-ring",
              render=_TOPOLOGY,
              args=(Arg(name="rate", type="rate", metavar="BYTES_PER_S", key="rate_bytes_s", help=_RATE_HELP),),
              follow=Follow(kind="topology", when="--wait"),
              help="(topology) this standby storage node takes its share: streamed from the current owners, "
                   "then switched in (storage.join-mode = \"auto\" does it at start)"),
    Operation(noun="node", verb="decommission", service="storage", method="POST", path="/v1/node/decommission",
              render=_TOPOLOGY,
              args=(Arg(name="rate", type="rate", metavar="BYTES_PER_S", key="rate_bytes_s", help=_RATE_HELP),),
              follow=Follow(kind="topology", when="--wait"),
              help="(topology) stream this node's columns away, then drop it from the ring (it stays up "
                   "as a standby member: stop it after)"),
    Operation(noun="node", verb="removenode", service="storage", method="POST", path="/v1/node/removenode",
              render=_TOPOLOGY,
              args=(_pos("node_id", "NODE"),), follow=Follow(kind="topology", when="--wait"),
              help="(topology) re-replicate a dead node's columns from the survivors and drop it from the "
                   "ring (refused if a column would have no live copy)"),
    Operation(noun="node", verb="replace", service="storage", method="POST", path="/v1/node/replace",
              render=_TOPOLOGY,
              args=(_pos("node_id", "NODE"),), follow=Follow(kind="topology", when="--wait"),
              help="(topology) this standby node takes over a dead node's columns"),
    Operation(noun="node topology", verb="status", service="storage", method="GET", path="/v1/node/topology",
              render=_TOPOLOGY,
              help="progress of the running or last topology operation: bytes, rate and ETA per stream"),
    Operation(noun="node topology", verb="watch", service="storage", follow=Follow(kind="topology", when="always"),
              help="follow the running or last topology operation with a progress bar until it ends"),
    Operation(noun="node topology", verb="pause", service="storage", method="POST",
              path="/v1/node/topology/pause", render=_TOPOLOGY,
              help="pause the running topology operation's streams"),
    Operation(noun="node topology", verb="resume", service="storage", method="POST",
              path="/v1/node/topology/resume", render=_TOPOLOGY, help="resume a paused topology operation"),
    Operation(noun="node topology", verb="cancel", service="storage", method="POST",
              path="/v1/node/topology/cancel", render=_TOPOLOGY,
              help=("cancel the running topology operation (the ring is unchanged; the receivers "
                    "drop the partial rows they got)")),
    Operation(noun="node topology", verb="rate", service="storage", method="POST", path="/v1/node/topology/rate",
              render=_TOPOLOGY,
              args=(Arg(name="rate", positional=True, type="rate", metavar="BYTES_PER_S", key="rate_bytes_s",
                        help="bytes/s for all the streams together, or 'none' for unthrottled"),),
              help="change the running topology operation's stream rate"),
    Operation(noun="node registers", verb="unseal", service="storage", method="POST",
              path="/v1/node/registers/unseal", render=Render(fields=("node", "unsealed", "cluster_lock")),
              help="(topology) drop the register seals a topology operation whose coordinator died left on "
                   "this node (refused while an operation runs here or holds the cluster's lock, or while "
                   "a placement override is in force here; docs/topology.md)"),
    Operation(noun="node", verb="repair", service="storage", method="POST", path="/v1/node/repair",
              help="(topology) deliver hints, rebuild this node's missing batches from its peers' logs, "
                   "compare its rows with theirs (docs/topology.md)"),
    Operation(noun="members", verb="list", service="admin", method="GET", path="/v1/members", public_on_loopback=True,
              render=Render(tables=(("members", ("name", "status", "roles", "addr", "data_plane")),)),
              help="the member table (answered while the membership service runs)"),
    Operation(noun="ring", verb="show", service="membership", method="GET", path="/v1/ring",
              public_on_loopback=True,
              render=Render(fields=("epoch", "replicas", "members", "owner_sample", "ring", "ring_entries", "override",
                                    "override_lease", "standby"),
                            tables=(("members", ("name", "weight", "address", "live", "owned", "primary")),)),
              help="the placement in force with each member's owner counts (of a fixed sample of column ids), "
                   "the storage ring (entries, digest), the cutover override and its lease, and the standby storage "
                   "members"),
    Operation(noun="ring", verb="usage", service="membership", method="GET", path="/v1/ring/usage",
              public_on_loopback=True,
              render=Render(kind="table", rows="nodes", columns=(
                  "name", "live", "used_bytes", "capacity_bytes", "disk_bytes", "disk_free_bytes", "rows",
                  "entries", "full", "error")),
              help="each storage node's fill: RAM used of capacity, disk (its files; free space), rows and "
                   "entries, and its row sizes (row_sizes[k]: rows of 2^k to 2^(k+1)-1 entries), asked over "
                   "the data plane"),
    Operation(noun="ring", verb="owners", service="membership", method="GET", path="/v1/ring/owners/{column}",
              args=(_COLUMN,), help="owners of one column, in placement order"),
    Operation(noun="column", verb="info", service="membership", method="GET", path="/v1/columns/{column}",
              args=(_COLUMN,),
              help="a column's owners and, per live owner, its rows, entries, bytes and digests, and "
                   "whether the replicas agree (docs/replication.md, \"Column info\")"),
    Operation(noun="column", verb="rows", service="compute", method="GET", path="/v1/columns/{column}/rows",
              args=(_COLUMN, Arg(name="limit", type="int", into="query",
                                 help="entries at most (the compute node's config decides the default, "
                                      "100,000, and the most, 10,000,000; docs/config.md)")),
              render=Render(fields=("column", "word", "total_entries", "truncated")),
              help="a column's contents, read from one replica: its rows (source neurons) and their entries "
                   "(segment, target column and neuron, strength) in key order, as words; cut at --limit "
                   "entries (--json for the arrays)"),
    Operation(noun="train", verb="start", service="compute", method="POST", path="/v1/train",
              args=(Arg(name="corpus", positional=True, type="existing-path",
                        help="corpus file in the daemon's compute.corpus-dir (a relative path is taken there)"),
                    Arg(name="epochs", type="int", default=1, help="passes over the corpus"),
                    Arg(name="cluster", type="flag",
                        help="a cluster job every compute node works on (the default: compute.cluster-jobs)"),
                    Arg(name="local", key="cluster", type="flag", const=False,
                        help="a node-local job: this node only, journaled on its disk (docs/compute.md)")),
              follow=Follow(kind="job", when="--no-wait"),
              help="train on a corpus, with a live progress bar"),
    Operation(noun="train", verb="status", service="compute", method="GET", path="/v1/jobs/{job_id}",
              args=(_JOB,), render=_JOB_DOC,
              help="status of a job (a cluster job on any compute node, with what each node did: by_node)"),
    Operation(noun="train", verb="list", service="compute", method="GET", path="/v1/jobs", public_on_loopback=True,
              render=Render(kind="table", rows="jobs", columns=(
                  "job_id", "state", "done", "total", "resumed_from", "resumes", "sentences_per_s", "error")),
              help="every job of the node (a job resumed after a crash shows resumed_from), then the cluster "
                   "jobs: unfinished ones and those that ended while this node followed them"),
    Operation(noun="train", verb="wait", service="compute", args=(_JOB,), follow=Follow(kind="job", when="always"),
              help="follow a running job with a progress bar (e.g. one the node resumed on start)"),
    Operation(noun="train", verb="resume", service="compute", method="POST", path="/v1/jobs/{job_id}/resume",
              args=(_JOB,), follow=Follow(kind="job", when="--no-wait"),
              help="resume a failed journaled job from its cursor, nothing counted twice (docs/compute.md)"),
    Operation(noun="train", verb="cancel", service="compute", method="POST", path="/v1/jobs/{job_id}/cancel",
              args=(_JOB,), render=_JOB_DOC,
              help="cancel a job: this node's, or a cluster job from any compute node (docs/compute.md)"),
    Operation(noun="eval", verb="", service="compute", method="POST", path="/v1/eval",
              args=(Arg(name="corpus", type="path",
                        help="held-out sentences, in compute.corpus-dir (default: the first LIMIT sentences "
                             "of the bundled corpus, 200 unless --limit)"),
                    Arg(name="prompts", type="path", metavar="FILE",
                        help="a prompt file instead, in compute.corpus-dir: one prompt per non-blank line, each "
                             "tagged whole as the reference tags it (CoNLL-U: one sentence per prompt)"),
                    Arg(name="limit", type="int", help="evaluate at most N sentences")),
              render=Render(fields=("top1", "matches", "prediction_tokens", "prompts", "skipped", "no_prediction",
                                    "steps_per_s", "elapsed_s", "constants", "mode")),
              help="top-1 next-token accuracy (teacher-forced, 8 seed tokens)"),
    Operation(noun="evals", verb="list", service="compute", method="GET", path="/v1/evals", public_on_loopback=True,
              render=Render(kind="table", rows="evals", columns=(
                  "at", "top1", "prediction_tokens", "prompts", "trained", "source")),
              help="the node's successful evals, oldest first, each with the sentences trained by the jobs it "
                   "knew then (compute.eval-history entries, kept across restarts)"),
    Operation(noun="generate", verb="", service="compute", method="POST", path="/v1/generate",
              args=(_pos("prompt"), Arg(name="max_tokens", type="int", default=20, help="tokens to generate at most")),
              render=Render(fields=("text",)),
              help="generate text from a prompt"),
    Operation(noun="export", verb="", service="compute", method="POST", path="/v1/export",
              args=(Arg(name="path", positional=True, type="path",
                        help="output file in the daemon's compute.export-dir (a relative path is taken there)"),
                    Arg(name="overwrite", type="flag", help="replace an existing file that is not a previous export")),
              help="write every row of the cluster to a JSONL file"),
    Operation(noun="report", verb="", service="admin", client="report", render=Render(fields=("path",)),
              args=(Arg(name="path", positional=True, metavar="PATH",
                        help="the HTML file to write (here, where giaannctl runs)"),),
              help="write a self-contained HTML report with plots: training throughput and bytes per job, "
                   "top-1 against sentences trained, row sizes, storage fill and owners per node (needs "
                   "matplotlib: the report extra)"),
    Operation(noun="keys", verb="list", service="membership", method="GET", path="/v1/keys",
              help="installed cluster keys and the one in use"),
    Operation(noun="keys", verb="install", service="membership", method="POST", path="/v1/keys",
              args=(Arg(name="key_file", positional=True, type="file-text", key="key"),),
              help="install a key from a file (saved to cluster.key-file)"),
    Operation(noun="keys", verb="use", service="membership", method="POST", path="/v1/keys/{key_id}/use",
              args=(_KEY,), help="make an installed key primary"),
    Operation(noun="keys", verb="remove", service="membership", method="DELETE", path="/v1/keys/{key_id}",
              args=(_KEY,), help="remove a key that is not in use"),
    Operation(noun="metrics", verb="", service="admin", method="GET", path="/metrics",
              render=Render(kind="prometheus"), public_on_loopback=True,
              help="this node's Prometheus metrics (--json parses them into families)"),
    Operation(noun="status-page", verb="", service="admin", method="GET", path="/", public_on_loopback=True,
              ctl=False, help="a read-only HTML status page (node, services, members, ring owner counts, storage "
                              "fill, training jobs), refreshed live from the tokenless read-only views"),
)

#: The operation each ``Follow.kind`` polls.
FOLLOWED: Final[Mapping[str, str]] = {"job": "train.status", "topology": "node.topology.status"}


def index_operations(table: Iterable[Operation], nouns: Mapping[str, str] = NOUNS,
                     followed: Mapping[str, str] = FOLLOWED) -> dict[str, Operation]:
    """``table`` by id, after checking it is coherent.

    Raises:
        ValueError: a duplicate id or route, a route's path parameters that are not exactly its
            path arguments, a verb without a route that follows nothing, a command that is also
            a command group, a group without help, a public operation that is not a GET, or a
            render spec that contradicts itself.
    """
    ops: dict[str, Operation] = {}
    routes: set[tuple[str, str]] = set()
    for op in table:
        if op.id in ops:
            raise ValueError(f"operation {op.id} is declared twice")
        ops[op.id] = op
        _check_access_and_render(op)
        if (op.method is None) != (op.path is None):
            raise ValueError(f"operation {op.id}: method and path go together")
        in_path = {a.wire for a in op.args if a.into == "path"}
        if op.method is not None and op.path is not None:
            if (op.method, op.path) in routes:
                raise ValueError(f"operation {op.id}: route {op.method} {op.path} is declared twice")
            routes.add((op.method, op.path))
            if set(path_params(op.path)) != in_path:
                raise ValueError(f"operation {op.id}: path {op.path} needs exactly the arguments {in_path}")
        elif op.client:
            if op.follow is not None or not op.ctl or any(a.into != "body" for a in op.args):
                raise ValueError(f"operation {op.id}: a client-side verb takes plain arguments and follows nothing")
        elif op.follow is None or op.follow.when != "always" or not op.ctl:
            raise ValueError(f"operation {op.id} has no route, so it must always follow another")
        if op.client and op.path is not None:
            raise ValueError(f"operation {op.id}: a client-side verb has no route")
    for op in ops.values():
        if op.follow is not None and followed[op.follow.kind] not in ops:
            raise ValueError(f"operation {op.id} follows {followed[op.follow.kind]}, which is not declared")
        if op.path is None and op.follow is not None:
            poll = ops[followed[op.follow.kind]]
            if set(path_params(poll.path or "")) != {a.wire for a in op.args if a.into == "path"}:
                raise ValueError(f"operation {op.id}: its path arguments must fill {poll.path}")
        for n in range(1, len(op.words)):
            group = " ".join(op.words[:n])
            if group in {o.command for o in ops.values()}:
                raise ValueError(f"{group!r} is both a command and a command group")
            if op.ctl and group not in nouns:
                raise ValueError(f"command group {group!r} has no help in NOUNS")
    return ops


def _check_access_and_render(op: Operation) -> None:
    if op.public and (op.method != "GET" or op.public_on_loopback):
        raise ValueError(f"operation {op.id}: only a GET may be public (and public includes loopback)")
    spec = op.render
    if (spec.kind == "table") != bool(spec.rows):
        raise ValueError(f"operation {op.id}: a table renders the rows under `rows`, and only a table has rows")
    hidden = [key for key, _ in spec.tables if spec.fields and key not in spec.fields]
    if hidden:
        raise ValueError(f"operation {op.id}: render tables {hidden} are not among its fields")


#: Every operation, by id, in the order giaannctl's help and the docs list them.
OPERATIONS: Final[Mapping[str, Operation]] = index_operations(_TABLE)


def operations_of(service: str) -> tuple[Operation, ...]:
    """The operations with a route that ``service`` must bind (none for other services)."""
    return tuple(op for op in OPERATIONS.values() if op.service == service and op.path is not None)
