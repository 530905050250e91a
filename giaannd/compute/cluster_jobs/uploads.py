"""A cluster job's upload that survives its node: the upload row and who may adopt it (sans-IO).

Theory of operation
-------------------
Before its job row exists a cluster job is its corpus being streamed into chunk registers by the
node that received ``train start`` (cluster_train.py, corpus_chunks.py). So that a job never stays
``uploading`` when that node dies, the upload is itself a register row, ``job/<id>/upload``
(``UploadRow``), listed in ``uploads`` (``UploadIndex``, the unfinished uploads):

- the uploader creates the row (CAS on an absent register) and lists it before the first chunk,
  then renews it every ``renew_s`` with the windows written so far (``beats`` + 1). A renewal that
  finds the row no longer its own (adopted, cancelled) stops the upload;
- once the job row is written the row becomes ``done`` and leaves the index;
- every node's watcher reads the index each probe interval and, for a row still ``uploading``
  whose ``beats`` it has seen unchanged for ``lease_s`` of its own time (the lease expiry rule of
  leases.py: no synchronised clocks needed), *adopts* it by CAS (``node`` = itself, ``beats`` + 1,
  ``adoptions`` + 1): one adopter wins. The adopter then **finishes** the upload if it can read
  the same corpus file (same path inside its own ``compute.corpus-dir``: a shared corpus
  directory), re-streaming it from the start (chunk writes are idempotent: a chunk already
  holding the same bytes counts as written; the chunking is a function of the file and K), or,
  if it cannot, marks the row ``failed`` with the reason and drops it from the index;
- a job whose row was written but whose upload row was left ``uploading`` (the uploader died in
  between) is simply marked ``done`` by its adopter.

So an upload ends ``done`` or ``failed`` within about ``lease_s`` + one probe interval of its
uploader's death, as long as one compute node with ``compute.cluster-jobs`` is up. A corpus file
that changed between the two reads makes a chunk differ: the adopter's upload fails with
``ChunkMissing`` ("already holds other bytes") and the row says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from giaannd.errors import CorruptDataError

__all__ = [
    "MAX_UPLOADS",
    "UPLOADS_KEY",
    "UploadIndex",
    "UploadRow",
    "UploadWatch",
    "decode_upload",
    "decode_uploads",
    "encode",
    "upload_key",
]

#: The register listing unfinished uploads.
UPLOADS_KEY: Final = "uploads"
#: Unfinished uploads listed at once: the same bound as unfinished jobs (lease_table.MAX_ACTIVE_JOBS),
#: so the index stays one small register.
MAX_UPLOADS: Final = 64

UploadState = Literal["uploading", "done", "failed"]


class UploadRow(msgspec.Struct, frozen=True, tag="upload"):
    """``job/<id>/upload`` (module docstring). ``path``: the corpus file as the uploader resolved
    it; ``name``: what the job document shows."""

    job_id: str
    node: str
    path: str
    name: str
    k: int
    text: bool
    limit: int | None = None
    started: float = 0.0
    beats: int = 0
    windows: int = 0
    adoptions: int = 0
    state: UploadState = "uploading"
    error: str = ""
    #: windows per uploaded chunk (corpus_chunks.py; 1: an uploader that knew no groups)
    group: int = 1


class UploadIndex(msgspec.Struct, frozen=True, tag="uploads"):
    jobs: tuple[str, ...] = ()


_ROW: Final = msgspec.msgpack.Decoder(UploadRow)
_INDEX: Final = msgspec.msgpack.Decoder(UploadIndex)
_ENC: Final = msgspec.msgpack.Encoder()


def upload_key(job_id: str) -> str:
    return f"job/{job_id}/upload"


def encode(row: UploadRow | UploadIndex) -> bytes:
    return _ENC.encode(row)


def decode_upload(data: bytes) -> UploadRow:
    try:
        return _ROW.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptDataError(f"upload row: {exc}") from None


def decode_uploads(data: bytes) -> UploadIndex:
    if not data:
        return UploadIndex()
    try:
        return _INDEX.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptDataError(f"upload index: {exc}") from None


@dataclass
class UploadWatch:
    """Which uploads this node may adopt: ``beats`` seen unchanged for ``lease_s`` of its own time."""

    lease_s: float
    _seen: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # job -> (node, beats, since)

    def expired(self, now: float, row: UploadRow) -> bool:
        """Feed a row read at ``now``; True when it is ``uploading`` and stale."""
        if row.state != "uploading":
            self._seen.pop(row.job_id, None)
            return False
        mark = (row.node, row.beats)
        seen = self._seen.get(row.job_id)
        if seen is None or seen[:2] != mark:
            self._seen[row.job_id] = (*mark, now)
            return False
        return now - seen[2] >= self.lease_s

    def forget(self, keep: set[str]) -> None:
        """Drop what is known of uploads no longer listed."""
        for job in [j for j in self._seen if j not in keep]:
            del self._seen[job]
