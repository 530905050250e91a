"""WriterFloor: one writer's batch ids and the floor it sends with every write (no I/O).

Theory of operation
-------------------
A writer (one StorageClient, or one training job's client) numbers its batches ``BatchId(writer,
seq)`` with seq = 1, 2, ... (``next_batch_id``). Storage remembers which batch ids it applied
(storage/engine/applied_set.py) so that a retried batch is never applied twice; to keep that set small,
each ApplyBatch carries ``writer_floor`` = (lowest seq of this writer not yet *settled*) - 1, and
storage may forget every seq at or below it.

A seq is **unsettled** from the moment its id is handed out (the floor cannot pass it while the
caller prepares the write) until every owner of its rows acknowledged it directly
(``owner_done``), or a hinted owner later reports it applied (``confirmed``, after the client asks
``BatchesApplied``). One global floor, not one per owner, so that a retry after a placement change
can never land on a node whose floor already passed it. A write that failed and is never retried
holds the floor until ``abandon``.

A hinted owner that left the placement for good (removenode while it was down) never answers
again, and one that was removed and added again under the same name never gets the ids hinted
for it before: for those the client asks the nodes that acknowledged holding its hints
(``holders``) whether they still hold them (hint_confirm.py), and ``confirmed`` settles the seq
once none does.

Only our own writer's ids are tracked: a batch id of another writer (a hint replayed by storage,
tools) is written with floor 0 and never settles anything here.

Invariants: ``floor < min(unsettled)`` and ``floor < next_seq``; ``hinted[target]`` holds only seqs
of this writer that were handed to a hint holder for ``target`` and not yet confirmed there;
``holders[target]`` has an entry only for a seq in ``hinted[target]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from giaannd.protocol import BatchId

__all__ = ["Unsettled", "WriterFloor"]


@dataclass(eq=False)
class Unsettled:
    """Owners of one seq that have not acknowledged it directly (writer floors)."""

    pending: set[str]


class WriterFloor:
    """Batch ids, unsettled seqs and hinted seqs of writer ``writer_id`` (module docstring)."""

    def __init__(self, writer_id: int) -> None:
        self.writer_id = writer_id
        self.next_seq = 1
        self.unsettled: dict[int, Unsettled] = {}
        #: target owner -> our seqs held as hints for it, not yet confirmed applied there
        self.hinted: dict[str, set[int]] = {}
        #: target owner -> hinted seq -> the nodes that acknowledged holding that hint
        self.holders: dict[str, dict[int, set[str]]] = {}

    def next_batch_id(self) -> BatchId:
        """A fresh id of this writer, unsettled from now on."""
        bid = BatchId(self.writer_id, self.next_seq)
        self.next_seq += 1
        self.unsettled[bid.seq] = Unsettled(set())
        return bid

    @property
    def floor(self) -> int:
        """Every seq of this writer <= this is settled."""
        return min(self.unsettled, default=self.next_seq) - 1

    def is_ours(self, bid: BatchId) -> bool:
        return bid.writer == self.writer_id

    def track(self, bid: BatchId, owners: Iterable[str]) -> Unsettled:
        """The write of ``bid`` is going to ``owners``: it settles once each acknowledged."""
        state = Unsettled(set(owners))
        if self.is_ours(bid):
            self.unsettled[bid.seq] = state
        return state

    def owner_done(self, bid: BatchId, state: Unsettled, node: str) -> None:
        """``node`` holds ``bid`` (acknowledged directly, or a hint confirmed applied)."""
        state.pending.discard(node)
        if not state.pending and self.is_ours(bid) and self.unsettled.get(bid.seq) is state:
            del self.unsettled[bid.seq]

    def hinted_for(self, target: str, bid: BatchId, holder: str | None = None) -> None:
        """``bid``'s share of ``target`` is held as a hint by ``holder`` (None: by no node yet,
        a stranded share the writer keeps)."""
        if self.is_ours(bid):
            self.hinted.setdefault(target, set()).add(bid.seq)
            if holder is not None:
                self.holders.setdefault(target, {}).setdefault(bid.seq, set()).add(holder)

    def hint_holders(self, target: str, seq: int) -> frozenset[str]:
        """The nodes that acknowledged holding our hinted ``seq`` for ``target``."""
        return frozenset(self.holders.get(target, {}).get(seq, ()))

    def _forget_holders(self, target: str, seq: int) -> None:
        held = self.holders.get(target)
        if held is not None:
            held.pop(seq, None)
            if not held:
                del self.holders[target]

    def confirmed(self, target: str, seq: int) -> bool:
        """``target`` reports our hinted ``seq`` applied. False if it was not pending there (a
        concurrent confirmation settled it first): nothing changes then."""
        seqs = self.hinted.get(target)
        if seqs is None or seq not in seqs:
            return False
        seqs.discard(seq)
        self._forget_holders(target, seq)
        state = self.unsettled.get(seq)
        if state is not None:
            self.owner_done(BatchId(self.writer_id, seq), state, target)
        return True

    def abandon(self, bid: BatchId) -> None:
        """Give up on a failed write of ours: it will never be sent again (lets the floor move)."""
        if self.is_ours(bid):
            self.unsettled.pop(bid.seq, None)
            for target, seqs in self.hinted.items():
                seqs.discard(bid.seq)
                self._forget_holders(target, bid.seq)
