"""Disk full: a storage node refuses writes while its file system has no room, keeps serving reads,
and resumes by itself; failed snapshots are retried, and write errors logged without flooding.

Theory of operation
-------------------
States: ``ok`` and ``full``. ``DiskFull`` holds them and every rule that moves between them (pure:
``now`` and free bytes are passed in); ``DiskWatch`` is the glue that owns the clock, ``statvfs``,
logging, counters and the gossip callback (STYLE.md items 1 and 2).

- **ok -> full**: a write to a file the storage role owns (update-log append or fsync, hint log,
  vocabulary log, snapshot) failed with ENOSPC or EDQUOT. Logged once, at ERROR.
- **full**: every write request (a batch, a hint, vocabulary) is refused before it touches a file,
  with ``Unavailable("disk full: ...")``: the writer hints its share to another node, which
  delivers it once this one has room again (hints.py), where ``StoreFull`` would have dropped the
  hint. Reads are served. The node gossips ``NodeMeta.full`` and reports ``full`` and
  ``disk_full`` in ``/v1/status`` and ``giaannd_storage_disk_full``; refusals are counted and
  summarised in one log line per ``storage.error-log-interval-s``.
- **full -> ok**: every ``storage.disk-full-probe-s`` the glue reads the free bytes of the store
  directory's file system; once at least ``storage.disk-resume-free-bytes`` are free, writes
  resume (logged once, at INFO). The margin is hysteresis: resuming at the first free byte would
  flip between the states, and gossip each flip, on every write. A write that fails again simply
  re-enters ``full``.

Other write errors (EIO, ...) leave the state alone: the request gets ``Unavailable`` as before,
and the error is logged at most once per interval per (operation, errno), with the number held
back (``peers.log_limiter``). A failed snapshot is never fatal: its temporary is already deleted
(snapshot.py), and it is retried after a capped, jittered backoff (``peers.retry.Backoff``,
``storage.retry-base-s`` / ``retry-cap-s``) rather than the full snapshot interval.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from giaannd.config import StorageConfig
from peers.log_limiter import LogLimiter
from peers.retry import Backoff

__all__ = ["OUT_OF_SPACE_ERRNOS", "DiskFull", "DiskWatch", "is_out_of_space"]

log = logging.getLogger(__name__)

#: The errors that mean "no room": the disk (or the user's quota) is full. EIO and the rest are not:
#: they do not heal by freeing space, so they do not switch the node to refusing writes.
OUT_OF_SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
_REFUSED: Final = "refused"


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE_ERRNOS


@dataclass
class DiskFull:
    """The disk-full state and its transitions (module docstring). Pure.

    Attributes:
        resume_free_bytes: free bytes needed to leave ``full``.
        full: writes are refused.
        since: ``now`` when it became full (None when not full).
        cause: the failure that made it full, for status and the refusal message.
        refused: writes refused since start.
        episodes: times it became full since start.
    """

    resume_free_bytes: int
    full: bool = False
    since: float | None = None
    cause: str = ""
    refused: int = 0
    episodes: int = 0

    def write_failed(self, op: str, exc: OSError, now: float) -> bool:
        """A write of ``op`` failed; returns True when this made the disk full (a transition)."""
        if self.full or not is_out_of_space(exc):
            return False
        self.full, self.since, self.episodes = True, now, self.episodes + 1
        self.cause = f"{op}: {exc.strerror or exc}"
        return True

    def refusal(self) -> str:
        """Count one refused write; returns the message of its ``Unavailable`` reply."""
        self.refused += 1
        return f"disk full: writes refused until space is freed ({self.cause})"

    def space_checked(self, free_bytes: int) -> bool:
        """A probe found ``free_bytes`` free; returns True when this ended ``full`` (a transition)."""
        if not self.full or free_bytes < self.resume_free_bytes:
            return False
        self.full, self.since = False, None
        return True


class DiskWatch:
    """The glue around ``DiskFull`` for one storage service (module docstring).

    Args:
        directory: the store directory (its file system is probed).
        config: the storage settings (``configure`` replaces them before the service opens).

    Attributes:
        on_change: told ``True``/``False`` when the node starts/stops refusing writes for a full
            disk (the storage role gossips it as ``NodeMeta.full``).
        on_count: told (counter name, amount) for ``snapshot_failures`` and ``disk_full_refusals``.
    """

    def __init__(self, directory: Path, config: StorageConfig | None = None) -> None:
        self.directory = directory
        self.on_change: Callable[[bool], None] | None = None
        self.on_count: Callable[[str, int], None] | None = None
        #: consecutive failed snapshots (0 after a success) and the last one's error
        self.snapshot_failures = 0
        self.snapshot_error: str | None = None
        self._probe: asyncio.Task[None] | None = None
        self.configure(config or StorageConfig())

    def configure(self, config: StorageConfig) -> None:
        self.config = config
        self.state = DiskFull(config.disk_resume_free_bytes)
        self._log = LogLimiter(config.error_log_interval_s)
        self._backoff = Backoff(config.retry_base_s, config.retry_cap_s)

    @property
    def full(self) -> bool:
        return self.state.full

    # -- writes ---------------------------------------------------------------------------------------
    def refuse(self) -> str:
        """A write arrived while full: count it; returns the refusal's message."""
        message = self.state.refusal()
        self._count("disk_full_refusals")
        held = self._log.admit(_REFUSED, time.monotonic())
        if held is not None:
            log.warning("disk full: write refused refused_total=%d suppressed=%d dir=%s",
                        self.state.refused, held, self.directory)
        return message

    def write_failed(self, op: str, exc: OSError, detail: str = "") -> None:
        """A write of ``op`` failed with ``exc`` (the request already answers ``Unavailable``)."""
        now = time.monotonic()
        extra = f" {detail}" if detail else ""
        if self.state.write_failed(op, exc, now):
            log.error("disk full: refusing writes and serving reads until %d bytes are free op=%s dir=%s "
                      "error=%r%s", self.state.resume_free_bytes, op, self.directory, exc, extra)
            self._changed(True)
            self._probe = asyncio.get_running_loop().create_task(self._watch(), name="disk-full-probe")
            return
        held = self._log.admit((op, exc.errno), now)
        if held is not None:
            log.error("storage write failed op=%s errno=%s suppressed=%d error=%r%s", op, exc.errno, held, exc,
                      extra)

    # -- snapshots ------------------------------------------------------------------------------------
    def snapshot_failed(self, exc: OSError) -> float:
        """A snapshot failed (its temporary is already deleted); returns the seconds to wait before
        the next attempt."""
        self.snapshot_failures += 1
        self.snapshot_error = repr(exc)
        self._count("snapshot_failures")
        wait_s = self._backoff.next_delay()
        self.write_failed("snapshot", exc, f"failures={self.snapshot_failures} retry_in_s={wait_s:.2f}")
        return wait_s

    def snapshot_written(self, path: Path, seconds: float) -> None:
        if self.snapshot_failures:
            log.info("snapshot written after %d failed attempts path=%s seconds=%.3f",
                     self.snapshot_failures, path, seconds)
        else:
            log.info("snapshot written path=%s seconds=%.3f", path, seconds)
        self.snapshot_failures, self.snapshot_error = 0, None
        self._backoff.reset()

    # -- status ---------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"disk_full": self.state.full}
        if self.state.full and self.state.since is not None:
            out["disk_full_for_s"] = round(time.monotonic() - self.state.since, 1)
            out["disk_full_cause"] = self.state.cause
        if self.state.refused:
            out["disk_full_refused"] = self.state.refused
        out["snapshot_failures"] = self.snapshot_failures
        if self.snapshot_error is not None:
            out["snapshot_error"] = self.snapshot_error
        return out

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    # -- internals ------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Probe the free space until writes may resume."""
        while self.state.full:
            await asyncio.sleep(self.config.disk_full_probe_s)
            try:
                st = await asyncio.to_thread(os.statvfs, self.directory)
            except OSError as exc:
                held = self._log.admit(("statvfs", exc.errno), time.monotonic())
                if held is not None:
                    log.warning("disk full probe failed dir=%s suppressed=%d error=%r", self.directory, held, exc)
                continue
            free = st.f_bavail * st.f_frsize
            if self.state.space_checked(free):
                log.info("disk space back: writes resume free_bytes=%d refused_while_full=%d dir=%s", free,
                         self.state.refused, self.directory)
                self._log.forget(_REFUSED)
                self._changed(False)
        self._probe = None

    def _changed(self, full: bool) -> None:
        if self.on_change is not None:
            try:
                self.on_change(full)
            except Exception:  # gossip is best effort: the refusals themselves already hold
                log.exception("disk full: could not publish full=%s", full)

    def _count(self, key: str) -> None:
        if self.on_count is not None:
            self.on_count(key, 1)
