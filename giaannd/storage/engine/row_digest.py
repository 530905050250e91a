"""Row digests: what replicas compare to find rows that differ, without sending the rows.

Theory of operation
-------------------
Digests, all xxh3-64. ``row_digest`` hashes a row's field arrays; ``rows_digest`` has two versions
(``ROWS_DIGEST_VERSIONS``), named in the stream's verify messages (streaming/stream.py,
``StreamVerify.digest_version``), so that both ends hash the same way whatever their code:

- ``row_digest`` (anti-entropy repair, repair/plan.py / repair/wire.py): per row, a :class:`RowDigest`
  of three parts. ``keys`` hashes the key arrays and segments, ``strength`` the strengths, kept
  apart because float sums may differ in the last bit between replicas that applied the same
  batches in a different order (repair decides what such a difference means), and ``batches``
  is the number of applied batches that touched the row. ``row_digests`` computes the same two
  hashes for many rows at once, in a repair digest version (``ROW_DIGEST_VERSIONS``, named in
  the repair messages, repair/wire.py ``DigestsFor.digest_version``):

  - version 1: ``row_digest``'s xxh3-64s, one Python call per row (what nodes computed before
    version 2; kept to answer and to ask peers that know no other);
  - version 2: one compiled pass over all the rows (``_row_digests_v2``), no Python per row. A
    *lane* takes one 64-bit value x into a hash h: ``h = rotl(h ^ rotl(x * P2, 31) * P1, 27) * P1
    + P4`` (the xxh64 primes P1..P4, wrapping uint64 arithmetic). Per row of n entries, four
    chains start at n and take, entry by entry, one field each: target columns (c), target
    features (f), segments (g), the strengths' float32 bits (s). Then ``keys = A(L(L(L(K, c), f),
    g))`` and ``strength = A(L(S, s))``, L a lane, K and S the seeds ``_SEED_KEYS`` and
    ``_SEED_STRENGTH``, A the xxh64 avalanche (``h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3;
    h ^= h >> 32``). Not xxh64 itself (that hashes bytes in 32-byte stripes): a lane per field
    value is what a loop over field arrays can feed without laying the row out, and four chains
    let the multiplies of an entry overlap.
- ``rows_digest`` (stream verification, streaming/sender.py): for many rows, one hash, in the
  given order. Two stores give equal results exactly when they hold the same rows bit for bit
  (keys, strengths, segments), up to a 2**-64 collision. The rows come as one gathered batch
  (``RowEngine.gather``: field-major arrays), hashed at once, no per-row Python.

  - version 1: the row sizes in bytes (i64), then the rows in the region layout (regions.py):
    the value nodes computed before the row engine (issue 14, phase 2). Laying the rows out as
    regions is a scatter of every entry (~120 MB/s at 50 entries per row): it bounded a join.
  - version 2: the row lengths in entries (i64), then the four field arrays of the gathered
    rows as they are (segment, target column, target feature, strength): the same rows give the
    same bytes (a row's entries are contiguous in each field, rows in the given order, and the
    lengths say where each row ends), so it decides equality exactly as version 1 does, at hash
    speed (no layout pass). Used when both ends know it (the receiver's reply names the version it
    hashed; a sender answered in version 1 verifies again in version 1).

Pure functions; the store (column_store.py) exposes them as ``ColumnStore.digest`` and
``ColumnStore.rows_digest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.model.rows import Row
from giaannd.protocol import ROW_DIGEST_VERSIONS as PROTOCOL_ROW_DIGEST_VERSIONS
from giaannd.rowengine.jit import kernel, readonly
from giaannd.storage.engine.regions import ENTRY_BYTES, pack_regions

__all__ = ["ROWS_DIGEST_VERSIONS", "ROW_DIGEST_VERSIONS", "RowDigest", "fold_row_digests_v2", "row_digest",
           "row_digests", "rows_digest", "rows_digest_v2_pieces"]

#: The ``rows_digest`` versions this code computes (module docstring); the last is the newest.
ROWS_DIGEST_VERSIONS = (1, 2)
#: The ``row_digests`` (repair) versions this code computes (module docstring; the protocol's list,
#: giaannd/protocol.py); the last is the newest.
ROW_DIGEST_VERSIONS = PROTOCOL_ROW_DIGEST_VERSIONS

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_SEED_KEYS = np.uint64(0x6B657973)  # "keys"
_SEED_STRENGTH = np.uint64(0x73747265)  # "stre"
_R27, _R31, _R33, _R29, _R32 = (np.uint64(r) for r in (27, 31, 33, 29, 32))
_R37 = np.uint64(37)


@kernel("uint64(uint64, uint64)")
def _lane(h: np.uint64, x: np.uint64) -> np.uint64:
    """One 64-bit lane into ``h`` (module docstring, version 2)."""
    k = x * _P2
    k = ((k << _R31) | (k >> _R33)) * _P1
    h ^= k
    return ((h << _R27) | (h >> _R37)) * _P1 + _P4


@kernel("uint64(uint64)")
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> _R33
    h *= _P2
    h ^= h >> _R29
    h *= _P3
    h ^= h >> _R32
    return h


@kernel(f"void({readonly('int64')}, {readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}, "
        f"{readonly('uint32')}, uint64[::1], uint64[::1])")
def _row_digests_v2(offsets: NDArray[np.int64], seg: NDArray[np.uint8], tc: NDArray[np.uint64],
                    tf: NDArray[np.uint64], bits: NDArray[np.uint32], keys: NDArray[np.uint64],
                    strength: NDArray[np.uint64]) -> None:
    for r in range(offsets.shape[0] - 1):
        a, b = offsets[r], offsets[r + 1]
        n = np.uint64(b - a)
        hc = hf = hg = hs = n  # four independent chains: their multiplies overlap
        for j in range(a, b):
            hc = _lane(hc, tc[j])
            hf = _lane(hf, tf[j])
            hg = _lane(hg, np.uint64(seg[j]))
            hs = _lane(hs, np.uint64(bits[j]))
        keys[r] = _avalanche(_lane(_lane(_lane(_SEED_KEYS, hc), hf), hg))
        strength[r] = _avalanche(_lane(_SEED_STRENGTH, hs))


_SEED_FOLD = np.uint64(0x636F6C73)  # "cols"


@kernel(f"uint64({readonly('uint64')}, {readonly('uint64')}, {readonly('uint64')})")
def _fold_sum_v2(cols: NDArray[np.uint64], feats: NDArray[np.uint64], digests: NDArray[np.uint64]) -> np.uint64:
    total = np.uint64(0)
    for i in range(cols.shape[0]):
        total += _avalanche(_lane(_lane(_lane(_SEED_FOLD, cols[i]), feats[i]), digests[i]))
    return total


def fold_row_digests_v2(cols: NDArray[np.uint64], feats: NDArray[np.uint64], digests: NDArray[np.uint64]) -> int:
    """The order-free sum, mod 2**64, of each row's share of a column digest in version 2 (a
    ``ColumnInfoPage``'s, storage/replication/requests.py): per row ``A(L(L(L(C, column),
    feature), digest))`` (the lanes and avalanche of version 2 above, C the seed ``_SEED_FOLD``),
    added up in one compiled pass."""
    return int(_fold_sum_v2(np.ascontiguousarray(cols, np.uint64), np.ascontiguousarray(feats, np.uint64),
                            np.ascontiguousarray(digests, np.uint64)))


def row_digests(offsets: NDArray[np.int64], rows: Row, version: int = ROW_DIGEST_VERSIONS[-1]
                ) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The repair digests (keys, strength) of every row (row i: ``rows`` entries ``[offsets[i],
    offsets[i+1])``) in repair digest ``version`` (module docstring).

    Raises:
        ValueError: a version not in ``ROW_DIGEST_VERSIONS``.
    """
    k = int(offsets.shape[0]) - 1
    keys, strength = np.empty(k, np.uint64), np.empty(k, np.uint64)
    if version == 2:
        _row_digests_v2(np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(rows.segment),
                        np.ascontiguousarray(rows.target_column), np.ascontiguousarray(rows.target_feature),
                        np.ascontiguousarray(rows.strength).view(np.uint32), keys, strength)
        return keys, strength
    if version != 1:
        raise ValueError(f"unknown row digest version {version}")
    bounds = offsets.tolist()
    for i in range(k):  # (version 1: the per-row path of peers that know no other)
        a, b = bounds[i], bounds[i + 1]
        d = row_digest(Row(rows.segment[a:b], rows.target_column[a:b], rows.target_feature[a:b],
                           rows.strength[a:b]), 0)
        keys[i], strength[i] = d.keys, d.strength
    return keys, strength


@dataclass(frozen=True, slots=True)
class RowDigest:
    """What repair compares between replicas.

    ``keys``: xxh3_64 of the row's key arrays (order-independent of how the batches were applied);
    ``strength``: xxh3_64 of the strengths (float sums may differ in the last bit between replicas
    that applied the same batches in a different order); ``batches``: applied batches touching it.
    """

    keys: int
    strength: int
    batches: int


def row_digest(row: Row, touches: int) -> RowDigest:
    """The repair digest of one stored row (see :class:`RowDigest`): the hashes of its region's
    first 16 n bytes then last n (keys), and of the strengths in between."""
    keys = xxhash.xxh3_64(_bytes(row.target_column))
    keys.update(_bytes(row.target_feature))
    keys.update(_bytes(row.segment))
    return RowDigest(keys.intdigest(), xxhash.xxh3_64_intdigest(_bytes(row.strength)), touches)


def _bytes(values: NDArray[np.generic]) -> memoryview:
    """The array's bytes (a view when it is contiguous, as the engine's slices are)."""
    return np.ascontiguousarray(values).data.cast("B")


def rows_digest(offsets: NDArray[np.int64], rows: Row, version: int = 1) -> int:
    """One xxh3-64 over the rows (row i: ``rows`` entries ``[offsets[i], offsets[i+1])``) in digest
    ``version`` (module docstring): 1, the region sizes (i64 bytes) then the regions back to back;
    2, the row lengths (i64) then the field arrays.

    Raises:
        ValueError: a version not in ``ROWS_DIGEST_VERSIONS``.
    """
    if version == 2:
        return rows_digest_v2_pieces(np.diff(offsets),
                                     [(rows.segment, rows.target_column, rows.target_feature, rows.strength)])
    if version != 1:
        raise ValueError(f"unknown rows digest version {version}")
    h = xxhash.xxh3_64((ENTRY_BYTES * np.diff(offsets)).astype(np.int64).tobytes())
    h.update(pack_regions(offsets, rows).data)
    return h.intdigest()


def rows_digest_v2_pieces(lengths: NDArray[np.int64], pieces: Sequence[Sequence[NDArray[Any]]]) -> int:
    """``rows_digest(offsets, rows, 2)`` of rows given as consecutive pieces, each the four field
    arrays (segment, target column, target feature, strength) of some of the rows, in order
    (``RowEngine.pieces``: views of the store, no gathered copy): the same bytes hashed in the same
    order, so the same digest. ``lengths``: each row's entry count."""
    h = xxhash.xxh3_64(np.asarray(lengths).astype(np.int64).tobytes())
    for field in range(4):
        for piece in pieces:
            h.update(_bytes(piece[field]))
    return h.intdigest()
