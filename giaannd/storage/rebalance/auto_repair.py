"""Automatic repair after recovery cut a torn update-log tail (issue 16 item 7).

Why: recovery cuts a torn last record off the update log and logs a warning (engine/recovery.py).
A torn tail normally holds only a write that was never acknowledged (acks wait for fsync), but a
damaged disk, or a file system that lost synced data, leaves the same picture with acknowledged
batches in it: the replica would then serve stale rows until an operator ran ``giaannctl node
repair``, with nothing in status or metrics to say so. The node cannot tell the two cases apart,
so it repairs whenever recovery cut bytes: cheap when nothing is missing (digests compare equal),
exact when something is (the lost batches are rebuilt from the peers' logs under their ids:
repair/remote.py).

States (``AUTO_REPAIR_STATES``)::

    pending -> waiting -> running -> done | incomplete
                  ^          |
                  +----------+   (retry after a jittered, capped backoff)
    waiting/running -> failed    (storage.auto-repair-timeout-s passed)

- ``waiting``: no attempt possible yet (this node is not active in the ring, no live storage peer,
  a peer without a stream endpoint), or the last attempt could not finish (a peer did not answer,
  an error): retried after ``storage.retry-base-s`` doubling up to ``retry-cap-s`` (full jitter).
- ``done``: every live peer answered; the lost batches were rebuilt and the rows compared equal.
- ``incomplete``: every peer answered, but some batches are in no peer's log any more or some rows
  still differ: the report says which, logged at WARNING: the operator decides.
- ``failed``: the timeout passed without a complete attempt; logged at ERROR.

``verdict(report)`` is the one decision, pure; ``AutoRepair.run`` is the glue around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

from giaannd.config import StorageConfig
from peers.retry import RetryPolicy, attempts

__all__ = ["AUTO_REPAIR_STATES", "AutoRepair", "summary", "verdict"]

log = logging.getLogger(__name__)

AutoRepairState = Literal["pending", "waiting", "running", "done", "incomplete", "failed"]
AUTO_REPAIR_STATES: Final[tuple[AutoRepairState, ...]] = (
    "pending", "waiting", "running", "done", "incomplete", "failed")


def verdict(report: dict[str, Any]) -> Literal["retry", "done", "incomplete"]:
    """What a ``repair_self`` report means for the automatic repair (module docstring)."""
    if report.get("peers_failed"):
        return "retry"
    if report.get("unrecoverable") or report.get("unlogged") or report.get("rows_divergent"):
        return "incomplete"
    return "done"


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report for ``/v1/status``: counts instead of the (possibly long) lists of rows."""
    out = {k: v for k, v in report.items() if k not in ("rows_divergent", "rows_divergent_count", "unrecoverable")}
    out["rows_divergent"] = report.get("rows_divergent_count", len(report.get("rows_divergent", ())))
    out["unrecoverable"] = sum(len(v) for v in report.get("unrecoverable", {}).values())
    return out


class AutoRepair:
    """One automatic repair of this node (module docstring).

    Args:
        torn_tail_bytes: what recovery cut (reported with the state).
        config: ``retry-base-s``, ``retry-cap-s`` and ``auto-repair-timeout-s``.
    """

    def __init__(self, torn_tail_bytes: int, config: StorageConfig) -> None:
        self.torn_tail_bytes = torn_tail_bytes
        self.policy = RetryPolicy(config.retry_base_s, config.retry_cap_s)
        self.timeout_s = config.auto_repair_timeout_s
        self.state: AutoRepairState = "pending"
        self.attempts = 0
        self.result: dict[str, Any] | None = None
        self.error: str | None = None

    async def run(self, repair: Callable[[], Awaitable[dict[str, Any]]], ready: Callable[[], str | None]) -> None:
        """Attempt ``repair`` until an attempt completes or the timeout passes.

        Args:
            repair: one repair of this node (``StorageTopology.repair``); returns its report.
            ready: None when an attempt can start now, else why not (for status and the log).
        """
        log.warning("update log lost %d bytes at recovery: repairing this node from its peers once it can",
                    self.torn_tail_bytes)
        loop = asyncio.get_running_loop()
        async for _ in attempts(self.policy, deadline=loop.time() + self.timeout_s):
            why_not = ready()
            if why_not is not None:
                self.state, self.error = "waiting", why_not
                continue
            self.state = "running"
            self.attempts += 1
            try:
                report = await repair()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure is retried; the last one is shown
                self.state, self.error = "waiting", repr(exc)
                log.info("automatic repair attempt %d failed, retrying: %r", self.attempts, exc)
                continue
            outcome = verdict(report)
            if outcome == "retry":
                self.state, self.error = "waiting", f"peers did not answer: {report['peers_failed']}"
                continue
            self.state, self.result, self.error = outcome, summary(report), None
            if outcome == "done":
                log.info("automatic repair done attempts=%d batches_shipped=%d rows_compared=%d",
                         self.attempts, report.get("batches_shipped", 0), report.get("rows_compared", 0))
            else:
                log.warning("automatic repair incomplete: some updates are in no peer's log or rows still "
                            "differ; run giaannctl node repair after checking report=%s", self.result)
            return
        self.state = "failed"
        log.error("automatic repair failed after %.0f s attempts=%d last_error=%s: run giaannctl node repair",
                  self.timeout_s, self.attempts, self.error)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "attempts": self.attempts,
                               "torn_tail_bytes": self.torn_tail_bytes}
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out
