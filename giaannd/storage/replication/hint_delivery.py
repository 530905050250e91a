"""Hint delivery: paced for a member that came up, re-split when the placement moved on.

Theory of operation
-------------------
``HintDelivery.deliver_to(target)`` sends the hints held for ``target`` (hints.py) in order, each
as an ordinary ``ApplyBatch`` under its original batch id and with the placement epoch its writer
split it with (``Hint.epoch``; the holder's current epoch for old hints without one), and forgets
each one the target acknowledged as durable. The first failure pauses delivery (the service
retries on the next ``came_up`` event or retry tick). Two refinements, and one exception:

**Pacing** (ramp.py, issue 8 "a rejoining node is not flooded"). When a member comes up
(``came_up``) it gets a ``HintPacer``: a token bucket whose byte rate grows over ``ramp_s``. Each
hint waits for its bytes before it is sent, so a node back from a long outage is not hit with all
its hints at once while it also takes new writes and its first reads. Pacing only delays: every
hint is still delivered, in order; after ``ramp_s`` delivery is unpaced. A target that was never
seen going down (its failure went unnoticed) has no pacer: nothing to protect it from.

**Re-split after a placement change** (docs/topology.md, hints vs cutover). A hint was the
target's share under the placement of its write. If the placement changed before delivery, the
target may no longer own some rows and refuses the whole batch with ``NotOwner``. Dropping the
hint would lose the write on the rows' new owners (when the target was the source that streamed
them, it never had this write to forward); keeping it forever never delivers it. So:

1. Split the rows by the current placement (``split_by_owner``): rows the target still owns stay
   with it; every other row goes to each of its current owners, under the **same batch id** and
   the current epoch. A node applies only the columns of a batch id it has not applied yet
   (applied_set.py, "Which columns"): an owner that got those rows directly ignores them, so
   nothing is applied twice; a new owner that never saw them applies them, even when it applied
   another share of the same batch (its own rows under the old placement).
2. Send the moved parts, then the target's remaining part (an empty one when it kept no row: it
   records the batch id on the target, whose ``BatchesApplied`` answer is what settles the hinted
   seq in the writer's floor, writer_floor.py). Any failure keeps the hint; the next attempt
   repeats the parts (ignored where already applied, per column). The hint is forgotten only once
   every part was acknowledged as durable: never dropped.

There is no "did the target apply this id?" shortcut any more: the target may hold another share
of the batch (a writer's retry, another holder's re-split), which says nothing about this hint's
rows; sending the parts again costs bytes, never a double count.

**A target removed for good** (``drop_removed``). The cutover of the operation that removed a
member drops the hints every *live* node holds for it (rebalance/operations.py): its streams copied
the rows from old owners that had every acknowledged write (W direct acks, never counting a hint),
or got it by a hint delivered before the switch. A holder that was down then, or that the drop did
not reach, kept those hints for good: delivery only tries live targets, so they took hint space
(enough of them and the holder refuses new hints) and held the writer's floor (it settles a
removed target's seq once no holder holds it). Such a holder drops them itself once *its* ring
marks the target removed (a tombstone is committed only by the cutover, after the streams) and
the target is not live: on the ring change, and on each delivery round (so also after a restart,
and for a hint made after the cutover, e.g. a writer's stranded share sent again). Not while the
service starts: until membership has heard of a removed target that still runs, it looks down. A hint is never
the only copy of an acknowledged write: W owners other than its target acknowledged it directly.
A removed target that *is* live (decommissioned, still running as standby) keeps its hints: it
may have been the source of its columns' streams without this write (the holder was down when
the decommission delivered the hints for its sources), so they are delivered, and re-split to the
rows' current owners when it refuses them (above). Re-splitting a dead target's hint instead
would apply it twice on a new owner whose rows came from a source that had applied it (the stream
carries rows, not batch ids).

A new owner that received the rows by a stream *chunk* copied from a source that had applied the
batch (possible when the losing owner was down during the stream) holds them without the batch id;
since Dec 2 the chunk names the batch (streaming/dedupe.py, "Chunks"), so the re-split part's rows
in that stream's columns are dropped there. Before, they were applied again: counted twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from giaannd.client.storage_client import RemoteNotOwner, StorageClient, StorageRequestError
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch
from giaannd.ramp import HintPacer
from giaannd.storage.replication.hints import Hint, HintStore
from giaannd.unique import unique
from peers.errors import PeersError
from peers.placement import Placement
from peers.retry import RetryPolicy

__all__ = ["DEFAULT_HINT_RAMP_START_BYTES_PER_S", "HINT_DELIVERY_TIMEOUT_S", "HINT_DRAIN_RETRY", "HintDelivery",
           "HintSplit", "split_by_owner"]

log = logging.getLogger(__name__)

#: Budget of one hint delivery request.
HINT_DELIVERY_TIMEOUT_S: Final = 10.0
#: Waits between rounds of a caller that delivers hints again until none are held (repair, a
#: topology cutover), each bounded by its own deadline: full jitter under 50 ms at first, growing to
#: 200 ms while deliveries keep failing (peers/retry.py).
HINT_DRAIN_RETRY: Final = RetryPolicy(0.05, 0.2)
#: Hint bytes per second to a member at the start of its ramp (ramp.py: ×16 at its end): a few
#: MiB/s is far below what one node applies, so its own writes and reads keep the priority.
DEFAULT_HINT_RAMP_START_BYTES_PER_S: Final = 4.0 * 2**20

_FAILURES: Final = (StorageRequestError, PeersError, OSError, KeyError, LookupError)


@dataclass(frozen=True)
class HintSplit:
    """A hint's rows by current owner: ``kept`` (still the target's; None when empty) and
    ``moved`` (node -> the rows it owns among those the target lost)."""

    kept: RowBatch | None
    moved: dict[str, RowBatch] = field(default_factory=dict)


def split_by_owner(placement: Placement, target: str, batch: RowBatch) -> HintSplit:
    """Split a hint for ``target`` by ``placement`` (module docstring, step 2). Pure."""
    names = placement.names
    owners = placement.owner_indices(batch.row_column)  # (rows, R)
    me = names.index(target) if target in names else -1
    kept_mask = (owners == me).any(axis=1)
    kept = batch.select_rows(kept_mask) if kept_mask.any() else None
    lost = ~kept_mask
    moved: dict[str, RowBatch] = {}
    for m in unique(owners[lost]).tolist():
        if m == me:
            continue
        mask = lost & (owners == m).any(axis=1)
        moved[names[m]] = batch.select_rows(mask)
    return HintSplit(kept, moved)


class HintDelivery:
    """Delivers a node's held hints (module docstring).

    Args:
        hints: the node's hint store.
        client: the storage client to send with.
        topology: the node's cluster view.
        ramp_s: pacing ramp after a member comes up (0: unpaced).
        start_bytes_per_s: pacing rate at the start of the ramp.
        on_delivered: told once per hint delivered (the service's counter).
        clock: the loop's clock by default (pacing waits with ``asyncio.sleep``).
    """

    def __init__(self, hints: HintStore, client: StorageClient, topology: ClusterView, *,
                 ramp_s: float = 0.0, start_bytes_per_s: float = DEFAULT_HINT_RAMP_START_BYTES_PER_S,
                 on_delivered: Callable[[], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.hints, self.client, self.topology = hints, client, topology
        self.ramp_s, self.start_bytes_per_s = ramp_s, start_bytes_per_s
        self.on_delivered = on_delivered
        self._clock = clock
        self.pacers: dict[str, HintPacer] = {}
        self.resplit = 0  # hints delivered by re-splitting (tests, logs)

    def now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def came_up(self, name: str) -> None:
        """(Re)start ``name``'s pacing ramp."""
        if self.ramp_s > 0:
            self.pacers[name] = HintPacer(self.start_bytes_per_s, self.ramp_s, self.now())

    def went_down(self, name: str) -> None:
        self.pacers.pop(name, None)

    async def _pace(self, target: str, nbytes: int) -> None:
        pacer = self.pacers.get(target)
        if pacer is None:
            return
        now = self.now()
        if pacer.done(now):
            del self.pacers[target]
            return
        wait = pacer.reserve(now, nbytes)
        if wait > 0:
            await asyncio.sleep(wait)

    def drop_removed(self, removed: Callable[[str], bool]) -> int:
        """Forget the hints held for targets that ``removed`` says left the cluster for good: the
        node's ring marks them removed and they are not live (``StorageService.removed_for_good``,
        the one place for that rule; module docstring, "A target removed for good"). Returns how
        many were dropped."""
        dropped = 0
        for target in self.hints.targets():
            if removed(target):
                n = self.hints.drop(target)
                self.pacers.pop(target, None)
                log.info("hints dropped for a member removed from the ring target=%s count=%d", target, n)
                dropped += n
        return dropped

    async def deliver_to(self, target: str) -> int:
        """Deliver ``target``'s hints in order; stop at the first failure. Returns hints delivered."""
        done = 0
        for hint in self.hints.pending(target):
            await self._pace(target, hint.batch.nbytes)
            try:
                await self.client.apply_to(target, hint.batch_id, hint.batch,
                                           timeout_s=HINT_DELIVERY_TIMEOUT_S, epoch=hint.epoch or None)
            except RemoteNotOwner as exc:
                try:
                    ok = await self._resplit(target, hint)
                except _FAILURES as exc2:
                    log.info("hint re-split paused target=%s batch=%s: %s", target, tuple(hint.batch_id), exc2)
                    break
                if not ok:
                    log.info("hint refused as not owner, and the target owns every row here: paused "
                             "target=%s batch=%s: %s", target, tuple(hint.batch_id), exc)
                    break
            except _FAILURES as exc:
                log.info("hint delivery paused target=%s held=%d: %s", target,
                         len(self.hints.pending(target)), exc)
                break
            if not self.hints.delivered(target, hint.batch_id, hint.batch):
                continue  # another share joined it meanwhile: the union goes next round (hints.py)
            if self.on_delivered is not None:
                self.on_delivered()
            done += 1
        return done

    async def _resplit(self, target: str, hint: Hint) -> bool:
        """Deliver a hint the target refused as not owner by the current placement (module
        docstring, steps 1–2). False when there is nothing to re-route (views disagree: retry).

        Raises:
            StorageRequestError, PeersError, OSError: a part failed (the hint is kept).
        """
        bid = hint.batch_id
        placement = self.topology.placement
        split = split_by_owner(placement, target, hint.batch)
        if not split.moved:
            return False
        for node, part in sorted(split.moved.items()):
            if not self.topology.is_live(node):
                raise StorageRequestError("new owner is down", node)
            await self.client.apply_to(node, bid, part, timeout_s=HINT_DELIVERY_TIMEOUT_S,
                                       epoch=placement.epoch)
        # Last: the target's applied set then means "all parts done". When the target kept no row,
        # an empty part still records the id there: the writer settles a hinted seq only once the
        # target answers BatchesApplied yes, so without it the writer's floor never passed the seq.
        kept = split.kept if split.kept is not None else RowBatch.empty()
        await self.client.apply_to(target, bid, kept, timeout_s=HINT_DELIVERY_TIMEOUT_S, epoch=placement.epoch)
        self.resplit += 1
        log.info("hint re-split by the current placement target=%s batch=%s kept=%d moved=%s", target,
                 tuple(bid), split.kept.num_rows if split.kept is not None else 0,
                 {n: b.num_rows for n, b in split.moved.items()})
        return True
