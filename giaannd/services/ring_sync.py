"""Ring sync: every node converges on the same storage ring (giaannd/cluster/ring.py), and a storage node
decides at start whether it is active, bootstraps, or waits standby for a join.

Glue (STYLE.md item 2); the one rule with choices in it, the start decision, is the pure
``join_action``. The membership service starts it right after joining the seeds.

**Pull on a digest mismatch.** Every node gossips its ring's digest in ``NodeMeta.ring``. On a
member event whose digest is non-zero and differs from ours, we pull that member's ring
(``RingGet`` over the data plane, giaannd/client/ring_calls.py) and ``runtime.commit_ring`` it: a merge,
persisted before it takes effect, after which our own digest is gossiped. Rings are a CRDT, so
pulling in any order converges: once every change reached every node by some path, all digests
are equal and pulls stop. At most one pull per peer is in flight and a peer is pulled at most
once per ``min_pull_interval_s`` (a change that arrives meanwhile is pulled right after). A failed
pull is logged, never raised, and retried while the peer's digest still differs: after
``min_pull_interval_s`` doubled per failure (capped at ``interval_s``), ``PULL_RETRIES`` times;
then the anti-entropy round or the next event tries again. (A peer that gossips its new digest
while its event loop is busy, e.g. starting its storage role, must not leave the others on the
old ring until the next anti-entropy round picks it.)

**Anti-entropy.** Every ``interval_s`` (10 s by default) one random live member whose digest
differs from ours is pulled, in case an event was missed (a pull failed, a node restarted with a
stale file).

**Start (``settle``).** With seeds, first pull the ring from (a sample of) the members joined, in
parallel, bounded by ``INITIAL_SYNC_S``. Then a storage node applies ``storage.join-mode``
(``join_action``):

==========================  ============  ====================  =========================
ring says about this node   ``auto``      ``bootstrap``         ``manual``
==========================  ============  ====================  =========================
active                      stays active  stays active          stays active
removed (decommissioned)    standby       standby               standby
absent, no active member    bootstrap     bootstrap             standby
absent, others active       join          bootstrap             standby
==========================  ============  ====================  =========================

In ``auto``, "no active member" means in the ring this node holds after the start-up pull: when a
member gossips a non-zero digest that differs from ours (a ring we could not read in time), the
node does not bootstrap but takes the *join* path (an empty node must not own columns at once).

*bootstrap* commits ``ring.with_active(me, storage.placement-weight)``; *join* stays standby and,
in a background task, waits until the storage role serves and ``runtime.on_join_needed`` is set
(the roles start after membership; bounded by ``JOIN_HANDLER_WAIT_S``), then runs it unless the
node became active meanwhile (its failure is logged; the node stays standby). No callback in time:
it logs that ``giaannctl node join-ring`` is needed. A removed node never re-adds itself: an operator's decommission
must not be undone by a
restart (run ``giaannctl node join-ring`` to bring it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from giaannd.client.ring_calls import get_ring
from giaannd.cluster.ring import Ring
from giaannd.cluster.view import pick_transport_address
from giaannd.config import JoinMode
from peers.membership.events import MemberEvent, MemberFailed, MemberLeft, MemberReaped, NameConflict
from peers.membership.meta import NodeMeta

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime
    from peers.membership.node import MembershipNode

__all__ = ["ANTI_ENTROPY_S", "INITIAL_SYNC_S", "PULL_RETRIES", "JoinAction", "RingSync", "join_action"]

log = logging.getLogger(__name__)

JoinAction = Literal["active", "bootstrap", "standby", "join"]

#: Seconds between anti-entropy pulls (one random member whose digest differs).
ANTI_ENTROPY_S: Final = 10.0
#: Bound on the start-up pull from the members just joined (the brief's "up to 3 s").
INITIAL_SYNC_S: Final = 3.0
#: Members pulled in parallel at start (a sample: one member's ring may be stale or empty).
INITIAL_SYNC_PEERS: Final = 8
#: A peer is pulled at most this often (a burst of gossip updates is one pull).
MIN_PULL_INTERVAL_S: Final = 0.5
#: Bound on one pull (connect + RingGet).
PULL_TIMEOUT_S: Final = 5.0
#: Retries of a failed pull (backoff doubling from ``MIN_PULL_INTERVAL_S``) before the
#: anti-entropy round takes over.
PULL_RETRIES: Final = 6
#: How long a standby node in join-mode auto waits, once its storage role serves, for something
#: (the storage role's topology service) to set ``runtime.on_join_needed``.
JOIN_HANDLER_WAIT_S: Final = 60.0


def join_action(mode: JoinMode, ring: Ring, me: str) -> JoinAction:
    """What a storage node does at start (module docstring, the table)."""
    entry = ring.get(me)
    if entry is not None:
        return "active" if entry.state == "active" else "standby"
    if mode == "manual":
        return "standby"
    if mode == "bootstrap" or not ring.active():
        return "bootstrap"
    return "join"


@dataclass
class _Peer:
    address: str | None
    digest: int
    #: the last pull's failure (None: none, or the last pull worked)
    error: str | None = None


class RingSync:
    """Pulls rings from peers whose digest differs (module docstring).

    Args:
        runtime: the node runtime (its ``ring``, ``commit_ring``, transports and identity).
        node: the running membership node.
        interval_s / min_pull_interval_s / pull_timeout_s: see the module constants.
        rng: randomness for the anti-entropy choice (tests inject a seeded one).
    """

    def __init__(self, runtime: NodeRuntime, node: MembershipNode, *,
                 interval_s: float = ANTI_ENTROPY_S, min_pull_interval_s: float = MIN_PULL_INTERVAL_S,
                 pull_timeout_s: float = PULL_TIMEOUT_S, rng: random.Random | None = None) -> None:
        self.runtime, self.node = runtime, node
        self.interval_s, self.min_pull_interval_s = interval_s, min_pull_interval_s
        self.pull_timeout_s = pull_timeout_s
        self._rng = rng or random.Random()
        self.pull_retries = PULL_RETRIES
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._last_pull: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running = False
        #: counters for health()
        self.pulls = 0
        self.pull_errors = 0
        self.changes = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Follow member events (the members alive now first) and start anti-entropy."""
        self._running = True
        for info in self.node.alive_members():
            self._note(info.name, info.meta)
        self.node.on_event(self.on_event)
        self._spawn(self._anti_entropy())
        self.want_all()

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def health(self) -> dict[str, Any]:
        """Counters, and per known peer its gossiped digest, data-plane address, whether a pull
        is in flight and the last pull's error (what to look at when rings do not converge)."""
        peers = {name: {"digest": f"{peer.digest:016x}", "address": peer.address,
                        "pulling": name in self._inflight, "error": peer.error}
                 for name, peer in sorted(self._peers.items())}
        return {"digest": f"{self.runtime.ring.digest():016x}", "pulls": self.pulls,
                "pull_errors": self.pull_errors, "changes": self.changes, "peers": peers}

    # -- events -------------------------------------------------------------------------------------
    def on_event(self, event: MemberEvent) -> None:
        """A member event: note the peer's address and digest; pull if the digest differs."""
        if not self._running or event.name == self.runtime.node_name:
            return
        if isinstance(event, (MemberFailed, MemberLeft, MemberReaped)):
            self._peers.pop(event.name, None)
            if not isinstance(event, MemberFailed):  # gone for good (a failed one is reaped later):
                # nodes replaced under new names must not leave a pull time each behind
                self._last_pull.pop(event.name, None)
            return
        if not isinstance(event, NameConflict) and self._note(event.name, event.meta):
            self.want(event.name)

    def _note(self, name: str, meta_bytes: bytes) -> bool:
        """Record a peer; True when its digest is non-zero and differs from ours."""
        if name == self.runtime.node_name:
            return False
        try:
            meta = NodeMeta.decode(meta_bytes)
        except ValueError:
            return False
        schemes = self.runtime.topology.schemes or ("tcp",)
        known = self._peers.get(name)
        self._peers[name] = _Peer(pick_transport_address(meta, schemes), meta.ring,
                                  known.error if known is not None else None)
        return self._differs(name)

    def _differs(self, name: str) -> bool:
        peer = self._peers.get(name)
        return (peer is not None and peer.address is not None and peer.digest != 0
                and peer.digest != self.runtime.ring.digest())

    def want_all(self) -> None:
        """Pull from every known peer whose digest differs."""
        for name in list(self._peers):
            if self._differs(name):
                self.want(name)

    def want(self, name: str) -> None:
        """Schedule a pull from ``name`` (one in flight per peer, rate-limited)."""
        if not self._running:
            return
        if name in self._inflight:
            self._again.add(name)
            return
        self._inflight[name] = self._spawn(self._pull_loop(name))

    async def _pull_loop(self, name: str) -> None:
        failures = 0
        try:
            while self._running:
                self._again.discard(name)
                gap_s = min(self.min_pull_interval_s * 2 ** failures, self.interval_s)
                wait_s = self._last_pull.get(name, float("-inf")) + gap_s - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                if not self._differs(name):
                    break
                self._last_pull[name] = time.monotonic()
                try:
                    await self.pull(name)
                except Exception:  # logged in pull(); retried below while the digest differs
                    failures += 1
                    if failures > self.pull_retries:
                        break
                    continue
                failures = 0
                if name not in self._again:
                    break
        finally:
            self._inflight.pop(name, None)

    async def pull(self, name: str) -> bool:
        """Pull ``name``'s ring and commit it. Returns whether ours changed.

        Raises:
            KeyError: no data-plane address known for ``name``.
            Exception: whatever the pull or the commit raised (also logged).
        """
        peer = self._peers.get(name)
        if peer is None or peer.address is None:
            raise KeyError(f"no data-plane address known for {name}")
        rt = self.runtime
        self.pulls += 1
        try:
            ring = await get_ring(rt.transports, rt.identity, peer.address, timeout_s=self.pull_timeout_s)
            changed = await rt.commit_ring(ring)
        except Exception as exc:
            self.pull_errors += 1
            peer.error = repr(exc)[:200]
            log.warning("ring pull failed peer=%s address=%s error=%r", name, peer.address, exc)
            raise
        peer.error = None
        if changed:
            self.changes += 1
            log.info("ring pulled peer=%s digest=%016x", name, rt.ring.digest())
        return changed

    async def _anti_entropy(self) -> None:
        while self._running:
            await asyncio.sleep(self.interval_s)
            try:
                for info in self.node.alive_members():  # refresh what we know, events may be lost
                    self._note(info.name, info.meta)
                differing = sorted(n for n in self._peers if self._differs(n))
                if differing:
                    self.want(self._rng.choice(differing))
            except Exception:  # the round must outlive any one failure
                log.exception("ring anti-entropy round failed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- start-up -----------------------------------------------------------------------------------
    async def initial_sync(self, timeout_s: float = INITIAL_SYNC_S) -> bool:
        """Pull the ring from up to ``INITIAL_SYNC_PEERS`` random members joined, in parallel
        (one member's ring may be stale or empty, e.g. a compute node that started first), until
        all answered or ``timeout_s``. Returns whether any answered."""
        for info in self.node.alive_members():
            self._note(info.name, info.meta)
        candidates = sorted(n for n, peer in self._peers.items() if peer.address is not None)
        chosen = self._rng.sample(candidates, min(INITIAL_SYNC_PEERS, len(candidates)))
        if not chosen:
            return False
        tasks = [asyncio.ensure_future(self.pull(name)) for name in chosen]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return any(not t.cancelled() and t.exception() is None for t in done)

    async def settle(self, mode: JoinMode, *, had_seeds: bool,
                     spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> JoinAction | None:
        """Start-up: sync from the seeds' cluster, then (storage nodes) apply ``mode``.

        Returns:
            the action taken (None: not a storage node).
        """
        rt = self.runtime
        if had_seeds:
            answered = await self.initial_sync()
            log.info("ring synced at start answered=%s digest=%016x active=%s", answered,
                     rt.ring.digest(), ",".join(n for n, _ in rt.ring.active()) or "-")
        if "storage" not in rt.config.node.roles:
            return None
        me = rt.node_name
        action = join_action(mode, rt.ring, me)
        ours = rt.ring.digest()
        unread = sorted(n for n, peer in self._peers.items() if peer.digest not in (0, ours))
        if action == "bootstrap" and mode == "auto" and unread:
            log.warning("ring: members gossip a ring this node could not read (%s); not "
                        "bootstrapping: the join starts once the storage role serves", ",".join(unread))
            action = "join"
        if action == "bootstrap":
            await rt.commit_ring(rt.ring.with_active(me, rt.config.storage.placement_weight))
            log.info("ring: bootstrapped node=%s (join-mode %s)", me, mode)
        elif action == "active":
            entry = rt.ring.get(me)
            if entry is not None and entry.weight != rt.config.storage.placement_weight:
                log.warning("ring weight of node=%s is %g, config says %g: the ring's stays (a "
                            "weight change moves columns: it needs a topology operation)",
                            me, entry.weight, rt.config.storage.placement_weight)
        elif action == "join":
            log.info("standby: not in the ring; the join starts once the storage role serves "
                     "(join-mode auto)")
            spawn(self._run_join(), "ring-join")
        else:
            why = "marked removed in the ring" if rt.ring.get(me) is not None else f"join-mode {mode}"
            log.warning("standby: this storage node owns no columns (%s); run `giaannctl node join-ring` "
                        "to add it", why)
        return action

    async def _run_join(self) -> None:
        rt = self.runtime
        await rt.serving.wait()  # the join streams into the storage role: wait until it serves
        try:
            async with asyncio.timeout(JOIN_HANDLER_WAIT_S):
                await rt.join_handler_set.wait()
        except TimeoutError:
            pass
        callback = rt.on_join_needed
        if callback is None:
            log.warning("standby: this storage node owns no columns and nothing runs the join; "
                        "run `giaannctl node join-ring` to add it")
            return
        if rt.ring.get(rt.node_name) is not None:
            log.info("join not needed: the ring now has this node (%s)", rt.ring.get(rt.node_name))
            return
        log.info("standby: starting the join")
        try:
            await callback()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("join failed; the node stays standby (retry: `giaannctl node join-ring`)")
