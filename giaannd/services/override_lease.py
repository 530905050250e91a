"""Override leases: a placement override never outlives the topology operation that set it.

Glue (STYLE.md item 2) around one pure rule, ``lease_verdict``. The membership service starts it
next to ring sync, on every node (storage or compute).

**Why.** A topology operation's cutover sets a *placement override* on its targets and on every
compute node (``SetOverride``, docs/topology.md): until the new ring is committed, their
placement is the operation's new member set. The override ends when the ring's active set equals
it, or when the coordinator clears it (``abandon`` after a failure). A coordinator that dies in
the cutover (kill -9, a lost host) does neither: the nodes it switched kept writing under a
placement no ring holds, for as long as they ran. A join's writers then sent the joiner's columns
to the joiner and the owners it displaces got none of them; with the joiner dead, every such
write waited on a hint for a node that might never come back.

**The lease.** Since Dec 2 a coordinator sends each override with a lease: its own member name
and the operation's id (``protocol.OverrideLease``); the node keeps it beside the override
(runtime/ring.py). Every ``LEASE_CHECK_S`` a node holding a leased override asks the coordinator
(``OperationGet``) for the operation's state, at the address membership last had for it, and
decides (``lease_verdict``):

- it answers "" (it runs no operation of that id: it restarted, or ran another since) or
  ``failed`` / ``cancelled`` (it ended without clearing this node, e.g. its clear did not reach
  it): the override is dropped;
- it answers any other state (``streaming``, ``cutover``, ``failing`` while it cleans up,
  ``done`` before the committed ring reached this node: ring sync brings it): it stays, *whatever
  membership says*. An overloaded coordinator that membership wrongly declared dead may be in the
  middle of its cutover; dropping then would send writes to an owner whose stream to the target
  has closed, which applies them and forwards them nowhere (a first version dropped on
  membership's word alone);
- it does not answer: the override is dropped only when membership has the coordinator dead,
  left or reaped as well; while it is alive or suspect (slow, partitioned), it stays.

Dropping returns the node to its ring's placement, the one every node that was not switched
still holds. A coordinator restarted with the same operation (a join resumed: its id is made from
the placements, so it is the same) answers its state, and its new cutover sets the overrides again.
An override set without a lease (by a coordinator that predates leases) stays until cleared, as
before. The coordinator's own override (it switches itself) lives in its process and ends with it.

What a drop does not undo: writes acknowledged under the override until it was dropped (from the
writers' switch to the drop: the kill plus membership's detection plus one check, ~10-15 s)
reached the new owners only, not the owners the override displaced; and the writer's floor,
which its later writes carry to every owner, makes a displaced owner count those seqs as applied,
so ``giaannctl node repair`` reports the rows as divergent but cannot rebuild them. Running the
same operation again (the joining node restarted, ``join-ring``) moves those columns to their new
owners; on a quiet host the replicas then agree, but under load that resumed join lost writes in
most runs, with or without leases (docs/topology.md, "Known gaps"). The drop's warning says what
is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Final

import msgspec

from giaannd.client.ring_calls import get_operation_state
from giaannd.cluster.view import pick_transport_address
from peers.errors import PeersError
from peers.membership.meta import NodeMeta

if TYPE_CHECKING:
    from giaannd import protocol as p
    from giaannd.runtime.node import NodeRuntime
    from peers.membership.node import MembershipNode

__all__ = ["ASK_TIMEOUT_S", "ENDED_STATES", "LEASE_CHECK_S", "OverrideLeaseWatch", "lease_verdict"]

log = logging.getLogger(__name__)

#: Seconds between two checks of the lease of the override in force.
LEASE_CHECK_S: Final = 5.0
#: Bound on asking the coordinator for its operation's state (no answer: the override stays).
ASK_TIMEOUT_S: Final = 5.0
#: An operation in these states will not clear the overrides it set ("": the coordinator runs no
#: operation of that id).
ENDED_STATES: Final = frozenset({"", "failed", "cancelled"})
#: Membership states in which a coordinator may still be running its operation.
_RUNNING_MEMBER: Final = frozenset({"alive", "suspect"})


def lease_verdict(member_status: str | None, op_state: str | None) -> str | None:
    """Why a leased override must be dropped, or None when it stays (module docstring).

    Args:
        member_status: membership's status of the coordinator (``alive``, ``suspect``, ``dead``,
            ``left``), None when membership does not know it.
        op_state: the coordinator's answer to ``OperationGet``; None when it could not be asked
            or did not answer.
    """
    if op_state is None:
        if member_status in _RUNNING_MEMBER:
            return None
        return f"its coordinator is {member_status or 'not a member'} and does not answer"
    if op_state == "":
        return "its coordinator runs no such operation (it restarted, or ran another since)"
    if op_state in ENDED_STATES:
        return f"its operation {op_state} without clearing it"
    return None


class OverrideLeaseWatch:
    """Checks the lease of this node's placement override every ``interval_s`` (module docstring).

    Args:
        runtime: the node runtime (its ``rings``: the override's lease; transports, identity).
        node: the running membership node (the coordinator's status and address).
        interval_s / ask_timeout_s: see the module constants.
    """

    def __init__(self, runtime: NodeRuntime, node: MembershipNode, *, interval_s: float = LEASE_CHECK_S,
                 ask_timeout_s: float = ASK_TIMEOUT_S) -> None:
        self.runtime, self.node = runtime, node
        self.interval_s, self.ask_timeout_s = interval_s, ask_timeout_s
        self._task: asyncio.Task[None] | None = None
        #: counters and the last drop, for health()
        self.checks = 0
        self.ask_errors = 0
        self.dropped = 0
        self.last_drop: str | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def health(self) -> dict[str, Any]:
        lease = self.runtime.rings.lease
        return {"lease": None if lease is None else msgspec.structs.asdict(lease),
                "checks": self.checks, "ask_errors": self.ask_errors, "dropped": self.dropped,
                "last_drop": self.last_drop}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # the watch must outlive any one failure
                log.exception("placement override lease check failed")

    def _member(self, name: str) -> tuple[str | None, NodeMeta | None]:
        """Membership's status of ``name`` and its metadata (None, None: not a member)."""
        for info in self.node.members():
            if info.name == name:
                try:
                    return info.status, NodeMeta.decode(info.meta)
                except ValueError:
                    return info.status, None
        return None, None

    async def _ask(self, lease: p.OverrideLease, meta: NodeMeta | None) -> str | None:
        """The coordinator's state of the lease's operation; None when it could not be asked."""
        rt = self.runtime
        if lease.coordinator == rt.node_name:
            return rt.rings.operation_state(lease.op_id)
        address = None if meta is None else pick_transport_address(meta, rt.transports)
        if address is None:
            return None
        try:
            return await get_operation_state(rt.transports, rt.identity, address, lease.op_id,
                                             timeout_s=self.ask_timeout_s)
        except (PeersError, OSError, TimeoutError, ValueError, KeyError) as exc:
            # (RingRequestError and ProtocolViolation are ValueErrors of RemoteFault: a coordinator
            # that predates OperationGet answers BadRequest)
            self.ask_errors += 1
            log.debug("override lease: %s did not answer for op=%s: %r", lease.coordinator, lease.op_id, exc)
            return None

    async def check(self) -> str | None:
        """One check; returns why the override was dropped (None: it stays, or there is none)."""
        rings = self.runtime.rings
        lease = rings.lease
        if lease is None:
            return None
        self.checks += 1
        status, meta = self._member(lease.coordinator)
        if lease.coordinator == self.runtime.node_name:
            status = "alive"
        state = await self._ask(lease, meta)  # (a coordinator declared dead is asked too)
        reason = lease_verdict(status, state)
        if reason is None or rings.lease is not lease:  # (replaced or cleared while we asked)
            return None
        rings.set_override(None)
        self.dropped += 1
        self.last_drop = f"op={lease.op_id} coordinator={lease.coordinator}: {reason}"
        log.warning("placement override of op=%s dropped: %s; this node is back on its ring's placement "
                    "epoch=%s. Writes acknowledged under the override are missing on the owners it "
                    "displaced (a repair cannot rebuild them): bring the coordinator back and run the "
                    "operation again (docs/topology.md, Override leases)",
                    lease.op_id, reason, self.runtime.topology.epoch[:12])
        return reason
