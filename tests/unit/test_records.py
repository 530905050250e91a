"""The shared record codec (giaannd/records.py): layouts, every check and its reason token, scans."""

from __future__ import annotations

import struct

import pytest
import xxhash

from giaannd.compute.job_journal import JOURNAL_RECORD
from giaannd.model.export import EXPORT_RECORD
from giaannd.records import RecordError, RecordFormat
from giaannd.storage.engine.snapshot import SNAPSHOT_RECORD
from giaannd.storage.engine.update_log import LOG_RECORD
from giaannd.storage.engine.vocab_store import VOCAB_RECORD

# A small format of the update log's shape, with a low payload limit for the oversize check.
SMALL = RecordFormat("small", b"SMAL", [("version", "H"), ("kind", "H"), ("length", "I"), ("payload_xxh3", "Q")],
                     versions=(1, 2), max_payload_bytes=64)


@pytest.mark.parametrize(("fmt", "header_bytes", "fields"), [
    (LOG_RECORD, 40, {"version": 1, "kind": 3, "seq": 9}),
    (VOCAB_RECORD, 28, {}),
    (JOURNAL_RECORD, 18, {}),
    (SNAPSHOT_RECORD, 64, {"last_seq": 5, "rows": 0, "entries": 0}),
])
def test_records_layouts_round_trip(fmt: RecordFormat, header_bytes: int, fields: dict[str, int]) -> None:
    payload = bytes(range(7)) * 3
    data = fmt.encode(payload, **fields)
    assert fmt.header_bytes == header_bytes and len(data) == header_bytes + len(payload)
    assert data.startswith(fmt.magic)
    rec = fmt.decode_file(data)
    assert bytes(rec.payload) == payload and rec.header.payload_bytes == len(payload)
    assert rec.header.payload_xxh3 == xxhash.xxh3_64_intdigest(payload)
    assert rec.header.version == fields.get("version", fmt.versions[1])
    for name, value in fields.items():
        assert rec.header.fields[name] == value


def test_records_layout_bytes_are_the_documented_ones() -> None:
    """Spot-check field positions against docs/storage.md and docs/replication.md."""
    log = LOG_RECORD.encode(b"xy", version=2, kind=3, seq=0x0102)
    assert struct.unpack_from("<4sHHQQQ", log) == (b"GIAL", 2, 3, 2, 0x0102, xxhash.xxh3_64_intdigest(b"xy"))
    assert struct.unpack_from("<Q", log, 32)[0] == xxhash.xxh3_64_intdigest(log[:32])
    vocab = VOCAB_RECORD.encode(b"abc")
    assert struct.unpack_from("<4sHHIQ", vocab) == (b"GIAV", 1, 0, 3, xxhash.xxh3_64_intdigest(b"abc"))
    assert struct.unpack_from("<Q", vocab, 20)[0] == xxhash.xxh3_64_intdigest(vocab[:20])
    journal = JOURNAL_RECORD.encode(b"doc")
    assert journal == struct.pack("<4sHIQ", b"GJNL", 1, 3, xxhash.xxh3_64_intdigest(b"doc")) + b"doc"


def test_records_derived_length_export_header() -> None:
    rows, entries = 2, 3
    payload = bytes(24 * rows + 8 + 21 * entries)
    head = EXPORT_RECORD.header_for([payload], rows=rows, entries=entries)
    assert len(head) == 48 and head[:8] == b"GIAROWS\0"
    rec = EXPORT_RECORD.decode_file(head + payload)
    assert rec.header.payload_bytes == len(payload) and rec.header.fields["rows"] == rows
    with pytest.raises(ValueError, match="payload bytes"):  # counts that disagree with the payload
        EXPORT_RECORD.header_for([payload + b"x"], rows=rows, entries=entries)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"length": 3}, "cannot set"),
    ({"colour": 1}, "cannot set"),
])
def test_records_pack_header_refuses_fields_it_owns_or_does_not_know(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SMALL.pack_header(payload_bytes=0, payload_xxh3=0, **kwargs)


@pytest.mark.parametrize(("fields", "kwargs"), [
    ([("length", "Q"), ("payload_xxh3", "Q")], {}),                       # no version
    ([("version", "H"), ("length", "Q")], {}),                            # no payload checksum
    ([("version", "H"), ("payload_xxh3", "Q")], {}),                      # no length at all
    ([("version", "H"), ("length", "Q"), ("payload_xxh3", "Q")], {"payload_bytes": lambda f: 0}),  # two
    ([("version", "H"), ("version", "H"), ("length", "Q"), ("payload_xxh3", "Q")], {}),  # duplicate
    ([("version", "h"), ("length", "Q"), ("payload_xxh3", "Q")], {}),     # signed code
])
def test_records_format_definition_errors(fields: list[tuple[str, str]], kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RecordFormat("bad", b"BAD!", fields, versions=(1, 1), max_payload_bytes=None, **kwargs)  # type: ignore[arg-type]


def _damaged(what: str) -> tuple[bytes, str]:
    good = SMALL.encode(b"payload!", kind=1)
    raw = bytearray(good)
    if what == "short":
        return bytes(raw[:10]), "short_header"
    if what == "magic":
        raw[0] ^= 1
        return bytes(raw), "bad_magic"
    if what == "header":
        raw[9] ^= 1  # inside the length: the header checksum catches it before the length is used
        return bytes(raw), "header_checksum"
    if what == "future":
        return SMALL.encode(b"payload!", version=3, kind=1), "version"
    if what == "ancient":
        return SMALL.encode(b"payload!", version=0, kind=1), "version"
    if what == "oversize":
        return SMALL.encode(bytes(65)), "oversize"
    if what == "cut":
        return bytes(raw[:-1]), "truncated"
    if what == "payload":
        raw[-1] ^= 0x80
        return bytes(raw), "payload_checksum"
    if what == "trailing":
        return good + b"\0", "trailing_bytes"
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["short", "magic", "header", "future", "ancient", "oversize", "cut", "payload",
                                  "trailing"])
def test_records_decode_file_reason_tokens(what: str) -> None:
    data, reason = _damaged(what)
    with pytest.raises(RecordError) as err:
        SMALL.decode_file(data)
    assert err.value.reason == reason and err.value.offset == 0
    assert "at byte offset 0" in str(err.value)


def test_records_decode_at_offset_reports_that_offset() -> None:
    one = SMALL.encode(b"first", kind=1)
    data = one + SMALL.encode(b"second", kind=2)[:-2]
    assert bytes(SMALL.decode_at(data, 0).payload) == b"first"
    with pytest.raises(RecordError) as err:
        SMALL.decode_at(data, len(one))
    assert err.value.offset == len(one) and err.value.reason == "truncated"


def test_records_version_message_names_the_format() -> None:
    with pytest.raises(RecordError, match="unsupported log format version 3"):
        LOG_RECORD.decode_at(LOG_RECORD.encode(b"", version=3, kind=1, seq=1))


def _segment(n: int) -> tuple[bytes, list[int]]:
    data, ends = b"", []
    for i in range(n):
        data += SMALL.encode(bytes([i]) * (i + 1), kind=i)
        ends.append(len(data))
    return data, ends


def test_records_scan_clean_segment() -> None:
    data, ends = _segment(4)
    recs = list(SMALL.scan(data, torn_tail=False))
    assert [r.header.end for r in recs] == ends
    assert [bytes(r.payload) for r in recs] == [bytes([i]) * (i + 1) for i in range(4)]
    assert list(SMALL.scan(b"", torn_tail=False)) == []


@pytest.mark.parametrize("cut", range(1, 30))
def test_records_scan_every_cut_of_the_last_record_is_torn(cut: int) -> None:
    data, ends = _segment(3)
    data = data[: ends[-1] - cut]
    recs = list(SMALL.scan(data, torn_tail=True))
    good = recs[-1].header.end if recs else 0
    assert good == max(e for e in [0, *ends] if e <= len(data))
    if len(data) > good:  # not at a boundary: the same cut in a non-final segment is corruption
        with pytest.raises(RecordError) as err:
            list(SMALL.scan(data, torn_tail=False))
        assert err.value.offset == good and err.value.next_record is None


@pytest.mark.parametrize(("where", "torn"), [
    ("payload of the last", True),       # nothing after it: a torn write
    ("header of the last", True),
    ("payload of the first", False),     # intact records after it: corruption, with where they resume
    ("header of the first", False),
    ("zero tail", True),                 # zero-filled extent after the records
    ("garbage after a bad payload", True),
])
def test_records_scan_torn_or_corrupt(where: str, torn: bool) -> None:
    data, ends = _segment(3)
    raw = bytearray(data)
    if where == "payload of the last":
        raw[-1] ^= 1
    elif where == "header of the last":
        raw[ends[1] + 5] ^= 1
    elif where == "payload of the first":
        raw[ends[0] - 1] ^= 1
    elif where == "header of the first":
        raw[6] ^= 1
    elif where == "zero tail":
        raw += bytes(100)
    else:
        raw[-1] ^= 1
        raw += b"\xff" * 50
    if torn:
        recs = list(SMALL.scan(bytes(raw), torn_tail=True))
        assert len(recs) in (2, 3) and all(bytes(r.payload) == bytes(data[r.header.payload_offset:r.header.end])
                                           for r in recs)
    else:
        with pytest.raises(RecordError) as err:
            list(SMALL.scan(bytes(raw), torn_tail=True))
        assert err.value.offset == 0 and err.value.next_record == ends[0]
        assert f"intact record header follows at offset {ends[0]}" in err.value.explanation


def test_records_scan_valid_header_with_refused_version_is_corruption_even_at_the_end() -> None:
    data, ends = _segment(2)
    data += SMALL.encode(b"new", version=3, kind=0)
    with pytest.raises(RecordError) as err:
        list(SMALL.scan(data, torn_tail=True))
    assert err.value.reason == "version" and err.value.offset == ends[-1]


def test_records_next_header_resyncs_past_false_magics() -> None:
    data, ends = _segment(2)
    noise = b"SMAL" + bytes(30) + b"SMA"  # a magic with a bad header checksum, then a partial magic
    assert SMALL.next_header(noise + data, 1) == len(noise)
    assert SMALL.next_header(noise + data, len(noise) + 1) == len(noise) + ends[0]
    assert SMALL.next_header(data, ends[-1] - 1) == -1
    # no header checksum (the journal): any magic followed by a whole header counts
    assert JOURNAL_RECORD.next_header(b"..GJNL" + bytes(18), 0) == 2
    assert JOURNAL_RECORD.next_header(b"..GJNL" + bytes(3), 0) == -1
