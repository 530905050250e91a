"""Hinted handoff: batches this node keeps, durably, for a replica that was down (Dynamo §4.6).

Theory of operation
-------------------
When a writer cannot reach one of a row's owners, it sends that owner's share to another live node
with ``hint_for=<owner>``. That node does not apply it to its own store (it may not even own the
rows): it appends it to a *hint log* for the owner and acknowledges once the log is synced. When the
owner is reachable again (a topology event, or the periodic retry), the service delivers the hints in
order with ordinary ``ApplyBatch`` requests carrying the original batch ids — so a hint delivered twice
(crash between delivery and deletion, or a writer's own retry racing it) is ignored by the owner's
applied set — and forgets each one the owner acknowledged as durable.

On disk: one directory per target, ``hints/t-<hex of the target name>/``, holding update-log segments
(update_log.py: length, checksums, format version — the same format, read by the same scanner).
When every hint of a target is delivered, the directory is deleted. A crash after some deliveries
re-delivers those (harmless, above). A torn tail of the last segment is cut off (the hint was never
acknowledged); damage elsewhere stops start-up naming the file and offset, as for the update log, and
so does a gap between segments (one that lost records at its end: no segment is ever deleted alone).

Hints are also held in RAM (the service delivers from there) and bounded by ``max_bytes``: past it the
node refuses further hints (``Unavailable``), and the writer tries the next node in the preference list.

**Placement epoch.** Each hint remembers the placement epoch its writer split the batch with
(``ApplyBatch.placement_epoch``): delivery sends that epoch, not the holder's current one, so a
topology-change source tells an old-placement write from a new one (docs/topology.md). In the log,
an *epoch record* precedes the batch records it applies to: an update-log ``KIND_FLOOR`` record
(hint logs hold no floors otherwise) whose two u64 fields are the low and high halves of the
128-bit placement digest (``Placement.epoch`` is 32 hex digits); (0, 0) means "unknown" (the
writer sent an empty or foreign epoch: delivery then sends the holder's current epoch, as before).
It is written only when the epoch differs from the previous record's, so the cost is one 56-byte
record per epoch change. Old hint logs (no epoch records) read as "unknown"; an older reader skips
the epoch records (it only looks at batch records).

**A second share of one batch id.** A holder may be sent two different shares of one batch id for
one target: a writer that retries the batch after a placement change (the target owns more rows
now), another holder's re-split. The target applies a batch id per column (applied_set.py), so
the second share's extra rows are real writes: answering "already held" acknowledged them and never
delivered them. The holder keeps the **union** of the rows instead (a row of a batch, keyed by
``(row_column, row_feature)``, has the same entries in every share, so the union is exact) and
appends it as a new batch record under the same id: recovery keeps the last record of an id (as
old code does too), so the log format is unchanged; the superseded record's bytes stay on disk
until the target's log is deleted. The union keeps the held share's epoch: a source forwards the
rows of a write not tagged with its operation's new epoch, and a forward the target also got
directly is deduplicated (docs/topology.md), while a new-epoch tag on old-placement rows would
keep them from being forwarded. A share that adds no row is a no-op (False), as before.

**A failed fsync** (a full disk, EIO) leaves the target's log refusing appends and syncs
(update_log.py, "fsyncgate"): its hints in doubt are not acknowledged, and it takes hints again
once every hint of the target was delivered (a new log). Writing the held hints again into a new
segment would lift the refusal sooner, but a power loss before that segment's sync would leave
the old segments, no longer the last, with holes that stop the start-up as corruption: not done.
A disk error while a delivered target's log is deleted is logged, not raised (the hints were
delivered); the next log for the target first removes what is left of it, so its seqs never
start at 1 twice.

Synchronous and I/O-only; the service runs ``sync`` in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from giaannd.atomic_file import fsync_dir
from giaannd.client.row_parts import find_keys, join_disjoint
from giaannd.errors import Refused
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.errors import CorruptLogError
from giaannd.storage.engine.update_log import KIND_BATCH, KIND_FLOOR, UpdateLog, list_segments, scan_segment

__all__ = ["DEFAULT_MAX_HINT_BYTES", "MAX_TARGET_NAME_BYTES", "Hint", "HintSpaceFull", "HintStore",
           "decode_epoch", "encode_epoch"]

log = logging.getLogger(__name__)

#: RAM and disk this node gives to hints for others by default: enough for minutes of one owner's
#: share of training traffic; a longer outage should end in re-replication (issue 8), not hints.
DEFAULT_MAX_HINT_BYTES: Final = 256 * 2**20
#: A target name becomes a directory name (hex-encoded, two characters per byte, under NAME_MAX 255).
MAX_TARGET_NAME_BYTES: Final = 120
_PREFIX: Final = "t-"
_EPOCH_HEX: Final = 32  # Placement.epoch: xxh3-128 hex digest
_U64: Final = (1 << 64) - 1


class HintSpaceFull(Refused):
    """Holding this hint would exceed the node's hint budget; the writer should try another node."""

    reason = "hint_space_full"


@dataclass(frozen=True, slots=True)
class Hint:
    """One held batch for ``target``."""

    target: str
    batch_id: BatchId
    batch: RowBatch
    #: placement epoch the writer split the batch with ("" unknown: an old hint log, or none sent)
    epoch: str = ""


@dataclass
class _TargetLog:
    log: UpdateLog
    hints: dict[BatchId, Hint] = field(default_factory=dict)
    #: epoch of the last epoch record in the log (None: none written yet, or unknown on recovery)
    epoch: str | None = None


def encode_epoch(epoch: str) -> tuple[int, int]:
    """An epoch as the two u64 of an epoch record; (0, 0) for one that is not a 128-bit hex digest."""
    if len(epoch) != _EPOCH_HEX:
        return 0, 0
    try:
        value = int(epoch, 16)
    except ValueError:
        return 0, 0
    return value & _U64, value >> 64


def decode_epoch(low: int, high: int) -> str:
    """The inverse of ``encode_epoch`` ("" for the unknown epoch)."""
    if low == 0 and high == 0:
        return ""
    return f"{(high << 64) | low:0{_EPOCH_HEX}x}"


def _row_union(held: RowBatch, more: RowBatch) -> RowBatch | None:
    """The rows of ``held`` and those of ``more`` it lacks, as one canonical batch; None when
    ``more`` adds no row. Rows are keyed by (row_column, row_feature); a row in both is taken from
    ``held`` (a batch's row has the same entries in every share: module docstring)."""
    where = np.empty(more.num_rows, np.int64)
    find_keys(np.ascontiguousarray(held.row_column), np.ascontiguousarray(held.row_feature),
              np.ascontiguousarray(more.row_column), np.ascontiguousarray(more.row_feature), where)
    lacking = where < 0
    if not lacking.any():
        return None
    return join_disjoint([held, more.select_rows(lacking)])


def _close(hint_log: UpdateLog) -> None:
    """Close a log that is being deleted: what its closing sync says does not matter, but its
    descriptor must be closed."""
    with contextlib.suppress(OSError):
        hint_log.close()  # syncs first: a failed sync leaves the descriptor open...
    hint_log.close()  # ...and the log in doubt, so closing it again just closes it


def _dir_name(target: str) -> str:
    raw = target.encode()
    if not raw or len(raw) > MAX_TARGET_NAME_BYTES:
        raise ValueError(f"hint target name must be 1..{MAX_TARGET_NAME_BYTES} bytes")
    return _PREFIX + raw.hex()


class HintStore:
    """Durable per-target hint logs (module docstring). Build it with :meth:`open`."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._targets: dict[str, _TargetLog] = {}
        self._held_bytes = 0

    @classmethod
    def open(cls, directory: Path | str, max_bytes: int = DEFAULT_MAX_HINT_BYTES) -> HintStore:
        """Recover the hints kept in ``directory`` (created if missing).

        Raises:
            CorruptLogError: damage other than a torn tail (files left for the operator).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        store = cls(d, max_bytes)
        for sub in sorted(d.iterdir()):
            if not (sub.is_dir() and sub.name.startswith(_PREFIX)):
                continue
            try:
                target = bytes.fromhex(sub.name[len(_PREFIX):]).decode()
            except (ValueError, UnicodeDecodeError):
                log.warning("hint directory with an unreadable name skipped path=%s", sub)
                continue
            store._recover_target(target, sub)
        return store

    def _recover_target(self, target: str, sub: Path) -> None:
        segments = list_segments(sub)
        next_seq = 1
        hints: dict[BatchId, Hint] = {}
        epoch: str | None = None
        for i, (first, path) in enumerate(segments):
            if i and first != next_seq:  # a segment before lost records at its end (or all of them)
                raise CorruptLogError(str(path), 0, f"hint log segment starts at seq {first}, expected {next_seq}")
            scan = scan_segment(path, first, is_last=i == len(segments) - 1)
            if scan.torn_bytes:
                log.warning("hint log torn tail cut off file=%s offset=%d bytes=%d",
                            path, scan.good_bytes, scan.torn_bytes)
                with open(path, "r+b") as f:
                    f.truncate(scan.good_bytes)
                    os.fsync(f.fileno())
            for rec in scan.records:
                if rec.kind == KIND_FLOOR:  # an epoch record (module docstring)
                    epoch = decode_epoch(rec.writer, rec.floor)
                elif rec.kind == KIND_BATCH and rec.batch_id is not None and rec.batch is not None:
                    hints[rec.batch_id] = Hint(target, rec.batch_id, rec.batch, epoch or "")
            next_seq = first + len(scan.records)
        if not hints:
            shutil.rmtree(sub)
            return
        self._targets[target] = _TargetLog(UpdateLog(sub, next_seq), hints, epoch)
        self._held_bytes += sum(h.batch.nbytes for h in hints.values())

    # -- writes -------------------------------------------------------------------------------------
    def add(self, target: str, batch_id: BatchId, batch: RowBatch, epoch: str = "") -> bool:
        """Append a hint (durable after ``sync(target)``). False if every row of it is already held
        under that id for that target (nothing written); another share of a held id is held as the
        union of both (module docstring, "A second share").

        The batch must be owned by the caller (not a view of a receive buffer): it is kept in RAM.
        ``epoch``: the placement epoch the writer split it with (module docstring; "" unknown).

        Raises:
            HintSpaceFull: over ``max_bytes``.
            ValueError: a target name that cannot be a directory name.
            OSError: the log write failed; nothing is held.
        """
        dir_name = _dir_name(target)
        tl = self._targets.get(target)
        held = tl.hints.get(batch_id) if tl is not None else None
        if held is not None:
            union = _row_union(held.batch, batch)
            if union is None:
                return False
            batch, epoch = union, held.epoch
        freed = held.batch.nbytes if held is not None else 0
        if self._held_bytes - freed + batch.nbytes > self.max_bytes:
            raise HintSpaceFull(f"hint space full: {self._held_bytes} of {self.max_bytes} bytes held")
        if tl is None:
            sub = self.directory / dir_name
            if sub.exists():  # a delivered log whose deletion failed (``delivered``): its seqs start
                shutil.rmtree(sub)  # at 1 too, so a new log appended to it would read as corrupt
            sub.mkdir()
            fsync_dir(self.directory)
            tl = self._targets[target] = _TargetLog(UpdateLog(sub, 1))
        low, high = encode_epoch(epoch)
        epoch = decode_epoch(low, high)  # (a foreign epoch is kept as unknown, as on disk)
        if tl.epoch != epoch:
            tl.log.append_floor(low, high)
            tl.epoch = epoch
        tl.log.append_batch(batch_id, batch)
        tl.hints[batch_id] = Hint(target, batch_id, batch, epoch)  # (a union keeps the id's place)
        self._held_bytes += batch.nbytes - freed
        return True

    def sync(self, target: str) -> None:
        """fsync the target's hint log (thread-safe against ``add``)."""
        tl = self._targets.get(target)
        if tl is not None:
            tl.log.sync()

    def delivered(self, target: str, batch_id: BatchId, batch: RowBatch | None = None) -> bool:
        """The target acknowledged the hint as durable: forget it; delete the log once empty.

        ``batch``: the rows that were delivered. When the held hint is no longer that batch (a
        union with another share arrived during the delivery) it is kept, to be delivered again
        with the rows the target did not get, and the answer is False. None: forget it whatever
        it holds.
        """
        tl = self._targets.get(target)
        if tl is None:
            return True
        held = tl.hints.get(batch_id)
        if held is not None and batch is not None and held.batch is not batch:
            return False
        hint = tl.hints.pop(batch_id, None)
        if hint is not None:
            self._held_bytes -= hint.batch.nbytes
        if not tl.hints:
            del self._targets[target]
            self._remove_log(target, tl.log)
        return True

    def drop(self, target: str) -> int:
        """Forget every hint held for ``target`` and delete its log: a target that left the cluster
        for good (hint_delivery.py, "A target removed for good"). Returns how many were held."""
        tl = self._targets.pop(target, None)
        if tl is None:
            return 0
        self._held_bytes -= sum(h.batch.nbytes for h in tl.hints.values())
        self._remove_log(target, tl.log)
        return len(tl.hints)

    def _remove_log(self, target: str, hint_log: UpdateLog) -> None:
        """Delete a target's log once every hint in it was delivered. A disk error (EIO) is logged,
        not raised: the hints are delivered and stay forgotten, and the files left behind are
        removed before the target's next log is made there (``add``), or, after a restart,
        delivered again, which the target ignores (its applied set)."""
        try:
            _close(hint_log)
            shutil.rmtree(hint_log.directory)
            fsync_dir(self.directory)
        except OSError as exc:
            log.warning("delivered hint log not deleted target=%s path=%s: %s", target, hint_log.directory, exc)

    # -- reads --------------------------------------------------------------------------------------
    def targets(self) -> list[str]:
        return sorted(self._targets)

    def pending(self, target: str) -> list[Hint]:
        """The target's hints in arrival order."""
        tl = self._targets.get(target)
        return list(tl.hints.values()) if tl else []

    def holds(self, target: str, batch_id: BatchId) -> bool:
        """Whether a hint of ``batch_id`` for ``target`` is held (not yet delivered, re-split or
        dropped): what a writer asks for a target that left the placement (``HeldHints``)."""
        tl = self._targets.get(target)
        return tl is not None and batch_id in tl.hints

    @property
    def held(self) -> int:
        return sum(len(t.hints) for t in self._targets.values())

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def close(self) -> None:
        for tl in self._targets.values():
            tl.log.close()
