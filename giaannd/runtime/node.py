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
3. **Ring and topology**: the storage ring is loaded from ``<data dir>/ring.json`` (every node,
   storage or compute, persists the ring it knows) and the cluster view (``giaannd.cluster.view``)
   follows it (ring mode); the membership service feeds it addresses and liveness from member
   events.

**The ring** lives in a ``NodeRing`` (giaannd/runtime/ring.py) the runtime owns and exposes as
``ring``, ``commit_ring(ring)`` (merge; when that changes anything: persist durably first, then
the topology follows, then the new digest is gossiped, then ``ring_listeners`` are called) and
``ring_listeners``. ``extra_transports`` adds addresses to the advertised metadata (e.g.
``"stream"``: the storage node's stream endpoint); ``refresh_meta()`` gossips a change.

**Runtime requests** (``giaannd.protocol.RuntimeRequest``: ``RingGet``, ``RingPush``,
``SetOverride``) are answered by that ``NodeRing``, before any role handler and even on a
compute-only node; a ``SetOverride`` with ``flush`` waits on ``flush_clients()`` (every
``StorageClient`` this runtime handed out finishes the writes it had in flight).

Data-plane failures start suspicion (ARCHITECTURE §5): every ``StorageClient`` the runtime hands
out (and the storage role's own) reports a peer it could not reach to ``report_unreachable``,
which passes it to ``MembershipNode.report_unreachable`` at most once per peer per probe interval.
Suspicion is refuted by a live node; only membership's own timers declare death.

**Compute calls** (``protocol.ComputeCall``, tag 17: one compute node asking another, e.g. for its
share of a spread evaluation) go to the handler the compute role registered with
``serve_compute``, never to the storage role's.

Requests that arrive before a role registered its handler (``serve`` / ``serve_compute``), or on a
node without that role, get a typed ``Unavailable`` reply, so a caller fails over instead of
hanging.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from giaannd import protocol as p
from giaannd.client.storage_client import StorageClient
from giaannd.cluster.ring import RING_FILE, Ring
from giaannd.cluster.view import ClusterView
from giaannd.errors import ConfigError
from giaannd.runtime.metrics import RuntimeCollector
from giaannd.runtime.ring import NodeRing
from peers.errors import PeerDead, PeersError, TransportUnavailable
from peers.keyring import Keyring, KeyringError
from peers.membership.meta import NodeMeta
from peers.transport import (
    Handler,
    Identity,
    Incoming,
    Listener,
    Reply,
    Transport,
    make_transport,
    scheme_of,
)
from peers.transport.tcp import parse_host_port

if TYPE_CHECKING:
    from giaannd.config import Config
    from giaannd.service import ServiceContext
    from peers.membership.node import MembershipNode

__all__ = ["UNKEYED_PREFIX", "LiveKeys", "NodeRuntime", "derived_cluster_key"]

log = logging.getLogger(__name__)

#: Namespace of the key derived from the cluster name when no key file is configured
#: (``derived_cluster_key``: the one place it is derived).
UNKEYED_PREFIX: Final = "giaannd-unkeyed:"
#: Schemes a bind list may name that are optional on this host (skipped with a warning when they
#: cannot start, as long as another listener remains).
OPTIONAL_SCHEMES: Final = frozenset({"ucx"})
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", "[::]", ""})
#: Peers' last unreachability reports kept before those older than a probe interval (which hold
#: nothing back any more) are dropped: names of nodes gone for good do not pile up.
_UNREACHABLE_KEEP: Final = 64


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


def _check_dialable(url: str, scheme: str) -> None:
    """Raise ValueError unless peers could dial ``url``: ``scheme://host:port`` with a host and a
    port in range (tcp, ucx), ``mem://NAME`` with a name. Only the scheme was checked before: the
    node started and gossiped an address no peer could dial."""
    if scheme == "mem":
        if not url.partition("://")[2]:
            raise ValueError(f"expected mem://name, got {url!r}")
        return
    try:
        parse_host_port(url, scheme)
    except ValueError as exc:  # no host, no port, a port out of range
        raise ValueError(f"peers cannot dial {url}: {exc}") from None


class NodeRuntime:
    """Identity, keyring, transports, listeners and the topology of one node (module docstring).

    Args:
        config: the effective configuration.
        transport_options: scheme -> keyword options for that backend (``make_transport``), e.g.
            ``{"mem": {"network": MemoryNetwork()}}`` to keep an in-process cluster's ``mem://``
            listeners in a namespace of their own.
    """

    name = "runtime"

    def __init__(self, config: Config,
                 transport_options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.transport_options = dict(transport_options or {})
        self.node_id = ""
        self.node_name = ""
        self.keyring: Keyring | None = None
        # Relative to data-dir, as the daemon reads node-id-file and token-file (``data_path``):
        # load_config made it absolute already, a Config built in code (Config.loopback, the
        # cluster harness, an embedder) may not have, and the working directory is not the rule.
        key_file = config.cluster.key_file
        self.keyring_path: str | None = str(config.data_path(key_file)) if key_file else None
        self.identity: Identity | None = None
        self.transports: dict[str, Transport] = {}
        self.listeners: dict[str, Listener] = {}
        self.skipped: dict[str, str] = {}
        self.topology = ClusterView(local=None, replicas=config.storage.replication_factor)
        #: The storage ring, its file and listeners, and the runtime requests (runtime/ring.py).
        #: (late-bound, so the runtime's ``refresh_meta``/``flush_clients`` are looked up per call)
        self.rings = NodeRing(self.topology, lambda: self.refresh_meta(), lambda: self.flush_clients())
        #: Extra addresses gossiped in ``NodeMeta.transports`` (e.g. ``{"stream": URL}``); call
        #: ``refresh_meta()`` after changing it.
        self.extra_transports: dict[str, str] = {}
        self._on_join_needed: Callable[[], Awaitable[Any]] | None = None
        #: Set whenever ``on_join_needed`` holds a callback (ring sync waits for it).
        self.join_handler_set = asyncio.Event()
        #: Set while a role handler serves data-plane requests (``serve``).
        self.serving = asyncio.Event()
        #: Set by ``giaannctl node drain``: writes are refused (``Unavailable``), reads served.
        self.draining = False
        #: Set by the storage role while its disk is full (it refuses writes, serves reads);
        #: gossiped as ``NodeMeta.full`` like ``draining`` (call ``refresh_meta()`` after a change).
        self.disk_full = False
        #: Set by the membership service once its node runs.
        self.membership: MembershipNode | None = None
        self._handler: Handler | None = None
        self._compute_handler: Handler | None = None
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
        self.rings.load(ctx.config.data_path(RING_FILE))  # CorruptFileError: the operator decides
        self.keyring = self._load_keyring()
        self.identity = Identity(self.node_id, self.config.cluster.name, LiveKeys(self.keyring))
        if self.config.node.roles:
            await self._bind()
        else:  # gossip and admin only: no role uses the data plane
            log.info("no roles: data plane not started")
        self.topology.schemes = tuple(self.transports)
        ctx.metrics.registry.register(RuntimeCollector(self))
        log.info("data plane listening addresses=%s", ",".join(self.advertised.values()))

    async def stop(self, graceful: bool) -> None:
        """Close storage clients, listeners and transports (the runtime stops last)."""
        self._handler = None
        self._compute_handler = None
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

    def serve_compute(self, handler: Handler | None) -> None:
        """Route ``ComputeCall`` requests (compute-to-compute calls, protocol.py) to ``handler``
        (the compute role); None: answer them Unavailable."""
        self._compute_handler = handler

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

    @property
    def ring(self) -> Ring:
        """The storage ring this node holds (loaded in ``start``; change it with ``commit_ring``)."""
        return self.rings.ring

    @ring.setter
    def ring(self, ring: Ring) -> None:
        self.rings.ring = ring

    @property
    def ring_listeners(self) -> list[Callable[[Ring], None]]:
        """Called with the new ring after every change ``commit_ring`` made (release scheduling)."""
        return self.rings.listeners

    async def commit_ring(self, ring: Ring) -> bool:
        """Merge ``ring`` into this node's ring (``NodeRing.commit``). If that changed anything:
        persist it (atomic replace + fsync, in a worker thread), then let the topology follow, then
        gossip the new digest. Commits run one at a time (a lock), so none is lost.

        Returns:
            whether our ring changed.

        Raises:
            RuntimeError: before ``start`` (no data directory known).
            OSError: the ring file could not be written (our ring is unchanged).
            ValueError: the merge would exceed the ring's entry limit (unchanged).
        """
        return await self.rings.commit(ring)

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
            full=self.draining or self.disk_full,
            ring=self.ring.digest(),
        )

    def storage_client(self, **options: Any) -> StorageClient:
        """A ``StorageClient`` over this node's topology and transports (closed on stop).

        ``options`` go to ``StorageClient`` (``write_quorum``, timeouts...); the write quorum
        defaults to ``storage.write-quorum``, the read ramp to ``compute.read-ramp-up-s``, the read
        grouping to ``compute.read-fewest-nodes``, the kept large-row memory to
        ``compute.row-memory-keep-bytes``.
        """
        options.setdefault("write_quorum", self.config.storage.write_quorum)
        options.setdefault("on_unreachable", self.report_unreachable)
        options.setdefault("read_ramp_s", self.config.compute.read_ramp_up_s)
        options.setdefault("read_chunk_bytes", self.config.storage.read_chunk_bytes)
        options.setdefault("read_fewest_nodes", self.config.compute.read_fewest_nodes)
        options.setdefault("keep_row_bytes", self.config.compute.row_memory_keep_bytes)
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
        if len(self._unreachable_at) > _UNREACHABLE_KEEP:
            interval_s = node.config.probe_interval_s
            self._unreachable_at = {n: t for n, t in self._unreachable_at.items() if now - t < interval_s}
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
            host, port_sep, _ = url.partition("://")[2].rpartition(":")
            if port_sep and host in _WILDCARDS and not any(  # (mem://NAME has no host)
                    a.startswith(f"{scheme}://") for a in self.config.transport.advertise):
                raise ConfigError(f"{url} binds a wildcard address: set transport.advertise to "
                                  "the URL peers should dial", "$.transport.advertise")
            try:
                # (the config's admission limits unless the caller's options for the scheme say otherwise)
                options = {"limits": self.config.transport.limits(), **self.transport_options.get(scheme, {})}
                transport = self.transports.get(scheme) or make_transport(scheme, self.identity, **options)
                listener = await transport.listen(url, self._dispatch)
            except ValueError as exc:  # the URL itself: no port, a port out of range, mem:// unnamed
                raise ConfigError(f"cannot listen on {url}: {exc}", "$.transport.bind") from None
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
                _check_dialable(url, scheme)
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
        tag = p.request_tag(incoming.payload)
        try:
            runtime_msg = p.runtime_request(incoming.payload, tag)
        except p.ProtocolViolation as exc:
            return Reply(p.encode(p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])))
        if runtime_msg is not None:
            return Reply(p.encode(await self.rings.serve(runtime_msg)))
        if tag == p.COMPUTE_CALL_TAG:
            compute = self._compute_handler
            if compute is None:
                return Reply(p.encode(p.Unavailable("this node serves no compute calls (no compute role, "
                                                    "or it is not started)")))
            return await compute(incoming)
        handler = self._handler
        if handler is None:
            why = ("this node has no storage role" if "storage" not in self.config.node.roles
                   else "the storage role is not serving (starting or stopping)")
            return Reply(p.encode(p.Unavailable(why)))
        if self.draining and self._is_write(incoming):
            return Reply(p.encode(p.Unavailable("node is draining: writes go to other replicas")))
        return await handler(incoming)

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
