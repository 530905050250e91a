"""Replicated registers, the storage node's side: a durable CASPaxos acceptor per key.

Theory of operation
-------------------
A *register* is a small named row (a training job's row and lease table, compute/cluster_jobs/lease_table.py)
that several compute nodes update with compare-and-set. It must stay consistent with no
coordinator and survive any minority of its R owners failing, so it is replicated with CASPaxos
(D. Rystsov, "CASPaxos: Replicated State Machines without logs", 2018): single-decree Paxos
re-run for every change, the new value computed by the proposer from the latest one. The
proposer is the client (giaannd/client/registers.py, which states what a read and a CAS
guarantee); this module is the **acceptor**, one per owner of the key.

Acceptor state per key: the ballot it *promised* (it accepts nothing below it), the ballot it
last *accepted* and that value: a version ``(counter, origin round, origin proposer)`` (the
proposer's business, opaque here) and bytes. A ballot is ``(round, proposer)``, ordered
as a tuple: ``round`` grows, ``proposer`` is the client's random 64-bit id and breaks ties. The
rules (``prepare`` / ``accept``, pure, tested with tables):

* ``prepare(b)``: if ``b`` is above both the promise and the accepted ballot, promise ``b`` and
  answer the accepted ballot and value; else refuse with the highest ballot seen.
* ``accept(b, version, value)``: unless a ballot above ``b`` was promised or accepted, take
  ``(b, version, value)`` as accepted (and as the promise); else refuse with the highest ballot.
  An accept of the ballot already accepted is a retransmission: answered, nothing changes.
* ``get``: the accepted ballot and value, no promise (the client's quorum read).
* ``merge(state, copied)``: take another acceptor's state for the key (a placement change hands
  registers to their new owners: storage/rebalance/register_handoff.py, which says why this is
  safe): the higher promise and the higher accepted ballot with its value. Never backwards: the
  result's promise and accepted ballot are each at least the state's own, so every promise this
  acceptor gave is still kept and nothing it accepted is forgotten.

**Durability**: a promise or an accept is answered only once it is on disk (the service waits
for ``sync`` to cover its record, as for vocabulary puts): an acceptor that forgot a promise
after a crash could accept a lower ballot and break Paxos. One append-only log,
``registers.log``, holds a record per state change (``REGISTER_RECORD``: the shared record codec,
``giaannd.records``, magic ``GIAR``; payload msgpack ``[key, promised round, promised proposer,
accepted round, accepted proposer, counter, origin round, origin proposer, value]``); the last
record of a key is its state.
A torn tail (a change never acknowledged) is cut off at start; damage before the end stops
start-up naming the file and offset. **Compaction**: when the log is more than
``COMPACT_RATIO`` times the live states and over ``COMPACT_MIN_BYTES``, ``sync`` (a worker
thread) rewrites it as one record per key: the states as they were at the start, then the
records appended meanwhile, copied under the lock, fsync, rename over the log, directory fsync
(until that succeeds, nothing is durable). ``open`` fdatasyncs the log it replayed (a process
killed before its sync left changes in the page cache only: a retransmitted accept of one is
answered at once) and fsyncs its directory. After a failed fdatasync ("fsyncgate": the kernel may
drop the pages and report the next one a success) the next ``sync`` compacts, whatever the size:
the log is rewritten from the states. A record over the log's record limit (``_MAX_RECORD_BYTES``:
only a handoff's merge can offer one) is refused, nothing changed: it could never be read back.

**Seals** (register_handoff.py): while a placement change hands a key to its new owners, an old
owner that loses the key *seals* it: it answers nothing for the key (``sealed``) until the change
is done or abandoned. A seal is scoped to the placement epoch it was made under (under any other
epoch it counts for nothing: a restart after the switch is harmless), and it is **durable**: a
leaver that forgot its seals in a restart between the seal and the switch would answer proposers
of the old placement again, and with one stayer form an old quorum that no new quorum meets
(register_handoff.py, "Why this is safe"). ``seal`` returns once every seal is in the seal file,
``registers.seals`` next to the log (``SEAL_RECORD``: the shared record codec, magic ``GIRS``,
one whole-file record; payload msgpack ``[[epoch, [key, ...]], ...]``, sorted), replaced atomically
(``giaannd.atomic_file``: temp file, fsync, rename, directory fsync); ``unseal`` removes the file
and fsyncs the directory before it returns; ``open`` reloads it (and deletes the temporaries of a
write a crash cut short). A damaged seal file stops start-up naming the file
(``RegisterSealsCorrupt``, exit 2) rather than being ignored: ignoring it is the forgetting this
file exists to prevent, and only an operator can know that no placement change is in progress.
Seals a dead coordinator left stay (nothing expires them) until an operation reaches its
register handoff at the member again and unseals it (its last step, done or failed), or until
the operator runs ``giaannctl node registers unseal`` (rebalance/unseal.py, "After a coordinator
died": under the cluster's topology lock, refused while an operation may still need them) or,
with the node stopped and no placement change in progress, deletes the file; until then the
node refuses those keys, which costs availability, never safety.

**Large values stay on disk** (issue 15 item 1). A value of ``spill_bytes`` or more (a corpus
chunk of a cluster job: hundreds of KB, written once, read by one lease holder) is not kept in RAM:
the log already holds it, so the store keeps the offset and length of the record that wrote it
(``_Spilled``) and reads that record back on ``get``/``prepare``/``merge``, checking it with the
record codec (a damaged record raises ``RegisterLogCorrupt`` naming the file and offset; the
request core answers ``Unavailable`` and the client's quorum read uses another replica). Small
values (job rows, lease shards, the index: rewritten by every CAS) stay in RAM, where the
acceptor's rules run on them without I/O. ``accept`` needs no value (its rule reads ballots
only), so a chunk costs one read of its record per ``get``, not per change. The reads are
``pread`` of a file the node just wrote: the page cache serves most of them. Replay at start
maps the log (``mmap``) instead of reading it into RAM, so a log of many GB costs no RSS beyond
the pages being parsed. Compaction copies a spilled value from the old log into the new one and
moves the offsets; the old descriptor stays open (and its offsets valid) until the switch.

Limits: ``max_bytes`` (``storage.register-ram-bytes``, default ``MAX_REGISTER_STORE_BYTES``) of
live state kept in RAM per node, and ``max_disk_bytes`` (``storage.register-disk-bytes``) of live
spilled values; a change past either is refused with nothing changed (``RegisterStoreFull``).
Concurrency: ``prepare``/``accept``/``get`` from one thread (the event loop); ``sync`` from worker
threads (one at a time, serialised inside). State, offsets and the descriptor change only under
``_lock``, so a compaction's switch to the new file is atomic for readers. ``seal``/``unseal`` (file
I/O) run on worker threads, one at a time (``_seal_lock``); ``sealed`` reads the map from the loop.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import msgspec

from giaannd.atomic_file import fsync_dir
from giaannd.config import DEFAULT_REGISTER_DISK_BYTES, DEFAULT_REGISTER_RAM_BYTES, DEFAULT_REGISTER_SPILL_BYTES
from giaannd.errors import CorruptDataError, Refused
from giaannd.records import RecordError, RecordFormat, open_for_append
from giaannd.storage.engine.log_tail import LogTail, write_all
from giaannd.storage.engine.register_seals import SEAL_RECORD, SEALS_FILE, RegisterSealsCorrupt, load_seals, write_seals

__all__ = [
    "COMPACT_MIN_BYTES",
    "COMPACT_RATIO",
    "EMPTY",
    "MAX_REGISTER_DISK_BYTES",
    "MAX_REGISTER_STORE_BYTES",
    "SPILL_BYTES",
    "REGISTERS_FILE",
    "REGISTER_RECORD",
    "SEALS_FILE",
    "SEAL_RECORD",
    "Ballot",
    "RegisterLogCorrupt",
    "RegisterSealsCorrupt",
    "RegisterState",
    "RegisterStore",
    "RegisterStoreFull",
    "Version",
    "accept",
    "merge",
    "prepare",
]

log = logging.getLogger(__name__)

REGISTERS_FILE: Final = "registers.log"
#: ``_compact`` writes the new log as ``registers.log`` + this, then renames it over the log.
_COMPACT_SUFFIX: Final = ".compact"
#: Live register bytes kept in RAM per node (``storage.register-ram-bytes``, whose description
#: says why): keys, small values, bookkeeping. Corpus chunks are on disk.
MAX_REGISTER_STORE_BYTES: Final = DEFAULT_REGISTER_RAM_BYTES
#: Live spilled values per node (``storage.register-disk-bytes``).
MAX_REGISTER_DISK_BYTES: Final = DEFAULT_REGISTER_DISK_BYTES
#: Values this long or longer are kept on disk only (``storage.register-spill-bytes``): a corpus
#: chunk is; a job row (< 1 KB) or a lease shard (~30 B per lease) is not. A pread of a cached
#: page costs microseconds; the CAS round it serves costs milliseconds.
SPILL_BYTES: Final = DEFAULT_REGISTER_SPILL_BYTES
#: Compact when the log is this many times the live states (every CAS appends two records per
#: acceptor: the log grows with traffic, the states do not)...
COMPACT_RATIO: Final = 4
#: ...and over this size (rewriting a small log often would cost more fsyncs than it saves).
COMPACT_MIN_BYTES: Final = 4 * 2**20
#: Largest record payload read back: one state (a value is at most protocol.MAX_REGISTER_VALUE_BYTES).
_MAX_RECORD_BYTES: Final = 2 * 2**20
REGISTER_RECORD: Final = RecordFormat(
    "register log", b"GIAR", [("version", "H"), ("reserved", "H"), ("length", "I"), ("payload_xxh3", "Q")],
    versions=(1, 1), max_payload_bytes=_MAX_RECORD_BYTES)
#: Per-key bookkeeping charged against MAX_REGISTER_STORE_BYTES besides key and value.
_STATE_OVERHEAD_BYTES: Final = 64
#: ...and for a spilled value's location (``_Spilled``).
_SPILL_OVERHEAD_BYTES: Final = 48
#: Records written per ``os.write`` while compacting (bounds the RAM a rewrite holds).
_COMPACT_BATCH_BYTES: Final = 4 * 2**20

Ballot = tuple[int, int]
#: (counter, origin round, origin proposer); (0, 0, 0): never written
Version = tuple[int, int, int]
_ZERO: Final[Ballot] = (0, 0)
_Payload = tuple[str, int, int, int, int, int, int, int, bytes]
_DECODER: Final = msgspec.msgpack.Decoder(_Payload)
_ENCODER: Final = msgspec.msgpack.Encoder()


class RegisterLogCorrupt(CorruptDataError):
    """The register log is damaged before its end (names the file and offset): start-up stops."""

    reason = "corrupt_register_log"

    def __init__(self, path: str, offset: int, detail: str) -> None:
        super().__init__(f"{path}: record at offset {offset}: {detail}")
        self.file_path, self.offset = path, offset


class RegisterStoreFull(Refused):
    """The change would take the node's registers past ``MAX_REGISTER_STORE_BYTES``; nothing changed."""

    reason = "register_store_full"


@dataclass(frozen=True, slots=True)
class RegisterState:
    """One key's acceptor state (module docstring). ``version`` (0, 0, 0): never written."""

    promised: Ballot = _ZERO
    accepted: Ballot = _ZERO
    version: Version = (0, 0, 0)
    value: bytes = b""

    @property
    def top(self) -> Ballot:
        """The highest ballot this acceptor has seen."""
        return max(self.promised, self.accepted)


EMPTY: Final = RegisterState()


def prepare(state: RegisterState, ballot: Ballot) -> RegisterState | Ballot:
    """Phase 1 (module docstring): the new state, or the higher ballot that refuses ``ballot``."""
    if ballot <= state.top:
        return state.top
    return RegisterState(ballot, state.accepted, state.version, state.value)


def accept(state: RegisterState, ballot: Ballot, version: Version, value: bytes) -> RegisterState | Ballot:
    """Phase 2 (module docstring): the new state (the same one for a retransmission), or the
    higher ballot that refuses ``ballot``."""
    if ballot < state.top:
        return state.top
    if ballot == state.accepted:
        return state
    return RegisterState(ballot, ballot, version, value)


def merge(state: RegisterState, copied: RegisterState) -> RegisterState:
    """Take ``copied`` (another acceptor's state for the same key) into ``state`` (module docstring):
    the higher accepted ballot with its version and value (ties: one ballot carries one value, the
    state's own is kept), and the highest promise of the two, never below the accepted ballot."""
    src = copied if copied.accepted > state.accepted else state
    promised = max(state.promised, copied.promised, src.accepted)
    return RegisterState(promised, src.accepted, src.version, src.value)


@dataclass(frozen=True, slots=True)
class _Spilled:
    """Where a spilled value is: the record that wrote it (offset and length in the log); its
    value is the record payload's last ``length`` bytes."""

    record_offset: int
    record_bytes: int
    length: int


def _size(key: str, state: RegisterState) -> int:
    return len(key) + len(state.value) + _STATE_OVERHEAD_BYTES


def _spilled_size(key: str) -> int:
    return len(key) + _STATE_OVERHEAD_BYTES + _SPILL_OVERHEAD_BYTES


def _record(key: str, s: RegisterState) -> bytes:
    payload: _Payload = (key, *s.promised, *s.accepted, *s.version, s.value)
    return REGISTER_RECORD.encode(_ENCODER.encode(payload))


class RegisterStore:
    """One node's register acceptors (module docstring). Use :meth:`open`.

    ``_states`` holds every key's state; for a key in ``_spilled`` its ``value`` is ``b""`` and the
    real one is in the log (module docstring, "Large values stay on disk")."""

    def __init__(self, path: Path, fd: int, states: dict[str, RegisterState], spilled: dict[str, _Spilled],
                 size: int, torn_bytes: int, max_bytes: int, *, spill_bytes: int = SPILL_BYTES,
                 max_disk_bytes: int = MAX_REGISTER_DISK_BYTES, sealed: dict[str, str] | None = None) -> None:
        self.path = path
        self._fd = fd
        self._states = states
        self._spilled = spilled
        self._ram = sum(_spilled_size(k) if k in spilled else _size(k, s) for k, s in states.items())
        self._disk = sum(s.length for s in spilled.values())
        self._size = size
        self._seq = 0  # changes appended by this process
        self._durable = 0
        self._lock = threading.Lock()  # the descriptor, size, seq, states and spilled offsets
        self._sync_lock = threading.Lock()  # one sync or compaction at a time
        #: a compaction renamed its file over the log but the directory fsync failed: no change is
        #: durable until one succeeds (a crash could bring the old file back). Under ``_sync_lock``.
        self._rename_unsynced = False
        #: an fdatasync failed: the pages it dropped may be gone though the next one succeeds
        #: ("fsyncgate"), so the next sync compacts (rewrites the log from the states). Under ``_sync_lock``.
        self._sync_failed = False
        self.max_bytes = max_bytes
        self.max_disk_bytes = max_disk_bytes
        self.spill_bytes = spill_bytes
        #: a failed append's bytes past ``_size`` (giaannd/storage/engine/log_tail.py). Under ``_lock``.
        self._tail = LogTail()
        #: bytes cut off the end at open (a torn last record)
        self.torn_bytes = torn_bytes
        #: log rewrites done (tests, metrics)
        self.compactions = 0
        #: key -> placement epoch it was sealed under (module docstring, "Seals"), as in the seal file
        self._sealed: dict[str, str] = dict(sealed or {})
        self._seals_path = path.with_name(SEALS_FILE)
        self._seals_written = True  # the seal file holds ``_sealed`` (False after a failed write)
        self._seal_lock = threading.Lock()  # one seal or unseal (and its file write) at a time

    @classmethod
    def open(cls, directory: str | os.PathLike[str], max_bytes: int = MAX_REGISTER_STORE_BYTES, *,
             spill_bytes: int = SPILL_BYTES, max_disk_bytes: int = MAX_REGISTER_DISK_BYTES) -> RegisterStore:
        """Replay ``directory/registers.log`` (created if missing); a torn tail is cut off and reported.
        Reload the seals of ``directory/registers.seals`` (module docstring, "Seals").

        Raises:
            RegisterLogCorrupt: a bad record before the end.
            RegisterSealsCorrupt: the seal file does not validate.
        """
        d = Path(directory)
        new_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        sealed = load_seals(d / SEALS_FILE)
        path = d / REGISTERS_FILE
        states: dict[str, RegisterState] = {}
        spilled: dict[str, _Spilled] = {}
        end = total = 0
        if path.exists() and (total := path.stat().st_size) > 0:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                end, bad = _replay(path, data, states, spilled, spill_bytes)
            if bad is not None:  # raised once the map is closed (a traceback would pin views into it)
                raise bad
        # a compaction a crash cut short left its file (the log is whole: the rename is the switch):
        # a copy of every live state, spilled values too, which nothing else would delete before
        # the next compaction overwrites it
        path.with_name(path.name + _COMPACT_SUFFIX).unlink(missing_ok=True)
        fd = open_for_append(path, end, "register log")
        try:
            _sync_inherited(fd, d, new_dir)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, states, spilled, end, total - end, max_bytes, spill_bytes=spill_bytes,
                   max_disk_bytes=max_disk_bytes, sealed=sealed)

    # -- the acceptor ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._states)

    def get(self, key: str) -> RegisterState:
        """``key``'s state, its value read back from the log when it is spilled.

        Raises:
            RegisterLogCorrupt: the record holding the value is damaged; OSError: it cannot be read.
        """
        with self._lock:
            state = self._states.get(key, EMPTY)
            where = self._spilled.get(key)
            if where is None:
                return state
            raw = os.pread(self._fd, where.record_bytes, where.record_offset)
        return replace(state, value=_read_value(self.path, key, raw, where))

    def prepare(self, key: str, ballot: Ballot) -> tuple[RegisterState | Ballot, int]:
        """``prepare`` on ``key``'s state; a change is appended. Returns (result, seq to sync; 0: none).

        Raises:
            RegisterStoreFull, OSError, RegisterLogCorrupt: nothing changed.
        """
        result = prepare(self.get(key), ballot)
        return result, self._put(key, result) if isinstance(result, RegisterState) else 0

    def accept(self, key: str, ballot: Ballot, version: Version, value: bytes) -> tuple[RegisterState | Ballot, int]:
        """``accept`` on ``key``'s state; a change is appended. Returns (result, seq to sync; 0: none).
        The rule reads ballots only, so a spilled value is not read back.

        Raises:
            RegisterStoreFull, OSError: nothing changed.
        """
        old = self._states.get(key, EMPTY)
        result = accept(old, ballot, version, value)
        if isinstance(result, RegisterState) and result is old:
            return result, self._seq  # a retransmission: answer once what is already written is durable
        return result, self._put(key, result) if isinstance(result, RegisterState) else 0

    def merge(self, key: str, copied: RegisterState) -> tuple[RegisterState, int]:
        """``merge`` ``copied`` into ``key``'s state; a change is appended. Returns (state, seq to
        sync: the last change, which may be an earlier one when nothing changed).

        Raises:
            RegisterStoreFull, OSError, RegisterLogCorrupt: nothing changed.
        """
        old = self.get(key)
        result = merge(old, copied)
        if result == old:
            return old, self._seq
        return result, self._put(key, result)

    def keys(self) -> list[str]:
        """Every key, sorted (a copy)."""
        with self._lock:
            return sorted(self._states)

    def items(self) -> list[tuple[str, RegisterState]]:
        """Every key's state, sorted by key, spilled values read back: all of them in RAM at once
        (tests, small stores; the handoff pages with ``keys`` and ``get``)."""
        return [(key, self.get(key)) for key in self.keys()]

    @property
    def ram_bytes(self) -> int:
        """Live bytes held in RAM (what ``max_bytes`` bounds)."""
        return self._ram

    @property
    def disk_bytes(self) -> int:
        """Live spilled value bytes (what ``max_disk_bytes`` bounds)."""
        return self._disk

    # -- seals (module docstring) ------------------------------------------------------------------
    def seal(self, keys: list[str], epoch: str) -> None:
        """Answer nothing for ``keys`` while the node's placement epoch is ``epoch``; durable when
        this returns (the seal file replaced). Blocking I/O (two fsyncs): call it from a worker thread.

        Raises:
            OSError: the seal file could not be written. The keys stay sealed in memory (refusing is
                always safe); the caller must not report them sealed (a restart would forget them).
        """
        with self._seal_lock:
            if self._seals_written and all(self._sealed.get(k) == epoch for k in keys):
                return  # nothing new (a retried export): the file already says so
            self._sealed.update(dict.fromkeys(keys, epoch))
            self._seals_written = False
            write_seals(self._seals_path, self._sealed)
            self._seals_written = True

    def sealed(self, key: str, epoch: str) -> bool:
        """Whether ``key`` was sealed under ``epoch`` (the node's placement epoch now)."""
        return self._sealed.get(key) == epoch

    def unseal(self) -> int:
        """Drop every seal (the placement change finished or was abandoned), durably: the seal
        file is removed and the directory fsynced first. Returns how many. Blocking I/O.

        Raises:
            OSError: the file could not be removed (or the removal made durable); the seals stay.
        """
        with self._seal_lock:
            self._remove_seals_file()
            n = len(self._sealed)
            self._sealed.clear()
            self._seals_written = True
            return n

    def _remove_seals_file(self) -> None:
        try:
            self._seals_path.unlink()
        except FileNotFoundError:
            pass
        else:
            fsync_dir(self._seals_path.parent)

    def unseal_key(self, key: str) -> bool:
        """Drop ``key``'s seal alone, durably (the seal file rewritten, or removed with the last
        seal). Whether it was sealed. Blocking I/O (rebalance/unseal.py ``unseal_left``: the
        topology lock's own register, which the lock needs before anything else is unsealed).

        Raises:
            OSError: the file could not be rewritten or removed; the seal stays.
        """
        with self._seal_lock:
            if key not in self._sealed:
                return False
            rest = {k: e for k, e in self._sealed.items() if k != key}
            self._seals_written = False
            if rest:
                write_seals(self._seals_path, rest)
            else:
                self._remove_seals_file()
            del self._sealed[key]
            self._seals_written = True
            return True

    def _put(self, key: str, state: RegisterState) -> int:
        spill = len(state.value) >= self.spill_bytes
        record = _record(key, state)
        if len(record) - REGISTER_RECORD.header_bytes > _MAX_RECORD_BYTES:
            # only a merge can get here (a RegisterImport's states are not bounded by the protocol's
            # value and key limits): a record over the limit would refuse every read and stop start-up
            raise RegisterStoreFull(f"a state of {len(record)} bytes for {key[:64]!r} is over the "
                                    f"{_MAX_RECORD_BYTES}-byte register record limit")
        with self._lock:
            old = self._states.get(key)
            was = self._spilled.get(key)
            ram = self._ram + (_spilled_size(key) if spill else _size(key, state))
            if was is not None:
                ram -= _spilled_size(key)
            elif old is not None:
                ram -= _size(key, old)
            disk = self._disk + (len(state.value) if spill else 0) - (was.length if was is not None else 0)
            if ram > self.max_bytes:
                raise RegisterStoreFull(f"registers would hold {ram} bytes in RAM, over the "
                                        f"{self.max_bytes}-byte limit (storage.register-ram-bytes)")
            if disk > self.max_disk_bytes:
                raise RegisterStoreFull(f"registers would hold {disk} value bytes on disk, over the "
                                        f"{self.max_disk_bytes}-byte limit (storage.register-disk-bytes)")
            self._tail.append(self._fd, self._size, record)  # whole or not at all (log_tail.py)
            if spill:
                self._spilled[key] = _Spilled(self._size, len(record), len(state.value))
                self._states[key] = replace(state, value=b"")
            else:
                self._spilled.pop(key, None)
                self._states[key] = state
            self._size += len(record)
            self._seq += 1
            self._ram, self._disk = ram, disk
            return self._seq

    # -- durability --------------------------------------------------------------------------------
    @property
    def durable_seq(self) -> int:
        """Changes known to be on disk (every change whose seq is <= it)."""
        return self._durable

    @property
    def nbytes(self) -> int:
        """Bytes of the log."""
        return self._size

    def sync(self) -> int:
        """fdatasync (or compact, module docstring); returns the seq now durable. Worker threads;
        one sync at a time (a compaction replaces the descriptor), and a sync that finds its
        changes already durable (another sync covered them: group commit) returns at once."""
        with self._sync_lock:
            with self._lock:
                target, size = self._seq, self._size
                if self._durable >= target:
                    return self._durable
                big = size > max(COMPACT_MIN_BYTES, COMPACT_RATIO * (self._ram + self._disk))
                big = big or self._sync_failed
                snapshot = (dict(self._states), dict(self._spilled), self._fd) if big else None
            if snapshot is not None:
                return self._compact(*snapshot, size)
            try:
                os.fdatasync(self._fd)
            except OSError:
                self._sync_failed = True
                raise
            if self._rename_unsynced:  # (_compact)
                fsync_dir(self.path.parent)
                self._rename_unsynced = False
            with self._lock:
                self._durable = max(self._durable, target)
                return self._durable

    def _compact(self, states: dict[str, RegisterState], spilled: dict[str, _Spilled], old_fd: int,
                 size: int) -> int:
        """Rewrite the log: ``states`` (as they were when the log was ``size`` bytes; a spilled
        value copied from ``old_fd``, which stays open and append-only meanwhile), then the records
        appended since, copied under the lock; the spilled offsets move with them. Returns the seq
        now durable."""
        tmp = self.path.with_name(self.path.name + _COMPACT_SUFFIX)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        moved: dict[str, _Spilled] = {}
        try:
            offset = 0
            batch: list[bytes] = []
            pending = 0
            for key, state in states.items():
                where = spilled.get(key)
                if where is None:
                    rec = _record(key, state)
                else:  # the record as written: its bytes are already the state with its value
                    rec = os.pread(old_fd, where.record_bytes, where.record_offset)
                    moved[key] = _Spilled(offset, len(rec), where.length)
                batch.append(rec)
                offset += len(rec)
                pending += len(rec)
                if pending >= _COMPACT_BATCH_BYTES:
                    write_all(fd, b"".join(batch))
                    batch, pending = [], 0
            write_all(fd, b"".join(batch))
            with self._lock:
                write_all(fd, os.pread(self._fd, self._size - size, size))
                os.fsync(fd)
                os.replace(tmp, self.path)
                # from here the log *is* the new file: switch to it before anything else can fail
                old, self._fd = self._fd, fd
                self._tail = LogTail()  # (a partial record of the old file was not copied)
                self._rename_unsynced = True
                self._size = os.lseek(fd, 0, os.SEEK_END)
                shift = offset - size  # records appended since the snapshot moved by this much
                self._spilled = {key: moved[key] if where.record_offset < size else
                                 _Spilled(where.record_offset + shift, where.record_bytes, where.length)
                                 for key, where in self._spilled.items()}
                seq = self._seq
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(old)
        fsync_dir(self.path.parent)  # the rename is durable: so is every change up to seq
        self._rename_unsynced = self._sync_failed = False
        with self._lock:
            self._durable = max(self._durable, seq)
            self.compactions += 1
        log.info("register log compacted file=%s bytes=%d keys=%d", self.path, self._size, len(states))
        return self._durable

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _sync_inherited(fd: int, directory: Path, new_dir: bool) -> None:
    """Make what ``open`` starts from durable (vocab_store.py's twin): a process killed between an
    append and its sync left those changes in the page cache only, and a retransmitted accept of
    one (or a merge that changes nothing) is answered at once (seq 0); a log or directory just
    created is not on disk until the directory holding its entry is fsynced."""
    os.fdatasync(fd)
    fsync_dir(directory)
    if new_dir:
        fsync_dir(directory.parent)


def _replay(path: Path, data: mmap.mmap, states: dict[str, RegisterState], spilled: dict[str, _Spilled],
            spill_bytes: int) -> tuple[int, RegisterLogCorrupt | None]:
    """Read every record of the log mapped at ``data`` into ``states``/``spilled`` (the last record
    of a key is its state). Returns the offset past the last good record and, for a bad record
    before the end, the error to raise (not raised here: the map must close first)."""
    end = 0
    try:
        for rec in REGISTER_RECORD.scan(data, torn_tail=True):  # type: ignore[arg-type]  # mmap: a buffer
            try:
                key, pr, pp, ar, ap, vc, vr, vp, value = _DECODER.decode(rec.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                detail = f"undecodable record: {exc}"
                return end, RegisterLogCorrupt(str(path), rec.header.offset, detail)
            finally:
                rec.payload.release()  # the map closes after the scan: no view may outlive it
            h = rec.header
            if len(value) >= spill_bytes:
                spilled[key] = _Spilled(h.offset, h.end - h.offset, len(value))
                value = b""
            else:
                spilled.pop(key, None)
            states[key] = RegisterState((pr, pp), (ar, ap), (vc, vr, vp), value)
            end = h.end
    except RecordError as exc:
        return end, RegisterLogCorrupt(str(path), exc.offset, exc.explanation)
    return end, None


def _read_value(path: Path, key: str, raw: bytes, where: _Spilled) -> bytes:
    """The value of the record ``raw`` read back at ``where``, checked (module docstring).

    Raises:
        RegisterLogCorrupt: a short read, a bad record, or a record of another key.
    """
    try:
        rec = REGISTER_RECORD.decode_at(raw)
        payload: _Payload = _DECODER.decode(rec.payload)
        got, value = payload[0], payload[-1]
    except RecordError as exc:
        detail = f"spilled value of {key!r}: {exc.explanation}"
        raise RegisterLogCorrupt(str(path), where.record_offset, detail) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RegisterLogCorrupt(str(path), where.record_offset, f"spilled value of {key!r}: {exc}") from None
    if got != key or len(value) != where.length:
        raise RegisterLogCorrupt(str(path), where.record_offset, f"spilled value of {key!r}: the record "
                                 f"there is of {got!r} ({len(value)} bytes)")
    return value

