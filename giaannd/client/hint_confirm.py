"""Hint confirmation: which of a writer's hinted seqs may settle (writes.py, ``confirm_hints``).

Theory of operation
-------------------
A seq hinted for a target settles (writer_floor.py, ``confirmed``) when the target, live and in
the placement, reports the batch applied (``BatchesApplied``), or when no node that acknowledged
holding its hint holds it any more (``HeldHints``).

**Why the holders can tell.** A hint leaves its holder only once its rows are durable where they
are served: delivered to the target while it owned them (a decommission delivers the hints held
for its sources before their streams close), re-split to the rows' current owners, the target's
part last (storage/replication/hint_delivery.py: the target then has the id), or dropped by the
cutover of the operation that removed the target, once its streams copied the rows to their new
owners from replicas that had them (or, on a holder the cutover did not reach, once that holder's
ring marks the target removed and the target is not live: hint_delivery.py, "A target removed for
good"; a stranded share sent again as a hint after its target left ends that way too). So the seq
settles once no holder holds it. While one does (the operation has not reached its cutover yet,
or the hint is not delivered yet) it stays unsettled: a floor past it would make the node the hint
then reaches ignore it. A seq that no node acknowledged holding (a stranded share), or whose holder
is down or does not answer (a node that predates ``HeldHints`` answers ``BadRequest``), is not
settled this way.

**When the holders are asked.** Only for a target that left the placement (a removenode while it
was down): it is never live again, and before, its seqs held the floor for the client's lifetime
(every storage node then kept every later id of this writer). Not for a live target that reports
a seq *not* applied: a holder that lost its hint log (its disk replaced, the node wiped and joined
again) answers "not held" for hints it never delivered, and the seq would settle while the live
target lacks its rows (its applied set counts ids below the floor as applied, so repair would not
send them). Known gap: a target removed and added again under the same name before the writer
asked never gets those ids (the removal dropped the hints; the join's streams carry rows, not
batch ids), so they hold the floor until the writer goes
(tests/unit/storage_service/test_hint_rejoined_target.py, a strict xfail).

All I/O goes through the ``call`` the writer passes (its ``_call``); this module holds the policy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from giaannd import protocol as p
from giaannd.client.errors import REQUEST_FAILURES
from giaannd.client.node_call import NodeCall
from giaannd.client.writer_floor import WriterFloor
from giaannd.cluster.view import ClusterView

__all__ = ["confirm_target"]


async def confirm_target(topology: ClusterView, floors: WriterFloor, call: NodeCall, target: str,
                         stranded: Mapping[str, Collection[int]]) -> int:
    """Settle what can be settled of our seqs hinted for ``target`` (module docstring);
    ``stranded``: target -> seqs whose share the writer keeps (no holder; read again after each
    reply, as the writer may strand more meanwhile). Returns how many settled."""
    if _left_placement(topology, target):
        return await _confirm_by_holders(topology, floors, call, target, stranded)
    if topology.is_live(target):
        return await _confirm_on_target(floors, call, target)
    return 0


def _left_placement(topology: ClusterView, target: str) -> bool:
    try:
        return target not in topology.placement.names
    except LookupError:
        return False  # (no placement known: nothing can be told)


async def _confirm_on_target(floors: WriterFloor, call: NodeCall, target: str) -> int:
    """Ask ``target`` which of our seqs hinted for it it applied (``BatchesApplied``); returns how
    many settled."""
    confirmed = 0
    # (another confirm_hints, e.g. the one ``write`` starts in the background, may settle
    # and remove this target's seqs while this one waits for a reply)
    seqs = sorted(floors.hinted.get(target, ()))
    for i in range(0, len(seqs), p.MAX_QUERY_SEQS):
        chunk = seqs[i : i + p.MAX_QUERY_SEQS]
        try:
            reply, _ = await call(target, p.BatchesApplied(floors.writer_id, chunk))
        except REQUEST_FAILURES:
            break
        if not isinstance(reply, p.AppliedMask) or len(reply.applied) != len(chunk):
            break
        for seq, ok in zip(chunk, reply.applied):
            if ok and floors.confirmed(target, seq):
                confirmed += 1
    return confirmed


async def _confirm_by_holders(topology: ClusterView, floors: WriterFloor, call: NodeCall, target: str,
                              stranded: Mapping[str, Collection[int]]) -> int:
    """Settle those of our seqs hinted for ``target`` that none of their holders holds any more
    (module docstring). A seq with a stranded share, with no known holder, or with a holder that
    is down or does not answer stays as it is."""
    pending = floors.hinted.get(target, set())
    asked = {seq: floors.hint_holders(target, seq) for seq in sorted(pending)
             if seq not in stranded.get(target, ())}
    asked = {seq: holders for seq, holders in asked.items() if holders}
    by_holder: dict[str, list[int]] = {}
    for seq, holders in asked.items():
        for holder in holders:
            by_holder.setdefault(holder, []).append(seq)
    still: set[int] = set()  # held, or not known to be gone
    for holder, held_seqs in sorted(by_holder.items()):
        still.update(await _held_at(topology, floors, call, holder, target, held_seqs))
    confirmed = 0
    for seq, holders in asked.items():
        # (a hint made while the holders were asked, e.g. a retry's, is asked about next round)
        if (seq not in still and floors.hint_holders(target, seq) == holders
                and seq not in stranded.get(target, ()) and floors.confirmed(target, seq)):
            confirmed += 1
    return confirmed


async def _held_at(topology: ClusterView, floors: WriterFloor, call: NodeCall, holder: str, target: str,
                   seqs: list[int]) -> set[int]:
    """The ``seqs`` that ``holder`` may still hold as hints for ``target``: those it says it
    holds, and all it did not answer for (down, failed, or a node that predates ``HeldHints``)."""
    if not topology.is_live(holder):
        return set(seqs)
    held: set[int] = set()
    for i in range(0, len(seqs), p.MAX_QUERY_SEQS):
        chunk = seqs[i : i + p.MAX_QUERY_SEQS]
        try:
            reply, _ = await call(holder, p.HeldHints(target, floors.writer_id, chunk))
        except REQUEST_FAILURES:
            return held | set(seqs[i:])
        if not isinstance(reply, p.HeldMask) or len(reply.held) != len(chunk):
            return held | set(seqs[i:])
        held.update(seq for seq, h in zip(chunk, reply.held) if h)
    return held
