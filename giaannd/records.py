"""One framed-record codec for every checksummed file giaannd writes.

Theory of operation
-------------------
Eight on-disk formats share one shape: a fixed little-endian header that opens with a magic and a
version, gives the payload's length (a field, or derived from counts in the header), carries the
xxh3-64 of the payload and, in all but the job journal, ends with the xxh3-64 of every header byte
before it; then the payload. The formats differ only in field widths and extra fields, so a
:class:`RecordFormat` *describes* a layout instead of each module packing its own:

    ==============  =========  =====================================================================
    format          magic      header fields after the magic (struct codes)
    ==============  =========  =====================================================================
    update log      GIAL       version H, kind H, length Q, seq Q, payload_xxh3 Q, header_xxh3 Q
    vocab log       GIAV       version H, reserved H, length I, payload_xxh3 Q, header_xxh3 Q
    job journal     GJNL       version H, length I, payload_xxh3 Q (no header checksum)
    register log    GIAR       version H, reserved H, length I, payload_xxh3 Q, header_xxh3 Q
    register seals  GIRS       version H, reserved H, length I, payload_xxh3 Q, header_xxh3 Q
    store snapshot  GIAANNSN   version I, flags I, last_seq Q, rows Q, entries Q, length Q,
                               payload_xxh3 Q, header_xxh3 Q
    row export      GIAROWS\\0  version I, reserved I, rows Q, entries Q, payload_xxh3 Q,
                               header_xxh3 Q (length derived: 24 rows + 8 + 21 entries)
    compute state   GICS       version H, reserved H, length Q, payload_xxh3 Q, header_xxh3 Q
    ==============  =========  =====================================================================

The byte layouts are exactly the ones each format had before this module existed (docs/storage.md,
docs/replication.md, docs/compute.md, docs/model.md; tests/unit/test_records_compat.py holds golden
files written by the older code); the compute state (giaannd/compute/state.py) was framed only from
its version 3, and its bare versions 1 and 2 still load.

**Decoding** a record at an offset checks, in this order, and raises :class:`RecordError` carrying
the record's byte offset and a stable reason token at the first failure:

    short_header      fewer bytes left than a header
    bad_magic         the magic differs
    header_checksum   the header's own checksum fails (a damaged length is never trusted)
    version           a version this code does not read
    oversize          a length over the format's limit (checked before anything is allocated)
    truncated         the payload runs past the end of the data
    payload_checksum  the payload's checksum fails
    trailing_bytes    (whole-file formats) bytes after the one record

**Scanning** a segment of back-to-back records tells a *torn tail* from *corruption* with one rule:
a failure of the first five kinds above except ``version`` and ``oversize`` (those come from a
header whose checksum holds, which a cut-short write cannot produce) is a torn tail when the caller
allows one and no intact header (magic and header checksum) starts anywhere after the failing
record's first byte: the scan then ends quietly and the caller cuts the file at the last good
record. Anything else is corruption and raises, with the offset of the next intact header when
there is one (records after the damage would otherwise be lost silently). A torn tail can only hold
writes that were never acknowledged (acks wait for fsync), including a zero-filled extent left by a
crash behind a record whose header made it to disk.

Pure: bytes in, records or errors out; no I/O, no logging. Payload checksums are one xxh3 call over
a memoryview (no copy, no per-entry work).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import xxhash

from giaannd.errors import CorruptDataError

__all__ = [
    "TEARABLE",
    "open_for_append",
    "Reason",
    "Record",
    "RecordError",
    "RecordFormat",
    "RecordHeader",
]

Buffer = bytes | bytearray | memoryview
Reason = Literal["short_header", "bad_magic", "header_checksum", "version", "oversize", "truncated",
                 "payload_checksum", "trailing_bytes"]
#: Failures a write cut short by a crash can leave at the end of a segment (module docstring).
TEARABLE: Final[frozenset[str]] = frozenset(
    {"short_header", "bad_magic", "header_checksum", "truncated", "payload_checksum"})
_CODES: Final = "BHIQ"  # unsigned little-endian integers; the header checksum is a trailing Q


class RecordError(CorruptDataError):
    """A record failed a check. Formats translate it into their own error (CorruptLogError, ...).

    Attributes:
        offset: byte offset of the record's first byte in the data it was decoded from.
        reason: a stable token (module docstring), fit for a metrics label.
        detail: what failed, in words.
        next_record: offset of the next intact header after the damage (``scan`` only), or None.
    """

    reason = "corrupt_record"

    def __init__(self, offset: int, reason: Reason, detail: str) -> None:
        super().__init__(f"at byte offset {offset}: {detail}", reason=reason)
        self.offset, self.detail = offset, detail
        self.next_record: int | None = None

    @property
    def explanation(self) -> str:
        """``detail``, plus where intact records resume when some follow the damage."""
        if self.next_record is None:
            return self.detail
        return f"{self.detail}; an intact record header follows at offset {self.next_record}"


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded header: where the record is, its version, payload size and checksum, and every
    named field (``fields["kind"]``, ``fields["seq"]``, ...)."""

    offset: int
    header_bytes: int
    version: int
    payload_bytes: int
    payload_xxh3: int
    fields: Mapping[str, int]

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_bytes

    @property
    def end(self) -> int:
        """Offset just past the payload: where the next record starts."""
        return self.offset + self.header_bytes + self.payload_bytes


@dataclass(frozen=True, slots=True)
class Record:
    """A checked record: its header and its payload (a view into the decoded data, not a copy)."""

    header: RecordHeader
    payload: memoryview


class RecordFormat:
    """The header layout of one format (module docstring).

    Args:
        name: the format's name in messages ("log" reads "unsupported log format version 3").
        magic: the first bytes of every record.
        fields: the header fields after the magic, in file order, as (name, struct code) with codes
            from ``BHIQ``. Must include ``version`` and ``payload_xxh3``, and ``length`` unless
            ``payload_bytes`` derives the length. Other names are the format's own (zero when not
            given to :meth:`pack_header`).
        versions: (oldest, newest) version read; the newest is what :meth:`pack_header` writes by
            default.
        max_payload_bytes: largest length accepted, checked before the payload is touched; None for
            whole-file formats whose length is checked against the file size instead.
        header_checksum: the header ends with the xxh3-64 of every byte before it.
        payload_bytes: computes the payload length from the header fields, for a format without a
            ``length`` field.
    """

    def __init__(self, name: str, magic: bytes, fields: Sequence[tuple[str, str]], *,
                 versions: tuple[int, int], max_payload_bytes: int | None,
                 header_checksum: bool = True,
                 payload_bytes: Callable[[Mapping[str, int]], int] | None = None) -> None:
        names = [n for n, _ in fields]
        if len(set(names)) != len(names) or any(c not in _CODES or len(c) != 1 for _, c in fields):
            raise ValueError("record fields need unique names and one code each from BHIQ")
        if "version" not in names or "payload_xxh3" not in names:
            raise ValueError("a record format needs version and payload_xxh3 fields")
        if ("length" in names) == (payload_bytes is not None):
            raise ValueError("give the payload length either as a length field or as payload_bytes")
        if not 0 <= versions[0] <= versions[1]:
            raise ValueError("versions must be (oldest, newest)")
        self.name, self.magic, self.versions = name, magic, versions
        self.max_payload_bytes = max_payload_bytes
        self.header_checksum = header_checksum
        self._names = tuple(names)
        self._derive = payload_bytes
        self._fields = struct.Struct("<" + f"{len(magic)}s" + "".join(c for _, c in fields))
        #: bytes of the header, its checksum included
        self.header_bytes = self._fields.size + (8 if header_checksum else 0)
        self._index = {n: i + 1 for i, n in enumerate(names)}  # position in unpacked values
        self._settable = frozenset(names) - {"length", "payload_xxh3"}
        self._at_version, self._at_payload_xxh3 = names.index("version"), names.index("payload_xxh3")
        self._at_length = names.index("length") if payload_bytes is None else -1

    # -- writing ---------------------------------------------------------------------------------
    def pack_header(self, *, payload_bytes: int, payload_xxh3: int, **fields: int) -> bytes:
        """The header of a record whose payload is ``payload_bytes`` long with checksum
        ``payload_xxh3``; ``version`` defaults to the newest, other fields to 0.

        Raises:
            ValueError: an unknown field, or (derived lengths) fields that do not give this length.
        """
        if not self._settable.issuperset(fields):
            raise ValueError(f"{self.name} header: cannot set {sorted(set(fields) - self._settable)}")
        # A list by position, not a dict: this runs once per appended log record.
        values = [fields.get(n, 0) for n in self._names]
        values[self._at_version] = fields.get("version", self.versions[1])
        values[self._at_payload_xxh3] = payload_xxh3
        if self._derive is None:
            values[self._at_length] = payload_bytes
        elif (derived := self._derive(dict(zip(self._names, values)))) != payload_bytes:
            raise ValueError(f"{self.name} header fields give {derived} payload bytes, not {payload_bytes}")
        head = self._fields.pack(self.magic, *values)
        if self.header_checksum:
            head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
        return head

    def header_for(self, payload: Sequence[Buffer], **fields: int) -> bytes:
        """The header of a record whose payload is the concatenation of ``payload`` (hashed part by
        part: the parts are never joined)."""
        h = xxhash.xxh3_64()
        length = 0
        for part in payload:
            h.update(part)
            length += part.nbytes if isinstance(part, memoryview) else len(part)
        return self.pack_header(payload_bytes=length, payload_xxh3=h.intdigest(), **fields)

    def encode(self, payload: Buffer, **fields: int) -> bytes:
        """A whole record (header + payload) as one bytes object, for small records."""
        return self.header_for([payload], **fields) + bytes(payload)

    # -- reading ---------------------------------------------------------------------------------
    def read_header(self, data: Buffer, offset: int = 0) -> RecordHeader:
        """Decode and check the header at ``offset`` (the payload is not looked at).

        Raises:
            RecordError: short_header, bad_magic, header_checksum, version or oversize.
        """
        view = memoryview(data)
        left = view.nbytes - offset
        if left < self.header_bytes:
            raise RecordError(offset, "short_header",
                              f"{left} bytes, less than a {self.header_bytes}-byte {self.name} header")
        values = self._fields.unpack_from(view, offset)
        if values[0] != self.magic:
            raise RecordError(offset, "bad_magic", f"bad magic {values[0]!r}: not a {self.name} record")
        if self.header_checksum:
            (want,) = struct.unpack_from("<Q", view, offset + self._fields.size)
            if want != xxhash.xxh3_64_intdigest(view[offset : offset + self._fields.size]):
                raise RecordError(offset, "header_checksum", f"{self.name} header checksum mismatch")
        named = {n: int(values[i]) for n, i in self._index.items()}
        version = named["version"]
        if not self.versions[0] <= version <= self.versions[1]:
            raise RecordError(offset, "version", f"unsupported {self.name} format version {version}")
        length = named["length"] if self._derive is None else self._derive(named)
        if self.max_payload_bytes is not None and length > self.max_payload_bytes:
            raise RecordError(offset, "oversize",
                              f"{self.name} payload of {length} bytes over the {self.max_payload_bytes}-byte limit")
        return RecordHeader(offset, self.header_bytes, version, length, named["payload_xxh3"], named)

    def check_extent(self, header: RecordHeader, size: int) -> None:
        """Check that a whole-file record ends exactly at ``size`` (streamed readers).

        Raises:
            RecordError: truncated or trailing_bytes.
        """
        if header.end > size:
            raise RecordError(header.offset, "truncated",
                              f"{self.name} record of {header.end - header.offset} bytes runs past the end "
                              f"({size - header.offset} bytes there)")
        if header.end < size:
            raise RecordError(header.offset, "trailing_bytes",
                              f"{size - header.end} bytes after the {self.name} record")

    def check_payload(self, header: RecordHeader, payload_xxh3: int) -> None:
        """Compare a payload checksum computed by a streamed reader with the header's.

        Raises:
            RecordError: payload_checksum.
        """
        if payload_xxh3 != header.payload_xxh3:
            raise RecordError(header.offset, "payload_checksum", f"{self.name} payload checksum mismatch")

    def decode_at(self, data: Buffer, offset: int = 0) -> Record:
        """The checked record at ``offset`` (its payload a view into ``data``).

        Raises:
            RecordError: any check of the module docstring but trailing_bytes.
        """
        header = self.read_header(data, offset)
        view = memoryview(data)
        if header.end > view.nbytes:
            raise RecordError(offset, "truncated",
                              f"{self.name} record of {header.end - offset} bytes runs past the end of the "
                              f"data ({view.nbytes - offset} bytes there)")
        payload = view[header.payload_offset : header.end]
        self.check_payload(header, xxhash.xxh3_64_intdigest(payload))
        return Record(header, payload)

    def decode_file(self, data: Buffer) -> Record:
        """The one record a whole-file format holds (it must span ``data`` exactly).

        Raises:
            RecordError: any check of the module docstring.
        """
        record = self.decode_at(data, 0)
        self.check_extent(record.header, memoryview(data).nbytes)
        return record

    def next_header(self, data: Buffer, start: int) -> int:
        """Offset of the first intact header (magic, and header checksum where the format has one)
        at or after ``start``; -1 when there is none. This is how a scan resynchronises."""
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)  # ``find``; only damage is searched, so this copy costs nothing that matters
        i = data.find(self.magic, start)
        while i != -1 and i + self.header_bytes <= len(data):
            if not self.header_checksum:
                return i
            split = i + self._fields.size
            if struct.unpack_from("<Q", data, split)[0] == xxhash.xxh3_64_intdigest(data[i:split]):
                return i
            i = data.find(self.magic, i + 1)
        return -1

    def scan(self, data: Buffer, *, torn_tail: bool, start: int = 0) -> Iterator[Record]:
        """The records back to back from ``start`` to the end of ``data``.

        Ends quietly at a torn tail when ``torn_tail`` allows one (the caller cuts the file at the
        last yielded record's ``end``, or ``start``); raises at corruption (module docstring).

        Raises:
            RecordError: with ``next_record`` set when intact records follow the damage.
        """
        off = start
        while off < len(data):
            try:
                record = self.decode_at(data, off)
            except RecordError as exc:
                after = self.next_header(data, off + 1)
                if torn_tail and exc.reason in TEARABLE and after < 0:
                    return
                exc.next_record = after if after >= 0 else None
                raise
            yield record
            off = record.header.end


def open_for_append(path: str | os.PathLike[str], good_bytes: int, what: str) -> int:
    """Open a record log for appending after a scan found ``good_bytes`` intact: a torn tail
    beyond them (a write a crash cut short) is logged, truncated and fsynced first, so the next
    record starts on a record boundary. Returns the file descriptor, positioned at the end."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    torn = os.fstat(fd).st_size - good_bytes
    if torn > 0:
        logging.getLogger(__name__).warning("%s torn tail cut file=%s offset=%d bytes=%d",
                                            what, os.fspath(path), good_bytes, torn)
        os.ftruncate(fd, good_bytes)
        os.fsync(fd)
    os.lseek(fd, good_bytes, os.SEEK_SET)
    return fd
