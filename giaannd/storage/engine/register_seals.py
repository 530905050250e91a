"""The seal file of a register store: which keys this node must not answer for while a placement
change hands them to their new owners (register_store.py, module docstring "Seals").

``registers.seals`` lies next to ``registers.log``. It is one whole-file record of the shared
record codec (``giaannd.records``, ``SEAL_RECORD``, magic ``GIRS``) whose payload is msgpack
``[[epoch, [key, ...]], ...]``, sorted; it is replaced atomically (``giaannd.atomic_file``: temp
file, fsync, rename, directory fsync) and removed, with a directory fsync, when the change ends.
A damaged file stops start-up naming it (``RegisterSealsCorrupt``): ignoring it would forget the
seals, which is what the file exists to prevent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec

from giaannd.atomic_file import atomic_write_bytes
from giaannd.errors import CorruptFileError
from giaannd.records import RecordError, RecordFormat

__all__ = ["SEALS_FILE", "SEAL_RECORD", "RegisterSealsCorrupt", "load_seals", "write_seals"]

#: The seals of a placement change in progress, next to the register log.
SEALS_FILE: Final = "registers.seals"
#: Its one record (whole file; the length is checked against the file's size, which bounds it).
SEAL_RECORD: Final = RecordFormat(
    "register seals", b"GIRS", [("version", "H"), ("reserved", "H"), ("length", "I"), ("payload_xxh3", "Q")],
    versions=(1, 1), max_payload_bytes=None)
#: The payload: [[epoch, [key, ...]], ...]
_DECODER: Final = msgspec.msgpack.Decoder(list[tuple[str, list[str]]])
_ENCODER: Final = msgspec.msgpack.Encoder()


class RegisterSealsCorrupt(CorruptFileError):
    """The seal file does not validate (names the file): start-up stops (module docstring, "Seals")."""

    reason = "corrupt_register_seals"

    def __init__(self, path: str, detail: str, *, offset: int | None = None) -> None:
        super().__init__(path, f"{detail}. It lists the register keys this node must not answer for while a "
                         "placement change hands them to their new owners, so start-up stops rather than forget "
                         "them; delete it only when no placement change is in progress (every node switched, or "
                         "the operation failed or was cancelled before any did)", offset=offset)


def write_seals(path: Path, sealed: dict[str, str]) -> None:
    """Replace the seal file ``path`` with ``sealed`` (key -> epoch), durably (atomic_file).

    Raises:
        OSError: it could not be written; the old file (if any) is left whole.
    """
    groups: dict[str, list[str]] = {}
    for key, epoch in sealed.items():
        groups.setdefault(epoch, []).append(key)
    payload = sorted((epoch, sorted(keys)) for epoch, keys in groups.items())
    atomic_write_bytes(path, SEAL_RECORD.encode(_ENCODER.encode(payload)))


def load_seals(path: Path) -> dict[str, str]:
    """The seals in the seal file ``path`` (key -> epoch; none when there is no file), after
    deleting the temporaries of a write a crash cut short (the file itself is whole: atomic_file).

    Raises:
        RegisterSealsCorrupt: the file does not validate; OSError: it cannot be read.
    """
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        groups = _DECODER.decode(SEAL_RECORD.decode_file(raw).payload)
    except RecordError as exc:
        raise RegisterSealsCorrupt(str(path), exc.detail, offset=exc.offset) from None
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise RegisterSealsCorrupt(str(path), f"undecodable seals: {exc}") from None
    return {key: epoch for epoch, keys in groups for key in keys}
