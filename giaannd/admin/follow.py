"""Following a long operation from giaannctl: poll it until it ends, drawing a progress bar.

A ``Follow`` in giaannd/operations.py says *what* an operation follows (a training job, the node's
topology operation) and when; the operation polled is ``FOLLOWED[kind]`` from the same table.
This module holds, per kind, what the table cannot: which states end it, which of them is
success, and how to read the progress out of the polled document.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from giaannd.admin.client import AdminClient, CtlError
from giaannd.admin.progress import ProgressBar
from giaannd.operations import FOLLOWED, OPERATIONS, fill_path

__all__ = ["JOB_POLL_S", "follow", "wait_for_job", "wait_for_topology"]

#: How often a followed operation is polled; the bar redraws at most this often anyway.
JOB_POLL_S: Final = 0.5

Doc = Mapping[str, Any]


@dataclass(frozen=True)
class _Kind:
    terminal: Collection[str]
    ok: str
    #: (the polled document, the poll's path parameters) -> the bar's label.
    label: Callable[[Doc, Mapping[str, str]], str]
    #: The polled document -> (done, total or None, unit).
    count: Callable[[Doc], tuple[int, int | None, str]]
    #: (document, parameters) -> what failed, for the error message.
    what: Callable[[Doc, Mapping[str, str]], str]


def _job_label(d: Doc, p: Mapping[str, str]) -> str:  # a resumed job says so (its count starts there)
    resumed = d.get("resumed_from")
    return f"job {p['job_id']}" + (f" (resumed at {resumed})" if resumed is not None else "")


_KINDS: Final[Mapping[str, _Kind]] = {
    "job": _Kind(frozenset({"succeeded", "failed", "cancelled"}), "succeeded", _job_label,
                 lambda d: (int(d.get("done", 0)), d.get("total"), str(d.get("unit", "items"))),
                 lambda d, p: f"job {p['job_id']}"),
    "topology": _Kind(frozenset({"done", "failed", "cancelled"}), "done",
                      lambda d, p: str(d.get("op", "topology")),
                      lambda d: (int(d.get("bytes_done", 0)), int(d.get("bytes_total", 0)) or None, "B"),
                      lambda d, p: f"topology operation {d.get('op')}"),
}


def follow(c: AdminClient, kind: str, params: Mapping[str, str], *, progress: bool,
           poll_s: float = JOB_POLL_S, stream: Any = None) -> Any:
    """Poll the operation ``FOLLOWED[kind]`` (its path filled from ``params``) until its
    ``state`` is terminal, drawing a bar on ``stream`` (default stderr) when ``progress``.

    Returns:
        The final document.

    Raises:
        CtlError: it ended in another state than success (exit 1), or a request failed.
    """
    k = _KINDS[kind]
    template = OPERATIONS[FOLLOWED[kind]].path
    assert template is not None  # index_operations checks that what is followed has a route
    path = fill_path(template, params)
    bar: ProgressBar | None = None
    while True:
        doc = c.json("GET", path)
        if progress and bar is None:
            bar = ProgressBar(stream or sys.stderr, k.label(doc, params))
        if bar is not None:
            bar.update(*k.count(doc))
        state = doc.get("state")
        if state in k.terminal:
            if bar is not None:
                bar.close(str(state))
            if state != k.ok:
                raise CtlError(f"{k.what(doc, params)} {state}: {doc.get('error') or 'no reason given'}")
            return doc
        time.sleep(poll_s)


def wait_for_job(c: AdminClient, job_id: str, *, progress: bool, poll_s: float = JOB_POLL_S,
                 stream: Any = None) -> Any:
    """Follow training job ``job_id`` until it ends; the final status (``follow``)."""
    return follow(c, "job", {"job_id": job_id}, progress=progress, poll_s=poll_s, stream=stream)


def wait_for_topology(c: AdminClient, *, progress: bool, poll_s: float = JOB_POLL_S,
                      stream: Any = None) -> Any:
    """Follow this node's topology operation until it ends; its final progress (``follow``)."""
    return follow(c, "topology", {}, progress=progress, poll_s=poll_s, stream=stream)
