"""``giaannd.Client``: the cluster from Python, one method per thing a researcher does.

Theory of operation
-------------------
A ``Client`` talks to one node's admin API (the same routes giaannctl calls; docs/operations.md
lists them) and returns plain Python and numpy values, never raw JSON documents to pick apart:
``train`` returns a ``Job`` to wait on, ``column`` a ``Column`` of arrays, ``generate`` a string.
Which node, and with which token, is found the way giaannctl finds it (giaannd/sdk/locate.py):
the arguments, then ``GIAANNCTL_ADDR`` / ``GIAANNCTL_TOKEN_FILE``, then ``data_dir``'s files, then
the host's only instance. Errors are the typed exceptions of giaannd/sdk/errors.py with the
daemon's own message.

Files: a corpus, prompt file or export path names a file *on the daemon's host*, inside its
``compute.corpus-dir`` (reading) or ``compute.export-dir`` (writing); a relative path is taken
there. A client made with ``staging_dir`` (``LocalCluster`` does this: the nodes share the
cluster's corpus directory) copies a local file from elsewhere into it first, so
``client.train("~/my.conllu")`` works on a local cluster.

``call`` is the one general entry point (any route, JSON in and out); giaannctl, which drives
every operation from the table in giaannd/operations.py, uses it and has no HTTP of its own. The
methods name their routes by operation id (``operation``), so the table stays the one place a
route's method and path are written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from giaannd.operations import OPERATIONS
from giaannd.sdk.column import Column
from giaannd.sdk.errors import ClientError, UsageError
from giaannd.sdk.follow import JOB_POLL_S, follow
from giaannd.sdk.http import DEFAULT_TIMEOUT_S, AdminClient, fill_route
from giaannd.sdk.locate import locate
from giaannd.sdk.report import write_report

__all__ = ["Client", "Job", "read_token"]


def read_token(path: Path) -> tuple[str | None, str | None]:
    """(the token in ``path``, None) or (None, why it could not be read or cannot be sent: not
    UTF-8 text, as the daemon reads it, or a line break inside, which no HTTP header carries)."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        return None, f"cannot read token file {path}: {exc.strerror}"
    except UnicodeDecodeError as exc:
        return None, f"token file {path} is not UTF-8 text (byte {exc.start})"
    if any(c in token for c in "\r\n"):
        return None, f"token file {path} holds more than one line"
    return token or None, None


class Job:
    """A training job: ``status()``, ``wait()``, ``cancel()`` (any compute node answers for a
    cluster job, so the job is followed through whichever node the client talks to)."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id

    def __repr__(self) -> str:
        return f"Job({self.job_id!r})"

    def status(self) -> dict[str, Any]:
        """The job's document: ``state``, ``done`` / ``total``, ``trained``, ``sentences_per_s``,
        ``timeline``, ``by_node`` for a cluster job (docs/compute.md)."""
        return dict(self.client.operation("train.status", job_id=self.job_id))

    def wait(self, progress: bool = True, *, timeout_s: float | None = None,
             poll_s: float = JOB_POLL_S) -> dict[str, Any]:
        """Wait for the job to end; its final figures (the document, as ``status``).

        Args:
            progress: draw a progress bar on stderr (a line per 10 % when it is not a terminal).
            timeout_s: give up waiting after this long (the job goes on); None waits.

        Raises:
            JobFailedError: it failed or was cancelled (``.doc`` is its final document).
            TimeoutError: still running after ``timeout_s``.
            UsageError: ``timeout_s`` is NaN, or ``poll_s`` negative or NaN.
        """
        doc = follow(self.client.api, "job", {"job_id": self.job_id}, progress=progress, poll_s=poll_s,
                     timeout_s=timeout_s)
        return dict(doc)

    def cancel(self) -> dict[str, Any]:
        """Cancel it; its document."""
        return dict(self.client.operation("train.cancel", job_id=self.job_id))


class Client:
    """One node's admin API (module docstring).

    Args:
        addr: ``http://host:port`` or ``host:port`` (default: as giaannctl finds it).
        token_file: the admin bearer token's file.
        data_dir: a node's data directory, to read both from.
        timeout_s: bound on one request.
        staging_dir: a directory the daemons read corpora from (their ``compute.corpus-dir``),
            into which local files named elsewhere are copied.

    Raises:
        UsageError: an address or timeout that is not one, several instances to choose from.
        ClientError: ``data_dir`` has no running daemon.
    """

    def __init__(self, addr: str | None = None, token_file: str | os.PathLike[str] | None = None,
                 data_dir: str | os.PathLike[str] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 staging_dir: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        target = locate(addr=addr, token_file=None if token_file is None else os.fspath(token_file),
                        data_dir=None if data_dir is None else os.fspath(data_dir),
                        environ=os.environ if environ is None else environ)
        token, problem = read_token(target.token_file)
        #: why no token is sent (None: one is): a call that needs one is refused with this reason
        self.token_problem = None if problem is None else f"{problem} ({target.hint})"
        self.api = AdminClient(target.addr, token, timeout_s, token_problem=self.token_problem)
        self.staging_dir = None if staging_dir is None else Path(staging_dir)

    @property
    def addr(self) -> str:
        return self.api.addr

    def __repr__(self) -> str:
        return f"Client({self.addr!r})"

    # -- any route ------------------------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None) -> Any:
        """Send one request to any route; its decoded JSON answer.

        Raises:
            ClientError: as the module docstring says, typed by what failed.
        """
        return self.api.json(method, path, body, _query(query))

    def call_text(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None) -> str:
        """``call`` for a route that answers text (``/metrics``).

        Raises:
            ClientError: as ``call``, or the answer is not UTF-8 text.
        """
        raw = self.api.request(method, path, body, _query(query))[0]
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise ClientError(f"giaannd at {self.addr} sent a reply for {path} that is not UTF-8 text "
                              f"(byte {exc.start})") from None

    def operation(self, op_id: str, body: Any = None, query: Mapping[str, Any] | None = None,
                  **params: Any) -> Any:
        """``call`` of the operation ``op_id`` of giaannd/operations.py (its method, and its path
        with ``params`` filled in, each one percent-encoded segment): the table is the one place
        routes are named."""
        op = OPERATIONS[op_id]
        assert op.method is not None  # every operation the client calls has a route
        return self.call(op.method, _path(op_id, **params), body, query)

    # -- the node and the cluster ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """This node: name, id, state, roles, each service's health."""
        return dict(self.operation("node.status"))

    def members(self) -> list[dict[str, Any]]:
        """The member table: name, status (alive / suspect / dead / left), roles, addresses."""
        return list(self.operation("members.list")["members"])

    def ring(self) -> dict[str, Any]:
        """The placement in force, with each member's owner counts."""
        return dict(self.operation("ring.show"))

    def usage(self) -> list[dict[str, Any]]:
        """Each storage node's fill: RAM used of capacity, disk, rows, entries, row sizes."""
        return list(self.operation("ring.usage")["nodes"])

    def metrics(self) -> str:
        """This node's Prometheus metrics (text exposition format)."""
        return self.call_text("GET", _path("metrics"))

    # -- training ---------------------------------------------------------------------------------

    def train(self, corpus: str | os.PathLike[str], *, epochs: int | None = None, limit: int | None = None,
              workers: int | None = None, coalesce: int | None = None, cluster: bool | None = None) -> Job:
        """Start training on ``corpus`` (CoNLL-U, plain or gzip, or raw UTF-8 text, which the
        daemon tags); the job, running. Unset options take the daemon's defaults.

        Args:
            limit: train on at most this many sentences.
            cluster: a cluster job every compute node works on (default: ``compute.cluster-jobs``).
        """
        body = _without_none({"corpus": self._staged(corpus), "epochs": epochs, "limit": limit,
                              "workers": workers, "coalesce": coalesce, "cluster": cluster})
        return Job(self, str(self.operation("train.start", body)["job_id"]))

    def job(self, job_id: str) -> Job:
        """A job by id (nothing is asked until you call one of its methods)."""
        return Job(self, job_id)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job this node knows: its own, then the cluster's."""
        return list(self.operation("train.list")["jobs"])

    # -- inference --------------------------------------------------------------------------------

    def eval(self, prompts: None | str | os.PathLike[str] | Sequence[str] = None, constants: str = "train",
             limit: int | None = None, *, corpus: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Top-1 next-token accuracy (teacher-forced, 8 seed tokens).

        Args:
            prompts: None: the daemon's default set, the first ``limit`` (default 200) sentences of
                the bundled corpus (or ``corpus``); a path: a prompt file (one prompt per non-blank
                line); a list of strings: those prompts.
            constants: ``"train"`` or ``"test"`` (the reference's two sets of constants).
            limit: evaluate at most this many prompts.
            corpus: held-out CoNLL-U or text to evaluate on, instead of prompts.

        Returns:
            At least ``top1``, ``matches``, ``prediction_tokens``, ``prompts``.
        """
        body: dict[str, Any] = {"constants": constants, "limit": limit}
        if isinstance(prompts, (str, os.PathLike)):
            body["prompts"] = self._staged(prompts)
        elif prompts is not None:
            lines = list(prompts)
            if not lines or not all(isinstance(x, str) and x.strip() for x in lines):
                raise UsageError("prompts must be a path or a non-empty list of non-blank strings")
            body["prompt_lines"] = lines
        if corpus is not None:
            body["corpus"] = self._staged(corpus)
        return dict(self.operation("eval", _without_none(body)))

    def evals(self) -> list[dict[str, Any]]:
        """This node's evaluations, oldest first, each with the sentences trained at the time."""
        return list(self.operation("evals.list")["evals"])

    def generate(self, prompt: str, max_tokens: int = 20) -> str:
        """Text generated from ``prompt`` (at most ``max_tokens`` tokens)."""
        return str(self.operation("generate", {"prompt": prompt, "max_tokens": max_tokens})["text"])

    # -- the model --------------------------------------------------------------------------------

    def column(self, word: str, *, limit: int | None = None) -> Column:
        """A concept column's feature neurons and outgoing connections, as numpy arrays.

        Args:
            limit: connections to read at most (``truncated`` says the column held more); None:
                the node's ``compute.column-rows-default-entries``, as giaannctl's ``column rows``.
                (A fixed number here was a 400 on a node whose ``column-rows-max-entries`` is
                lower.)

        Raises:
            NotFoundError: no such column, or it has no rows.
            BadRequestError: ``limit`` above the node's ``compute.column-rows-max-entries``.
        """
        doc = self.operation("column.rows", query={"limit": limit}, column=word)
        try:
            return Column.from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise ClientError(f"giaannd at {self.addr} sent a malformed column answer: {exc!r}") from None

    def column_info(self, word: str) -> dict[str, Any]:
        """A column's owners and, per owner, its rows, entries, bytes and digests."""
        return dict(self.operation("column.info", column=word))

    def export(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> dict[str, Any]:
        """Write every row of the cluster to a JSONL file on the daemon's host (inside its
        ``compute.export-dir``); the export's figures (rows, entries, path)."""
        return dict(self.operation("export", {"path": os.fspath(path), "overwrite": overwrite}))

    def report(self, path: str | os.PathLike[str]) -> Path:
        """Write a self-contained HTML report with plots of the cluster's jobs, evaluations, row
        sizes, storage fill and placement (giaannd/sdk/report.py); its path. Needs matplotlib
        (``pip install 'giaannd[report]'``)."""
        return write_report(self, Path(path))

    # -- helpers ----------------------------------------------------------------------------------

    def _staged(self, path: str | os.PathLike[str]) -> str:
        """What to send for a file the daemon reads (module docstring, "Files")."""
        text = os.fspath(path)
        local = Path(text).expanduser()
        if self.staging_dir is None or not local.is_file():
            return text
        local = local.resolve()
        staging = self.staging_dir.resolve()
        if local.is_relative_to(staging):
            return str(local)
        # One staged copy per source path, refreshed when the source changed (copy2 keeps mtime).
        digest = hashlib.blake2b(str(local).encode(), digest_size=4).hexdigest()
        suffix = "".join(local.suffixes[-2:])  # keeps .conllu.gz, which says how to read it
        target = staging / f"{local.name[:len(local.name) - len(suffix)]}-{digest}{suffix}"
        src = local.stat()
        try:
            dst = target.stat()
            fresh = (dst.st_size, dst.st_mtime_ns) == (src.st_size, src.st_mtime_ns)
        except OSError:
            fresh = False
        if not fresh:
            staging.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local, target)
        return str(target)


def _path(op_id: str, **params: Any) -> str:
    """The path of ``op_id`` with ``params`` filled in (``UsageError``: one is empty)."""
    template = OPERATIONS[op_id].path
    assert template is not None
    return fill_route(template, params)


def _query(query: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The query string's values as text, unset (None) ones left out."""
    q = {k: str(v) for k, v in (query or {}).items() if v is not None}
    return q or None


def _without_none(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}
