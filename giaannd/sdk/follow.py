"""Following a long operation (``Job.wait``, giaannctl's ``--wait``): poll it until it ends,
drawing a progress bar.

A ``Follow`` in giaannd/operations.py says *what* an operation follows (a training job, the node's
topology operation) and when; the operation polled is ``FOLLOWED[kind]`` from the same table.
This module holds, per kind, what the table cannot: which states end it, which of them is
success, and how to read the progress out of the polled document.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from giaannd.operations import FOLLOWED, OPERATIONS
from giaannd.sdk.errors import JobFailedError, UnavailableError, UsageError
from giaannd.sdk.http import MAX_TIMEOUT_S, AdminClient, fill_route
from giaannd.sdk.progress import ProgressBar

__all__ = ["JOB_POLL_S", "UNAVAILABLE_GRACE_S", "Follower", "check_wait", "follow"]

#: How often a followed operation is polled; the bar redraws at most this often anyway.
JOB_POLL_S: Final = 0.5
#: How long the polls of a followed operation may fail as unavailable (the daemon unreachable, or
#: a 503: e.g. a cluster job's register, whose owners a loaded or partitioned cluster briefly cannot
#: reach in quorum) before the wait gives up with that error. The operation runs on meanwhile: a
#: wait that ended on one failed poll left a job running with nobody following it.
UNAVAILABLE_GRACE_S: Final = 60.0
#: The least time one poll of a wait with a timeout may take (``Follower.poll_timeout``).
MIN_POLL_TIMEOUT_S: Final = 0.1

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


def check_wait(timeout_s: float | None, poll_s: float) -> None:
    """Refuse a wait's bounds that cannot bound it: a NaN ``timeout_s`` never compares past its
    deadline (the wait would poll forever), a negative or NaN ``poll_s`` fails in ``time.sleep``
    (and is taken as 0 by ``asyncio.sleep``: polling without pause), and so does an infinite or
    huge one (``OverflowError``; ``asyncio.sleep`` never wakes): a poll a day apart at the most,
    as one request's ``MAX_TIMEOUT_S``.

    Raises:
        UsageError: naming the bound.
    """
    if timeout_s is not None and math.isnan(timeout_s):
        raise UsageError("a wait's timeout_s must be a number of seconds (or None), not NaN")
    if not 0 <= poll_s <= MAX_TIMEOUT_S:
        raise UsageError(f"a wait's poll_s must be seconds >= 0 and <= {MAX_TIMEOUT_S:.0f}, not {poll_s}")


class Follower:
    """What following one operation needs between polls, with no I/O of its own (a sync or an
    async caller does the polling): the path to poll, and ``see`` for each document it got."""

    def __init__(self, kind: str, params: Mapping[str, str], *, progress: bool, stream: Any = None,
                 grace_s: float | None = None) -> None:
        self._kind, self._params = _KINDS[kind], dict(params)
        self._grace_s = UNAVAILABLE_GRACE_S if grace_s is None else grace_s
        #: when the polls started failing as unavailable (None: the last one answered)
        self._unavailable_since: float | None = None
        template = OPERATIONS[FOLLOWED[kind]].path
        assert template is not None  # index_operations checks that what is followed has a route
        self.path = fill_route(template, params)  # UsageError: an empty parameter
        self._progress, self._stream = progress, stream
        self._bar: ProgressBar | None = None

    def see(self, doc: Doc) -> bool:
        """Take one polled document; True once the operation ended well (draws the bar).

        Raises:
            JobFailedError: it ended in another state than success.
        """
        k = self._kind
        self._unavailable_since = None
        if self._progress and self._bar is None:
            self._bar = ProgressBar(self._stream or sys.stderr, k.label(doc, self._params))
        if self._bar is not None:
            self._bar.update(*k.count(doc))
        state = doc.get("state")
        if state not in k.terminal:
            return False
        if self._bar is not None:
            self._bar.close(str(state))
        if state != k.ok:
            raise JobFailedError(f"{k.what(doc, self._params)} {state}: {doc.get('error') or 'no reason given'}",
                                 doc)
        return True

    def unavailable(self, exc: UnavailableError, now: float, *, overdue: bool = False) -> None:
        """A poll failed as unavailable at ``now`` (monotonic seconds): returns, so the caller polls
        again after its interval, until the failures have lasted ``grace_s`` or the wait is
        ``overdue`` (its own timeout ran out); then raises ``exc``."""
        if self._unavailable_since is None:
            self._unavailable_since = now
        if overdue or now - self._unavailable_since >= self._grace_s:
            raise exc

    @staticmethod
    def poll_timeout(deadline: float | None, poll_s: float) -> float | None:
        """The bound on the next poll's request for a wait that ends at ``deadline`` (monotonic
        seconds; None: no bound beyond the client's own): what is left of the wait, but at least
        one poll interval (``MIN_POLL_TIMEOUT_S`` at the least), so a poll that hangs cannot
        hold the wait past its timeout by the client's whole request timeout."""
        if deadline is None:
            return None
        return max(deadline - time.monotonic(), poll_s, MIN_POLL_TIMEOUT_S)

    def overdue(self, doc: Doc, timeout_s: float) -> TimeoutError:
        """The error for a wait that outlasted ``timeout_s`` (the operation goes on)."""
        return TimeoutError(f"{self._kind.what(doc, self._params)} still {doc.get('state')} after "
                            f"{timeout_s:g} s (it goes on; wait again)")


def follow(c: AdminClient, kind: str, params: Mapping[str, str], *, progress: bool,
           poll_s: float = JOB_POLL_S, stream: Any = None, timeout_s: float | None = None,
           grace_s: float | None = None) -> Any:
    """Poll the operation ``FOLLOWED[kind]`` (its path filled from ``params``) until its
    ``state`` is terminal, drawing a bar on ``stream`` (default stderr) when ``progress``. Polls
    that fail as unavailable are repeated for up to ``grace_s`` (None: ``UNAVAILABLE_GRACE_S``).

    Returns:
        The final document.

    Raises:
        JobFailedError: it ended in another state than success (exit 1).
        TimeoutError: still running after ``timeout_s`` (None: wait as long as it runs).
        UnavailableError: the polls failed as unavailable for ``grace_s``, or when ``timeout_s`` ran out
            (a poll that has not answered by then fails as unavailable).
        ClientError: a request failed otherwise.
        UsageError: ``timeout_s`` or ``poll_s`` cannot bound the wait (``check_wait``).
    """
    check_wait(timeout_s, poll_s)
    f = Follower(kind, params, progress=progress, stream=stream, grace_s=grace_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            bound = f.poll_timeout(deadline, poll_s)
            doc = c.json("GET", f.path) if bound is None else c.json("GET", f.path, timeout_s=bound)
        except UnavailableError as exc:
            now = time.monotonic()
            f.unavailable(exc, now, overdue=deadline is not None and now >= deadline)
            time.sleep(poll_s)
            continue
        if f.see(doc):
            return doc
        if deadline is not None and time.monotonic() >= deadline:
            assert timeout_s is not None
            raise f.overdue(doc, timeout_s)
        time.sleep(poll_s)
