"""The operator's unseal (``giaannctl node registers unseal``, routes.py): drop the register seals
(register_handoff.py) a dead coordinator's topology operation left on this node, under the cluster's
topology lock (cluster_lock.py).

**After a coordinator died.** Its seals stay (on disk: a restart keeps them; nothing expires them)
until an operation from that placement seals and exports at the member (register_handoff.py, step
1), and so unseals it when it ends (step 4; one that fails before its handoff unseals nothing), or
the operator runs ``giaannctl node registers unseal`` on the node (``unseal_left``): the route takes
the cluster's topology lock itself (cluster_lock.py: refused while a live coordinator holds it; a
dead one's is taken over), then refuses while an operation runs on this node or a placement override
is in force here, and only then unseals; it releases the lock after. It checks those before the lock
too: an operation of this node that runs without the lock may have its write there all the same,
which this node's acquire takes over as stale (cluster_lock.py), and the refusal would release it.
The lock's own register may be among the keys this node sealed: at R <= 2 every quorum of it
includes this node, so the lock is then out of reach for everyone; the route decides from this
node's own state of it instead (nothing was chosen without this node, and nothing reached it after
the seal): it drops that one seal when the holder named is not a live member, then takes the lock.
Why that is safe: the seals' operation is over (its coordinator is no longer a live member, or it
ended and released the lock), so either it failed before any node switched, and the old placement
stays in force with the old owners bound to serve again (the joiners' imported copies are states
they merged, never answered from), or it switched every node, and a seal scoped to the old epoch
counts for nothing any more. Holding the lock keeps a new operation from sealing this node
meanwhile. What the node cannot see: a coordinator that died *between* the first and the last switch
leaves overrides on the nodes it switched (until they restart or the ring changes), so some
proposers use the new placement; unsealing a leaver then lets an old quorum (the leaver and one
stayer) miss a new one. The override check covers this node only: the operator checks that no node
shows ``override`` in ``giaannctl ring show`` first. An operation that ran *without* the lock (its
register unreachable) is not seen either. A stale seal only refuses, so waiting costs availability,
not safety. Keys whose every old owner is dead are not even known (as for columns: the operation
refuses when R members are down).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import msgspec

from giaannd.errors import Refused
from giaannd.storage.rebalance.cluster_lock import LOCK_KEY, LockHolder, OperationLockSealed, OperationLockUnavailable
from giaannd.storage.rebalance.register_handoff import _store, _unseal
from giaannd.storage.replication.service import StorageService

__all__ = ["SealsInUse", "TopologyLock", "unseal_left"]


class SealsInUse(Refused):
    """A topology operation may still need this node's seals (the admin API's 409)."""

    reason = "seals_in_use"


class TopologyLock(Protocol):
    """The cluster's topology lock as a ``ClusterControl`` offers it (rebalance/operations.py)."""

    async def lock(self, op_id: str, kind: str) -> int | None: ...

    async def unlock(self, token: int) -> None: ...


async def unseal_left(service: StorageService, control: TopologyLock, *, running: Callable[[], str | None],
                      override: Callable[[], bool], is_live: Callable[[str], bool]) -> tuple[int, bool]:
    """``giaannctl node registers unseal`` here: drop the seals a dead coordinator left, under the
    cluster's topology lock (module docstring, "After a coordinator died"). Returns the seals
    dropped and whether a lock was taken (the in-process control has none).

    Args:
        running: the topology operation running on this node (its kind and state), None if none.
        override: whether a placement override is in force on this node.
        is_live: whether a member is live (the lock's holder, where this node decides for it).

    Raises:
        OperationLockBusy: a live coordinator holds the lock.
        OperationLockUnavailable: the lock's register cannot be reached (nothing unsealed).
        SealsInUse: an operation runs here, or an override is in force here.
        RuntimeError: the seal file could not be rewritten or removed (the seals stay).
    """
    op_id = f"unseal:{service.node_name}"
    # first without the lock too: an operation running here without it may have its write in the
    # register all the same (in doubt), which this node's acquire would take over (cluster_lock.py)
    _check_unseal(running(), override())
    try:
        token = await _take_lock(control, op_id)
    except (OperationLockUnavailable, OperationLockSealed):  # (sealed: maybe here, by the dead coordinator)
        _check_unseal(running(), override())
        if not await _free_lock_register(service, is_live):
            raise
        token = await _take_lock(control, op_id)
    try:
        _check_unseal(running(), override())  # under the lock: no operation starts meanwhile
        return await _unseal(_store(service)), token is not None
    finally:
        if token is not None:
            await control.unlock(token)


async def _take_lock(control: TopologyLock, op_id: str) -> int | None:
    try:
        return await control.lock(op_id, "registers-unseal")
    except (OperationLockUnavailable, OperationLockSealed) as exc:
        in_doubt = getattr(exc, "token", None)  # a write whose outcome is unknown (cluster_lock.py)
        if in_doubt is not None:
            await control.unlock(in_doubt)
        raise


def _check_unseal(running: str | None, override: bool) -> None:
    if running is not None:
        raise SealsInUse(f"a topology operation runs on this node ({running}): it drops its seals when it "
                         "ends; wait for it (`giaannctl node topology status`) or cancel it")
    if override:
        raise SealsInUse("a placement override is in force on this node: a cutover is under way, or a "
                         "coordinator died between its switches and some nodes run the new placement; "
                         "the seals keep the old and the new owners' quorums meeting until every node "
                         "runs one placement (restart the switched nodes, or run the verb again)")


async def _free_lock_register(service: StorageService, is_live: Callable[[str], bool]) -> bool:
    """The lock is out of reach: if that is because this node sealed the lock's own register and
    every quorum of it includes this node (R <= 2), this node's state of it is the lock's (nothing
    was chosen without it, and nothing reached it after the seal). Drop that one seal when the
    holder it names is not live (or names this node, which runs no operation: checked before) or
    there is none. True when dropped.

    Raises:
        SealsInUse: the holder is a live coordinator.
    """
    store, topology = _store(service), service.topology
    if topology is None:
        return False
    placement = topology.placement
    if placement.effective_replicas > 2 or not store.sealed(LOCK_KEY, placement.epoch):
        return False
    value = store.get(LOCK_KEY).value
    try:
        holder = msgspec.msgpack.decode(value, type=LockHolder) if value else None
    except msgspec.DecodeError:
        holder = None  # not a lock (ClusterLock.decode: taken over)
    if holder is not None and holder.coordinator != service.node_name and is_live(holder.coordinator):
        raise SealsInUse(f"this node sealed the topology lock's own register while {holder.coordinator}'s "
                         f"{holder.kind} ({holder.op}) held the lock, and {holder.coordinator} is live: its "
                         "operation may still need the seals")
    try:
        return await asyncio.to_thread(store.unseal_key, LOCK_KEY)
    except OSError as exc:
        raise RuntimeError(f"register seals not rewritten: {exc}") from exc

