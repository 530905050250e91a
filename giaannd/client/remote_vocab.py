"""The replicated vocabulary as the StorageClient reads and writes it (``put_vocab`` / ``get_vocab``).

Theory of operation
-------------------
Vocabulary entries (``(kind, id, text)``: kind 0 column, 1 feature; the id is the 64-bit hash of
the text) are owned like columns, by the id, and stored by storage/engine/vocab_store.py.

**Put**: each entry goes to every live owner of its id (``PutVocab``, chunked by
``MAX_VOCAB_ENTRIES``), and the put succeeds once each entry has W durable acks. There are no
hints: a replica that missed an entry is covered by the lookup, which asks the next owner for any
id the first did not hold. Entries are content-checked by storage; a ``VocabConflict`` reply is a
real 64-bit hash collision and raises ``RemoteVocabConflict`` (not retryable; nothing changed).
An entry whose text is over ``MAX_VOCAB_TEXT_CHARS`` (the model bounds no word: a long token or
noun run) is refused by every storage node, and with it the whole request it is in, so it is left
out (logged): the rest is stored and a training job goes on; other nodes print its id in hex and a
cluster export names it missing (before, every entry of the window failed, and the job with it).

**Get**: each key goes first to its first live owner (owners believed down last); round k asks the
k-th candidate for every key not found yet. An id no answering owner holds is left out of the
result; ``ReadFailed`` only when every owner of some id failed (none answered). A reply with an
entry not asked for, or a text that is not its id's, counts as its node's failure
(``ProtocolViolation``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.errors import REQUEST_FAILURES, ReadFailed, RemoteVocabConflict, VocabWriteFailed
from giaannd.client.node_call import NodeCall
from giaannd.client.writes import write_quorum
from giaannd.cluster.view import ClusterView
from giaannd.model.ids import column_id, feature_id
from giaannd.unique import unique

__all__ = ["get_vocab", "put_vocab"]

log = logging.getLogger(__name__)


async def put_vocab(topology: ClusterView, call: NodeCall, quorum_setting: int | None,
                    entries: Sequence[tuple[int, int, str]]) -> int:
    """``StorageClient.put_vocab`` (its docstring); ``quorum_setting``: the configured W or None.
    Entries over ``MAX_VOCAB_TEXT_CHARS`` are left out (module docstring); returns the number sent."""
    if any(len(e[2]) > p.MAX_VOCAB_TEXT_CHARS for e in entries):
        over = [e for e in entries if len(e[2]) > p.MAX_VOCAB_TEXT_CHARS]
        log.warning("vocabulary: %d entries over %d characters are not stored (no storage node accepts "
                    "them), first kind=%d id=%#x length=%d", len(over), p.MAX_VOCAB_TEXT_CHARS,
                    over[0][0], over[0][1], len(over[0][2]))
        entries = [e for e in entries if len(e[2]) <= p.MAX_VOCAB_TEXT_CHARS]
    if not entries:
        return 0
    placement = topology.placement
    names, r = placement.names, placement.effective_replicas
    quorum = write_quorum(quorum_setting, r)
    ids = np.fromiter((e[1] for e in entries), np.uint64, len(entries))
    owners = placement.owner_indices(ids)
    jobs: list[tuple[str, NDArray[np.intp]]] = []
    failures: dict[str, str] = {}
    for m in unique(owners):
        node = names[int(m)]
        idx = np.flatnonzero((owners == m).any(axis=1))
        if not topology.is_live(node):
            failures[node] = "down"
            continue
        for start in range(0, idx.size, p.MAX_VOCAB_ENTRIES):
            jobs.append((node, idx[start : start + p.MAX_VOCAB_ENTRIES]))
    outcomes = await asyncio.gather(
        *(call(node, p.PutVocab([entries[i] for i in idx.tolist()])) for node, idx in jobs),
        return_exceptions=True)
    acks = np.zeros(len(entries), np.int64)
    for (node, idx), out in zip(jobs, outcomes):
        if isinstance(out, RemoteVocabConflict):
            raise out
        if isinstance(out, tuple) and isinstance(out[0], p.VocabAck):
            acks[idx] += 1
        elif isinstance(out, REQUEST_FAILURES) or isinstance(out, tuple):
            failures[node] = str(out) or type(out).__name__
        elif isinstance(out, BaseException):
            raise out
    if int(acks.min()) < quorum:
        detail = "; ".join(f"{n}: {e}" for n, e in sorted(failures.items()))
        raise VocabWriteFailed(f"{int((acks < quorum).sum())} vocabulary entries got fewer than "
                               f"{quorum} acks ({detail})")
    return len(entries)


async def get_vocab(topology: ClusterView, call: NodeCall,
                    keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """``StorageClient.get_vocab`` (its docstring; module docstring for how)."""
    if not keys:
        return {}
    placement = topology.placement
    names = placement.names
    kinds = [int(k) for k, _ in keys]
    ids = np.fromiter((i for _, i in keys), np.uint64, len(keys))
    owners = placement.owner_indices(ids)
    r = owners.shape[1]
    down, _ = topology.masks()
    rank = down[owners] * r + np.arange(r)[None, :]
    cand = np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)
    todo = np.ones(len(keys), bool)
    answered = np.zeros(len(keys), bool)
    found: dict[tuple[int, int], str] = {}
    errors: dict[str, str] = {}
    for k in range(r):
        if not todo.any():
            break
        jobs: list[tuple[str, NDArray[np.intp]]] = []
        for m in unique(cand[todo, k]):
            idx = np.flatnonzero(todo & (cand[:, k] == m))
            for start in range(0, idx.size, p.MAX_VOCAB_ENTRIES):
                jobs.append((names[int(m)], idx[start : start + p.MAX_VOCAB_ENTRIES]))
        outcomes = await asyncio.gather(
            *(call(node, p.GetVocab([kinds[i] for i in idx.tolist()],
                                    [int(ids[i]) for i in idx.tolist()])) for node, idx in jobs),
            return_exceptions=True)
        for (node, idx), out in zip(jobs, outcomes):
            if isinstance(out, tuple) and isinstance(out[0], p.VocabReply):
                try:
                    entries = _checked_entries(out[0], {(kinds[i], int(ids[i])) for i in idx.tolist()})
                except p.ProtocolViolation as exc:  # that node's failure: its keys go to the next owner
                    errors[node] = str(exc)
                    continue
                answered[idx] = True
                found.update(entries)
            elif isinstance(out, REQUEST_FAILURES) or isinstance(out, tuple):
                errors[node] = str(out) or type(out).__name__
            elif isinstance(out, BaseException):
                raise out
        todo &= np.array([(kd, int(i)) not in found for kd, i in zip(kinds, ids.tolist())])
    if (todo & ~answered).any():
        detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
        raise ReadFailed(f"{int((todo & ~answered).sum())} vocabulary ids unreadable on every owner ({detail})")
    return found


def _checked_entries(reply: p.VocabReply, asked: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """A ``VocabReply``'s entries, each one asked for and its text hashing to its id (ids are
    content-addressed, giaannd/model/ids.py; a storage node stores no other).

    Raises:
        ProtocolViolation: an entry not asked for, or whose text is not its id's.
    """
    entries: dict[tuple[int, int], str] = {}
    for kind, ident, text in reply.entries:
        if (kind, ident) not in asked:
            raise p.ProtocolViolation(f"VocabReply holds kind {kind} id {ident:#018x}, not asked for")
        if (column_id(text) if kind == 0 else feature_id(text)) != ident:
            raise p.ProtocolViolation(f"VocabReply: text {text!r} is not that of kind {kind} id {ident:#018x}")
        entries[(kind, ident)] = text
    return entries
