"""What a compute node keeps between restarts: vocabulary, delimiter flags, keys it wrote.

The id → string tables are replicated in storage (storage/engine/vocab_store.py, docs/replication.md);
the compute node keeps:

* the :class:`~giaannd.model.vocab.Vocabulary`: what its jobs learned plus what it fetched from
  storage (the local cache of the replicated table),
* the deterministic flags (fixed at first sighting; prompts are encoded with them),
* the probabilistic flags it last saw (storage's flag row is the source of truth; this is a cache),
* the row keys it wrote (informational: export scans storage, ``StorageClient.scan_all``).

It is one msgpack file written atomically (temp file, fsync, rename, fsync of the directory), so a
crash leaves the previous version or the new one, never a torn file. A second compute node does not
need it: it resolves words through storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
from numpy.typing import NDArray

from giaannd.atomic_file import atomic_write_bytes
from giaannd.errors import CorruptDataError
from giaannd.model.vocab import Vocabulary

__all__ = ["STATE_FILE", "ComputeState", "StateFileError"]

STATE_FILE: Final = "compute-state.msgpack"
_VERSION: Final = 1


class StateFileError(CorruptDataError, ValueError):
    """The state file is corrupt or of another version (the message names the file)."""

    reason = "corrupt_compute_state"


class _Doc(msgspec.Struct, frozen=True):
    version: int
    columns: list[tuple[int, str]]
    features: list[tuple[int, str]]
    deterministic: list[tuple[int, bool]]
    probabilistic: list[int]
    row_column: list[int]
    row_feature: list[int]


class ComputeState:
    """The node's vocabulary, flags and written keys (module docstring)."""

    def __init__(self) -> None:
        self.vocab = Vocabulary()
        self.deterministic: dict[int, bool] = {}
        self.probabilistic: set[int] = set()
        self.row_column: NDArray[np.uint64] = np.empty(0, np.uint64)
        self.row_feature: NDArray[np.uint64] = np.empty(0, np.uint64)

    def add_keys(self, row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64]) -> None:
        """Union the written keys with more (kept sorted and unique)."""
        cols = np.concatenate([self.row_column, np.asarray(row_column, np.uint64)])
        feats = np.concatenate([self.row_feature, np.asarray(row_feature, np.uint64)])
        order = np.lexsort((feats, cols))
        cols, feats = cols[order], feats[order]
        new = np.ones(cols.shape[0], bool)
        new[1:] = (cols[1:] != cols[:-1]) | (feats[1:] != feats[:-1])
        self.row_column, self.row_feature = cols[new], feats[new]

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write atomically to ``directory/STATE_FILE``; returns the path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        doc = _Doc(_VERSION, list(self.vocab.columns()), list(self.vocab.features()),
                   sorted(self.deterministic.items()), sorted(self.probabilistic),
                   self.row_column.tolist(), self.row_feature.tolist())
        path = d / STATE_FILE
        atomic_write_bytes(path, msgspec.msgpack.encode(doc))
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ComputeState:
        """Read ``directory/STATE_FILE``; a missing file gives an empty state.

        Raises:
            StateFileError: unreadable, corrupt or another version.
        """
        path = Path(directory) / STATE_FILE
        state = cls()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return state
        try:
            doc = msgspec.msgpack.decode(raw, type=_Doc)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise StateFileError(f"{path}: corrupt compute state ({exc})") from None
        if doc.version != _VERSION:
            raise StateFileError(f"{path}: compute state version {doc.version}, expected {_VERSION}")
        if len(doc.row_column) != len(doc.row_feature):
            raise StateFileError(f"{path}: written-key arrays differ in length")
        vocab = Vocabulary()
        try:
            for cid, lemma in doc.columns:
                if vocab.add_column(lemma) != cid:
                    raise StateFileError(f"{path}: column {lemma!r} does not hash to {cid:#x}")
            for fid, word in doc.features:
                if vocab.add_feature(word) != fid:
                    raise StateFileError(f"{path}: feature {word!r} does not hash to {fid:#x}")
        except OverflowError:
            raise StateFileError(f"{path}: id out of range") from None
        state.vocab = vocab
        state.deterministic = dict(doc.deterministic)
        state.probabilistic = set(doc.probabilistic)
        try:
            state.row_column = np.array(doc.row_column, np.uint64)
            state.row_feature = np.array(doc.row_feature, np.uint64)
        except OverflowError:
            raise StateFileError(f"{path}: row key out of range") from None
        return state
