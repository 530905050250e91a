"""The per-node runtime every role shares: identity, keyring, data-plane transports, the cluster
view and the storage-client factory.

Why one object: a node has one identity on the data plane and one view of the cluster. If the
storage and compute roles each built their own transports and topology, a node would open two
listeners, hold two connection sets to every peer, and could disagree with itself about who owns
a column. So the daemon builds one ``NodeRuntime`` and starts it first (it is the ``runtime``
service); the membership service feeds its ``topology``, the storage role serves on its
listeners, and the compute role asks it for ``StorageClient`` objects sharing its transports.

What it does on ``start``:

1. **Keyring**: ``cluster.key-file`` (the ``peers.keyring`` JSON format) is loaded; the same
   ``Keyring`` object seals gossip and proves the transport handshake, so a rotation
   (``/v1/keys``) reaches both at once. Without a key file a key is derived from the cluster name:
   no secret at all, which config.md says is acceptable on loopback only (and a warning says so).
2. **Transports and listeners**: one ``Transport`` per scheme of ``transport.bind``, each bound
   with one dispatching handler. A ``ucx://`` listener that cannot start here (ucxx missing, no
   UCX context) is logged and skipped when another listener remains: the node then speaks TCP
   only. Port 0 works: the bound addresses (real ports) are what ``advertised`` reports and what
   the membership service gossips in ``NodeMeta``.
3. **Ring and topology**: the storage ring (giaannd/ring.py) is loaded from
   ``<data dir>/ring.json`` (every node, storage or compute, persists the ring it knows) and the
   cluster view (``giaannd.topology``) follows it (ring mode): its placement set is the ring's
   active entries; the membership service feeds it addresses and liveness from member events.

**The ring.** ``commit_ring(ring)`` merges a ring into ours; when that changes anything, the file
is replaced durably *first* (a crash never leaves a node acting on a ring it has not persisted),
then the topology follows and the new digest is gossiped (``NodeMeta.ring``), so peers pull it
(giaannd/services/ring_sync.py). ``extra_transports`` adds addresses to the advertised metadata
(e.g. ``"stream"``: the storage node's stream endpoint); ``refresh_meta()`` gossips a change.

**Runtime requests** (``giaannd.protocol.RuntimeRequest``) are answered here, before any role
handler and even on a compute-only node: ``RingGet`` (our ring), ``RingPush`` (merge, reply with
the merged ring) and ``SetOverride`` (a topology operation's cutover: set or clear the topology's
override; with ``flush``, the reply waits until every ``StorageClient`` this runtime handed out has
finished the writes it had in flight, bounded by the request's ``flush_timeout_s``). The override
is set *before* the flush, so no write computed after the reply uses the old placement.

Data-plane failures start suspicion (ARCHITECTURE §5): every ``StorageClient`` the runtime hands
out (and the storage role's own) reports a peer it could not reach to ``report_unreachable``,
which passes it to ``MembershipNode.report_unreachable`` at most once per peer per probe interval.
Suspicion is refuted by a live node; only membership's own timers declare death.

Requests that arrive before a role registered its handler (``serve``), or on a node without the
storage role, get a typed ``Unavailable`` reply, so a writer fails over instead of hanging.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from giaannd import protocol as p
from giaannd.compute.client import StorageClient
from giaannd.errors import ConfigError
from giaannd.ring import RING_FILE, Ring
from giaannd.topology import StorageNode, Topology
from peers.errors import PeerDead, PeersError, TransportUnavailable
from peers.keyring import Keyring, KeyringError
from peers.membership.meta import NodeMeta
from peers.transport import Handler, Identity, Incoming, Listener, Reply, Transport
from peers.transport import make_transport, scheme_of

if TYPE_CHECKING:
    from giaannd.config import Config
    from giaannd.daemon import ServiceContext
    from peers.membership.node import MembershipNode

__all__ = ["UNKEYED_PREFIX", "LiveKeys", "NodeRuntime", "derived_cluster_key"]

log = logging.getLogger(__name__)

#: Namespace of the key derived from the cluster name when no key file is configured. The same
#: derivation as ``giaannd.storage.service``'s standalone mode, so both interoperate.
UNKEYED_PREFIX: Final = "giaannd-unkeyed:"
#: Schemes a bind list may name that are optional on this host (skipped with a warning when they
#: cannot start, as long as another listener remains).
OPTIONAL_SCHEMES: Final = frozenset({"ucx"})
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", "[::]", ""})


def derived_cluster_key(cluster: str) -> bytes:
    """The stand-in key of an unkeyed cluster: public, so it authenticates nothing."""
    return hashlib.sha256(f"{UNKEYED_PREFIX}{cluster}".encode()).digest()


class LiveKeys(Sequence[bytes]):
    """A read-only, always-current view of a ``Keyring`` for the transport ``Identity``.

    The handshake copies the key list when each connection starts, so new connections see a
    rotation at once and established ones keep the key they proved with.
    """

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring

    def __len__(self) -> int:
        return len(self._keyring.keys)

    def __getitem__(self, index: Any) -> Any:
        return self._keyring.keys[index]


class _RuntimeCollector(Collector):
    """Exports transport and membership counters at scrape time (they live in plain objects)."""

    def __init__(self, runtime: NodeRuntime) -> None:
        self._rt = runtime

    def collect(self) -> Iterator[Any]:
        fields = ("requests_sent", "requests_served", "bytes_sent", "bytes_received", "deadlines",
                  "cancels", "connections_opened", "connections_closed", "fallbacks")
        for name in fields:
            fam = CounterMetricFamily(f"giaannd_transport_{name}", f"data plane: {name}",
                                      labels=["scheme"])
            for scheme, transport in self._rt.transports.items():
                metrics = getattr(transport, "metrics", None)
                if metrics is not None:
                    fam.add_metric([scheme], float(getattr(metrics, name)))
            yield fam
        fam = CounterMetricFamily("giaannd_data_plane_unreachable_reports",
                                  "peers the data plane could not reach, by what membership was told",
                                  labels=["outcome"])
        fam.add_metric(["reported"], float(self._rt.unreachable_reported))
        fam.add_metric(["rate_limited"], float(self._rt.unreachable_suppressed))
        yield fam
        node = self._rt.membership
        if node is None:
            return
        try:
            counters = node.counters()
        except RuntimeError:  # not started yet
            return
        fam = CounterMetricFamily("giaannd_membership_events", "membership core and glue counters",
                                  labels=["counter"])
        for key, value in sorted(counters.items()):
            if key != "members_live":
                fam.add_metric([key], float(value))
        yield fam
        yield GaugeMetricFamily("giaannd_membership_members_live", "members believed alive",
                                value=float(counters.get("members_live", 0)))
        yield GaugeMetricFamily("giaannd_membership_local_health",
                                "Lifeguard local health score (0 is healthy)",
                                value=float(node.local_health()))


class NodeRuntime:
    """Identity, keyring, transports, listeners and the topology of one node (module docstring).

    Args:
        config: the effective configuration.
    """

    name = "runtime"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_id = ""
        self.node_name = ""
        self.keyring: Keyring | None = None
        self.keyring_path: str | None = config.cluster.key_file or None
        self.identity: Identity | None = None
        self.transports: dict[str, Transport] = {}
        self.listeners: dict[str, Listener] = {}
        self.skipped: dict[str, str] = {}
        self.topology = Topology(local=None, replicas=config.storage.replication_factor)
        #: The storage ring this node holds (loaded in ``start``; change it with ``commit_ring``).
        self.ring = Ring()
        #: Extra addresses gossiped in ``NodeMeta.transports`` (e.g. ``{"stream": URL}``); call
        #: ``refresh_meta()`` after changing it.
        self.extra_transports: dict[str, str] = {}
        #: called with the new ring after every change ``commit_ring`` made (release scheduling)
        self.ring_listeners: list[Callable[[Ring], None]] = []
        self._on_join_needed: Callable[[], Awaitable[Any]] | None = None
        #: Set whenever ``on_join_needed`` holds a callback (ring sync waits for it).
        self.join_handler_set = asyncio.Event()
        #: Set while a role handler serves data-plane requests (``serve``).
        self.serving = asyncio.Event()
        self._ring_path: Path | None = None
        self._ring_lock = asyncio.Lock()
        #: Set by ``giaannctl node drain``: writes are refused (``Unavailable``), reads served.
        self.draining = False
        #: Set by the membership service once its node runs.
        self.membership: MembershipNode | None = None
        self._handler: Handler | None = None
        self._clients: list[StorageClient] = []
        #: peer name -> monotonic time of its last report to membership (rate limit)
        self._unreachable_at: dict[str, float] = {}
        #: data-plane unreachability reports passed to membership / dropped by the rate limit
        self.unreachable_reported = 0
        self.unreachable_suppressed = 0

    # -- the Service protocol -------------------------------------------------------------

    async def start(self, ctx: ServiceContext) -> None:
        """Load the keyring, build transports and bind the listeners.

        Raises:
            ConfigError: bad key file, or no listener could be bound.
        """
        self.node_id, self.node_name = str(ctx.node_id), ctx.node_name
        if "storage" in self.config.node.roles:
            self.topology.local = self.node_name
        self._ring_path = ctx.config.data_path(RING_FILE)
        self.ring = Ring.load(self._ring_path)  # CorruptFileError: the operator decides
        self.topology.set_ring(self.ring)
        if len(self.ring):
            log.info("ring loaded digest=%016x active=%s", self.ring.digest(),
                     ",".join(n for n, _ in self.ring.active()) or "-")
        self.keyring = self._load_keyring()
        self.identity = Identity(self.node_id, self.config.cluster.name, LiveKeys(self.keyring))
        if self.config.node.roles:
            await self._bind()
        else:  # gossip and admin only: no role uses the data plane
            log.info("no roles: data plane not started")
        self.topology.schemes = tuple(self.transports)
        ctx.metrics.registry.register(_RuntimeCollector(self))
        log.info("data plane listening addresses=%s", ",".join(self.advertised.values()))

    async def stop(self, graceful: bool) -> None:
        """Close storage clients, listeners and transports (the runtime stops last)."""
        self._handler = None
        for client in self._clients:
            try:
                await client.close()
            except Exception:  # closing must go on for the others
                log.exception("storage client close failed")
        self._clients.clear()
        for listener in self.listeners.values():
            try:
                await listener.close()
            except Exception:
                log.exception("listener close failed address=%s", listener.address)
        self.listeners.clear()

    def health(self) -> Mapping[str, Any]:
        out: dict[str, Any] = {"advertised": self.advertised, "storage_members":
                               len(self.topology.live())}
        out["ring"] = {"digest": f"{self.ring.digest():016x}", "active": len(self.ring.active()),
                       "standby": self.topology.standby(),
                       "override": self.topology.override is not None}
        if self.skipped:
            out["skipped_transports"] = dict(self.skipped)
        if self.keyring is not None:
            out["keys"] = len(self.keyring.keys)
        return out

    # -- what roles use ---------------------------------------------------------------------

    @property
    def advertised(self) -> dict[str, str]:
        """Data-plane URL per scheme, in preference order: ``transport.advertise`` where set
        (first URL per scheme), else the bound listeners."""
        out: dict[str, str] = {}
        for url in self.config.transport.advertise:
            scheme = scheme_of(url)
            if scheme in self.listeners:
                out.setdefault(scheme, url)
        for scheme, listener in self.listeners.items():
            out.setdefault(scheme, listener.address)
        return out

    def serve(self, handler: Handler | None) -> None:
        """Route data-plane requests to ``handler`` (the storage role); None: answer Unavailable."""
        self._handler = handler
        if handler is None:
            self.serving.clear()
        else:
            self.serving.set()

    @property
    def on_join_needed(self) -> Callable[[], Awaitable[Any]] | None:
        """Called (as a background task, once the storage role serves and this is set) when this
        storage node starts standby in ``storage.join-mode = "auto"``: runs the streaming join
        (giaannd/services/ring_sync.py). Still None a while after the role serves: ring sync logs
        that ``giaannctl node join-ring`` is needed."""
        return self._on_join_needed

    @on_join_needed.setter
    def on_join_needed(self, callback: Callable[[], Awaitable[Any]] | None) -> None:
        self._on_join_needed = callback
        if callback is None:
            self.join_handler_set.clear()
        else:
            self.join_handler_set.set()

    async def commit_ring(self, ring: Ring) -> bool:
        """Merge ``ring`` into this node's ring. If that changed anything: persist it (atomic
        replace + fsync, in a worker thread), then let the topology follow, then gossip the new
        digest. Commits run one at a time (a lock), so none is lost.

        Returns:
            whether our ring changed.

        Raises:
            RuntimeError: before ``start`` (no data directory known).
            OSError: the ring file could not be written (our ring is unchanged).
            ValueError: the merge would exceed the ring's entry limit (unchanged).
        """
        path = self._ring_path
        if path is None:
            raise RuntimeError("commit_ring before the runtime started")
        async with self._ring_lock:
            merged = Ring(self.ring.entries)
            if not merged.merge(ring):
                return False
            await asyncio.to_thread(merged.save, path)
            self.ring = merged
            self.topology.set_ring(merged)
        log.info("ring changed digest=%016x active=%s removed=%s", merged.digest(),
                 ",".join(n for n, _ in merged.active()) or "-",
                 ",".join(sorted(n for n, e in merged.entries.items() if e.state == "removed")) or "-")
        self.refresh_meta()
        for callback in list(self.ring_listeners):
            callback(merged)
        return True

    def refresh_meta(self) -> None:
        """Gossip this node's metadata now (ring digest, ``extra_transports``, draining...).
        No-op before membership runs (it starts with the current ``node_meta()``)."""
        if self.membership is not None:
            self.membership.update_meta(self.node_meta().encode())

    def node_meta(self) -> NodeMeta:
        """The metadata this node gossips: roles, data-plane addresses, capacity and weight."""
        storage = "storage" in self.config.node.roles
        transports = self.advertised
        for key, url in self.extra_transports.items():
            transports.setdefault(key, url)
        return NodeMeta(
            roles=tuple(self.config.node.roles),
            transports=transports,
            capacity_bytes=self.config.storage.capacity_bytes if storage else 0,
            weight=self.config.storage.placement_weight if storage else 0.0,
            full=self.draining,
            ring=self.ring.digest(),
        )

    def storage_client(self, **options: Any) -> StorageClient:
        """A ``StorageClient`` over this node's topology and transports (closed on stop).

        ``options`` go to ``StorageClient`` (``write_quorum``, timeouts...); the write quorum
        defaults to ``storage.write-quorum``, the read ramp to ``compute.read-ramp-up-s``.
        """
        options.setdefault("write_quorum", self.config.storage.write_quorum)
        options.setdefault("on_unreachable", self.report_unreachable)
        options.setdefault("read_ramp_s", self.config.compute.read_ramp_up_s)
        client = StorageClient(self.topology, self.transports, identity=self.identity, **options)
        self._clients.append(client)
        return client

    def report_unreachable(self, name: str) -> bool:
        """The data plane could not reach member ``name``: start suspicion (not death) through
        membership, at most once per peer per probe interval (a burst of failed requests to one
        peer is one report). Returns whether this call reported. No-op without membership."""
        node = self.membership
        if node is None or not name or name == self.node_name:
            return False
        now = time.monotonic()
        last = self._unreachable_at.get(name)
        if last is not None and now - last < node.config.probe_interval_s:
            self.unreachable_suppressed += 1
            return False
        self._unreachable_at[name] = now
        self.unreachable_reported += 1
        log.info("data plane could not reach peer=%s: reporting it to membership", name)
        node.report_unreachable(name)
        return True

    def fail_peer(self, node_id: str, reason: str) -> int:
        """Membership declared ``node_id`` dead: fail every data-plane connection to it now.

        Pending requests fail at once with ``PeerDead`` instead of waiting for their deadlines
        (a partitioned peer sends no RST); the next request to it reconnects, after the topology
        stopped choosing it. Returns the number of connections failed.
        """
        failed = 0
        for transport in self.transports.values():
            for link in list(getattr(transport, "links", ())):
                conn = getattr(getattr(link, "session", None), "conn", None)
                if conn is not None and conn.peer == node_id and not conn.is_closed:
                    conn.fail(PeerDead(f"peer {node_id} declared dead by membership: {reason}"))
                    failed += 1
        if failed:
            log.info("failed data-plane connections peer=%s count=%d reason=%s", node_id, failed,
                     reason)
        return failed

    # -- internals --------------------------------------------------------------------------

    def _load_keyring(self) -> Keyring:
        if self.keyring_path is None:
            log.warning("no cluster.key-file: using a key derived from the cluster name, which "
                        "authenticates nothing (acceptable on loopback only)")
            return Keyring([derived_cluster_key(self.config.cluster.name)])
        try:
            return Keyring.load(self.keyring_path)
        except KeyringError as exc:
            raise ConfigError(str(exc), "$.cluster.key-file") from None

    async def _bind(self) -> None:
        assert self.identity is not None
        for url in self.config.transport.bind:
            try:
                scheme = scheme_of(url)
            except ValueError as exc:
                raise ConfigError(str(exc), "$.transport.bind") from None
            host = url.partition("://")[2].rpartition(":")[0]
            if host in _WILDCARDS and not any(
                    a.startswith(f"{scheme}://") for a in self.config.transport.advertise):
                raise ConfigError(f"{url} binds a wildcard address: set transport.advertise to "
                                  "the URL peers should dial", "$.transport.advertise")
            try:
                transport = self.transports.get(scheme) or make_transport(scheme, self.identity)
                listener = await transport.listen(url, self._dispatch)
            except (TransportUnavailable, PeersError, OSError, RuntimeError) as exc:
                if scheme in OPTIONAL_SCHEMES:
                    self.skipped[scheme] = f"{type(exc).__name__}: {exc}"
                    log.warning("transport unavailable, skipped scheme=%s url=%s reason=%r",
                                scheme, url, exc)
                    continue
                raise ConfigError(f"cannot listen on {url}: {exc}", "$.transport.bind") from None
            self.transports[scheme] = transport
            self.listeners.setdefault(scheme, listener)
        if not self.listeners:
            raise ConfigError("no data-plane listener could be started", "$.transport.bind")
        for url in self.config.transport.advertise:
            try:
                scheme = scheme_of(url)
            except ValueError as exc:
                raise ConfigError(str(exc), "$.transport.advertise") from None
            if scheme not in self.listeners and scheme not in self.skipped:
                raise ConfigError(f"{url} advertises {scheme}:// but transport.bind has no "
                                  f"{scheme}:// listener", "$.transport.advertise")
        if "ucx" in self.listeners:
            log.info("data plane: UCX bulk over ucxx worker-address endpoints, TCP control")
        else:
            log.info("data plane: TCP only%s", f" (skipped: {', '.join(self.skipped)})"
                     if self.skipped else "")

    async def _dispatch(self, incoming: Incoming) -> Reply:
        try:
            runtime_msg = p.runtime_request(incoming.payload)
        except p.ProtocolViolation as exc:
            return Reply(p.encode(p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])))
        if runtime_msg is not None:
            return Reply(p.encode(await self._serve_runtime(runtime_msg)))
        handler = self._handler
        if handler is None:
            why = ("this node has no storage role" if "storage" not in self.config.node.roles
                   else "the storage role is not serving (starting or stopping)")
            return Reply(p.encode(p.Unavailable(why)))
        if self.draining and self._is_write(incoming):
            return Reply(p.encode(p.Unavailable("node is draining: writes go to other replicas")))
        return await handler(incoming)

    async def _serve_runtime(self, msg: p.RuntimeRequest) -> p.Reply:
        """Answer a ring or override request (module docstring)."""
        if isinstance(msg, p.RingGet):
            return p.RingState(self.ring.to_wire())
        if isinstance(msg, p.RingPush):
            try:
                await self.commit_ring(Ring.from_wire(msg.entries))
            except ValueError as exc:
                return p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])
            except (OSError, RuntimeError) as exc:
                return p.Unavailable(f"cannot persist the ring: {exc}"[:p.MAX_TEXT_CHARS])
            return p.RingState(self.ring.to_wire())
        return await self._set_override(msg)

    async def _set_override(self, msg: p.SetOverride) -> p.Reply:
        members = None if msg.members is None else [StorageNode(n, a, w) for n, a, w in msg.members]
        try:
            self.topology.set_override(members)
        except (RuntimeError, ValueError) as exc:
            return p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])
        epoch = self.topology.epoch
        log.info("placement override %s epoch=%s flush=%s",
                 "cleared" if members is None else "set members=" + ",".join(m.name for m in members),
                 epoch[:12], msg.flush)
        if msg.flush:
            try:
                async with asyncio.timeout(msg.flush_timeout_s):
                    await self.flush_clients()
            except TimeoutError:
                return p.Unavailable(f"override set (epoch {epoch[:12]}) but writes in flight did "
                                     f"not finish within {msg.flush_timeout_s}s")
        return p.OverrideSet(epoch, self.topology.override is not None)

    async def flush_clients(self) -> None:
        """Wait until every ``StorageClient`` handed out by ``storage_client`` finished the writes
        (and hints) it had in flight (``StorageClient.flush``)."""
        await asyncio.gather(*(client.flush() for client in list(self._clients)))

    @staticmethod
    def _is_write(incoming: Incoming) -> bool:
        try:
            return isinstance(p.decode_request(incoming.payload), p.ApplyBatch)
        except p.ProtocolViolation:
            return False  # the handler answers BadRequest
