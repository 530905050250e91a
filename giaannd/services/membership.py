"""The membership service: gossip (``peers.membership.MembershipNode``) inside the daemon.

Glue only (STYLE.md item 2). On ``start`` it builds this node's ``NodeMeta`` from the runtime
(roles, the data-plane URLs actually bound, capacity, placement weight), starts the SWIM node on
``membership.bind-address:bind-port`` with the runtime's keyring, joins ``cluster.seeds``, and
from then on feeds every member event into the runtime's ``ClusterView``. It serves (operation
ids of giaannd/operations.py, which declares their routes and arguments):

- ``members.list`` (as the admin API's members source): name, id, gossip address, status,
  incarnation, roles, data-plane URLs, capacity, weight;
- ``node.join`` ``{"seeds": ["host:port", ...]}``, ``node.leave`` (leave gossip, then stop the
  daemon), ``node.drain`` (refuse writes, keep serving reads, gossip ``full``);
- ``keys.list|install|use|remove``: keyring rotation, saved to ``cluster.key-file``; a key's id is
  its fingerprint (first 16 hex digits of SHA-256);
- ``ring.show``, ``ring.owners``: the placement as this node computes it (``column`` is a decimal
  or ``0x`` id, or a concept word hashed like the model does); the ring document shows the
  storage ring's entries and digest, the cutover override if one is in force, and the standby
  storage members (alive, not in the placement set); each placement member carries its owner
  counts over a fixed sample of column ids (giaannd/services/storage_usage.py);
- ``ring.usage``: each placement member's RAM and disk fill, rows and entries, asked over the
  data plane (``GetUsage``);
- ``column.info``: the column's owners and, per live owner, its rows, entries, bytes and digests
  of that column, asked over the data plane (``ColumnInfo``), with whether the replicas agree.
  Any node serves it, storage or not.

It also runs ring sync (giaannd/services/ring_sync.py): started right after the seeds are joined,
it pulls the storage ring from members whose gossiped digest differs and, on a storage node,
applies ``storage.join-mode`` (bootstrap, stay standby, or start the join) before ``start``
returns, so the roles start on a settled ring; and the override lease watch
(giaannd/services/override_lease.py), which drops a placement override whose operation ended
without clearing it (its coordinator died, restarted, or failed to clear it).

``stop(graceful=True)`` (SIGTERM) leaves gossip politely: the daemon stops this service after the
roles, so they drain while the node is still a member, then the leave spreads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np
from aiohttp import web

from giaannd.atomic_file import atomic_write_bytes
from giaannd.cluster.view import ClusterView
from giaannd.config import parse_seed
from giaannd.errors import AdminHTTPError, ConfigError, HostEnvironmentError, RemoteFault
from giaannd.json_body import json_object
from giaannd.model.ids import parse_column
from giaannd.operations import Handler
from giaannd.services.override_lease import OverrideLeaseWatch
from giaannd.services.ring_sync import RingSync
from giaannd.services.storage_usage import OWNER_SAMPLE, owner_counts, storage_usage
from peers.keyring import Keyring, KeyringError
from peers.membership.events import MemberEvent, MemberFailed, MemberJoined, NameConflict
from peers.membership.meta import NodeMeta
from peers.membership.node import JoinError, MembershipNode, NameConflictError, member_status

if TYPE_CHECKING:
    from giaannd.client.storage_client import StorageClient
    from giaannd.runtime.node import NodeRuntime
    from giaannd.service import ServiceContext

__all__ = ["INCARNATION_FILE", "MembershipService", "follow_membership", "key_id", "parse_seed"]

log = logging.getLogger(__name__)

#: Holds the incarnation this node last started with; a restart starts one above it, so its
#: "alive" outranks what the cluster remembers of the previous run (ARCHITECTURE §4).
INCARNATION_FILE: Final = "membership.incarnation"
#: Bound on one admin join request (each seed round has its own TCP deadline inside).
JOIN_TIMEOUT_S: Final = 60.0
#: Seeds accepted in one join request.
MAX_SEEDS: Final = 64
#: Deadline of each ColumnInfo page asked for ``GET /v1/columns/{column}`` (an admin request
#: must answer promptly; an owner slower than this is shown with its error).
COLUMN_INFO_TIMEOUT_S: Final = 5.0


def key_id(key: bytes) -> str:
    """A key's public fingerprint: enough to name it in ``giaannctl keys``, useless to forge."""
    return hashlib.sha256(key).hexdigest()[:16]


class MembershipService:
    """The ``membership`` service (module docstring).

    Args:
        runtime: the node runtime (started before this service).
    """

    name = "membership"
    #: Share of the drain budget the roles (stopped before) leave to the leave (giaannd/service.py
    #: ``drain_reserve_of``): 3 s of the default 60, above the default `leave-propagate-s` (1 s).
    drain_reserve = 0.05

    def __init__(self, runtime: NodeRuntime) -> None:
        self.runtime = runtime
        self.node: MembershipNode | None = None
        self._ctx: ServiceContext | None = None
        self._joined_seeds = 0
        self._client: StorageClient | None = None
        self.ring_sync: RingSync | None = None
        self.override_lease: OverrideLeaseWatch | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, ctx: ServiceContext) -> None:
        """Start gossip, join the seeds, follow member events, bind the admin operations.

        Raises:
            HostEnvironmentError: the membership port cannot be bound.
            RemoteFault: no seed answered, or another member has this node's name.
        """
        self._ctx = ctx
        cfg = ctx.config
        incarnation = self._next_incarnation(cfg.data_path(INCARNATION_FILE))
        rt = self.runtime
        assert rt.keyring is not None, "the runtime service starts before membership"
        m = cfg.membership
        node = MembershipNode(
            name=ctx.node_name, bind=(m.bind_address, m.bind_port), cluster=cfg.cluster.name,
            keyring=rt.keyring, config=m.resolved(), node_id=str(ctx.node_id),
            meta=rt.node_meta().encode(), incarnation=incarnation,
            advertise_host=m.advertise_address or None, keyring_path=rt.keyring_path)
        try:
            await node.start()
        except OSError as exc:
            raise HostEnvironmentError(f"cannot bind membership on {m.bind_address}:{m.bind_port}: "
                                       f"{exc.strerror or exc}", reason="listen_failed") from None
        except ValueError as exc:  # this node's metadata fits no packet of membership.max-packet-bytes
            raise ConfigError(f"membership cannot start: {exc}", "$.membership.max-packet-bytes") from None
        self.node = rt.membership = node
        follow_membership(rt.topology, node)
        node.on_event(self._on_member_event)
        log.info("membership started addr=%s:%d incarnation=%d", *node.addr, incarnation)
        self.ring_sync = RingSync(rt, node)
        self.ring_sync.start()
        self.override_lease = OverrideLeaseWatch(rt, node)
        self.override_lease.start()
        seeds = self._seeds(cfg.cluster.seeds, node)
        if seeds:
            await self._join(seeds)
        await self.ring_sync.settle(cfg.storage.join_mode, had_seeds=bool(seeds), spawn=ctx.spawn)
        ctx.admin.set_members_source(self.members)
        self._bind(ctx)

    async def stop(self, graceful: bool) -> None:
        """Graceful: announce the leave and wait while it spreads; then close sockets."""
        node = self.node
        if node is None:
            return
        if self._ctx is not None:
            self._ctx.admin.set_members_source(None)
        if self.override_lease is not None:
            await self.override_lease.stop()
        if self.ring_sync is not None:
            await self.ring_sync.stop()
        if graceful:
            try:
                await node.leave()
            except Exception:  # leaving is best effort: failure detection covers the rest
                log.exception("membership leave failed")
        await node.stop()
        self.runtime.membership = None

    def health(self) -> Mapping[str, Any]:
        if self.node is None:
            return {}
        node = self.node
        out = {"addr": f"{node.addr[0]}:{node.addr[1]}", "members_alive": len(node.alive_members()),
               "members_known": len(node.members()), "local_health": node.local_health(),
               "seeds_answered": self._joined_seeds}
        if self.ring_sync is not None:
            out["ring_sync"] = self.ring_sync.health()
        if self.override_lease is not None:
            out["override_lease"] = self.override_lease.health()
        return out

    # -- members -------------------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """The member table for ``GET /v1/members`` and ``giaannctl members list``."""
        rows = []
        for info in sorted(self._node().members(), key=lambda i: i.name):
            try:
                meta = NodeMeta.decode(info.meta)
            except ValueError:
                meta = NodeMeta()
            rows.append({
                "name": info.name, "node_id": info.node_id, "addr": f"{info.addr[0]}:{info.addr[1]}",
                "status": info.status, "incarnation": info.incarnation,
                "roles": ",".join(meta.roles) or "-",
                "data_plane": " ".join(meta.transports.values()) or "-",
                "capacity_gib": round(meta.capacity_bytes / 2**30, 2), "weight": meta.weight,
                "full": meta.full,
            })
        return rows

    def _on_member_event(self, event: MemberEvent) -> None:
        # Death (not suspicion: often refuted) fails in-flight data-plane requests to the peer.
        if isinstance(event, MemberFailed):
            self.runtime.fail_peer(event.node_id, event.cause or "failed")

    def _node(self) -> MembershipNode:
        if self.node is None:
            raise AdminHTTPError(503, "membership is not running", "unavailable")
        return self.node

    # -- join / leave / drain ------------------------------------------------------------------

    @staticmethod
    def _seeds(texts: list[str], node: MembershipNode) -> list[tuple[str, int]]:
        seeds = []
        for text in texts:
            try:
                seed = parse_seed(text)
            except ValueError as exc:
                raise ConfigError(str(exc), "$.cluster.seeds") from None
            if seed != tuple(node.addr):  # the first node of a cluster may list itself
                seeds.append(seed)
        return seeds

    async def _join(self, seeds: list[tuple[str, int]]) -> int:
        node = self._node()
        try:
            self._joined_seeds = await node.join(seeds)
        except (JoinError, NameConflictError) as exc:
            raise RemoteFault(str(exc), reason="join_failed") from None
        log.info("joined cluster seeds=%s answered=%d members=%d",
                 ",".join(f"{h}:{p}" for h, p in seeds), self._joined_seeds, len(node.members()))
        return self._joined_seeds

    async def _post_join(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("seeds",))
        texts = body.get("seeds")
        if not isinstance(texts, list) or not texts or len(texts) > MAX_SEEDS \
                or not all(isinstance(t, str) for t in texts):
            raise AdminHTTPError(400, f"expected {{\"seeds\": [\"host:port\", ...]}} with 1 to "
                                 f"{MAX_SEEDS} seeds", "bad_request")
        try:
            seeds = [parse_seed(t) for t in texts]
        except ValueError as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        try:
            async with asyncio.timeout(JOIN_TIMEOUT_S):
                answered = await self._join(seeds)
        except (RemoteFault, TimeoutError) as exc:
            raise AdminHTTPError(502, f"join failed: {exc or 'timed out'}", "join_failed") from None
        return {"joined": True, "seeds_answered": answered, "members": len(self._node().members())}

    async def _post_leave(self, request: web.Request, params: Mapping[str, str]) -> Any:
        assert self._ctx is not None
        # The daemon's graceful shutdown runs the roles' drain, then our stop() leaves gossip.
        self._ctx.request_stop("giaannctl node leave")
        return {"leaving": True, "node": self._ctx.node_name}

    async def _post_drain(self, request: web.Request, params: Mapping[str, str]) -> Any:
        rt = self.runtime
        if not rt.draining:
            rt.draining = True
            self._node().update_meta(rt.node_meta().encode())
            log.info("draining: refusing writes, serving reads")
        return {"draining": True, "node": rt.node_name}

    # -- keys ----------------------------------------------------------------------------------

    def _keyring(self) -> Keyring:
        if self.runtime.keyring is None:
            raise AdminHTTPError(503, "keyring not loaded", "unavailable")
        return self.runtime.keyring

    def _find_key(self, ident: str) -> bytes:
        for key in self._keyring().keys:
            if key_id(key) == ident or Keyring.encode_key(key) == ident:
                return key
        raise AdminHTTPError(404, f"no installed key {ident!r}", "not_found")

    def _mutable_keys(self) -> MembershipNode:
        if self.runtime.keyring_path is None:
            raise AdminHTTPError(409, "this cluster has no cluster.key-file: keys cannot be "
                                 "rotated (configure a key file first)", "no_key_file")
        return self._node()

    async def _get_keys(self, request: web.Request, params: Mapping[str, str]) -> Any:
        keys = self._keyring().keys
        return {"keys": [{"id": key_id(k), "primary": i == 0, "bits": len(k) * 8}
                         for i, k in enumerate(keys)],
                "file": self.runtime.keyring_path or "(none: derived from the cluster name)"}

    async def _post_key(self, request: web.Request, params: Mapping[str, str]) -> Any:
        node = self._mutable_keys()
        body = await json_object(request, ("key",))
        if not isinstance(body.get("key"), str):
            raise AdminHTTPError(400, 'expected {"key": "<base64 key>"}', "bad_request")
        try:
            key = Keyring.decode_key(body["key"])
            node.install_key(key)
        except KeyringError as exc:
            raise AdminHTTPError(400, str(exc), "bad_key") from None
        log.info("key installed key_id=%s", key_id(key))
        return {"installed": key_id(key)}

    async def _use_key(self, request: web.Request, params: Mapping[str, str]) -> Any:
        node = self._mutable_keys()
        key = self._find_key(params["key_id"])
        node.use_key(key)
        log.info("key in use key_id=%s", key_id(key))
        return {"primary": key_id(key)}

    async def _delete_key(self, request: web.Request, params: Mapping[str, str]) -> Any:
        node = self._mutable_keys()
        key = self._find_key(params["key_id"])
        try:
            node.remove_key(key)
        except KeyringError as exc:
            raise AdminHTTPError(409, str(exc), "key_in_use") from None
        log.info("key removed key_id=%s", key_id(key))
        return {"removed": key_id(key)}

    # -- ring ----------------------------------------------------------------------------------

    async def _get_ring(self, request: web.Request, params: Mapping[str, str]) -> Any:
        """The placement in force (``members``), the storage ring, the override and standby."""
        rt = self.runtime
        topo = rt.topology

        def address(name: str) -> str:
            try:
                return topo.address(name)
            except KeyError:
                return "-"

        override = topo.override
        entries = sorted(rt.ring.entries.items())
        doc: dict[str, Any] = {
            "ring": {"digest": f"{rt.ring.digest():016x}",
                     "active": [n for n, e in entries if e.state == "active"],
                     "removed": [n for n, e in entries if e.state == "removed"]},
            "ring_entries": [{"name": n, "state": e.state, "stamp": e.stamp, "weight": e.weight}
                             for n, e in entries],
            "override": None if override is None else
            [{"name": m.name, "weight": m.weight, "address": m.address} for m in override],
            "override_lease": None if (lease := rt.rings.lease) is None else msgspec.structs.asdict(lease),
            "standby": [{"name": n, "address": address(n)} for n in topo.standby()],
        }
        try:
            placement = topo.placement
        except LookupError:
            return {"epoch": "", "replicas": topo.replicas, "members": [], "owner_sample": OWNER_SAMPLE, **doc}
        counts = owner_counts(placement)
        return {"epoch": placement.epoch, "replicas": min(topo.replicas, len(placement.names)),
                "members": [{"name": m.name, "weight": m.weight, "address": address(m.name),
                             "live": topo.is_live(m.name), **counts[m.name]} for m in placement.members],
                "owner_sample": OWNER_SAMPLE, **doc}

    async def _get_usage(self, request: web.Request, params: Mapping[str, str]) -> Any:
        """``giaannctl ring usage``: every placement member's fill (storage_usage.py)."""
        return await storage_usage(self.runtime.topology, self._storage_client())

    def _storage_client(self) -> StorageClient:
        if self._client is None:  # closed by the runtime on stop
            self._client = self.runtime.storage_client()
        return self._client

    async def _get_owners(self, request: web.Request, params: Mapping[str, str]) -> Any:
        try:
            column, how = parse_column(params["column"])
        except ValueError as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        topo = self.runtime.topology
        try:
            placement = topo.placement
        except LookupError:
            raise AdminHTTPError(503, "no storage members known", "no_storage") from None
        idx = placement.owner_indices(np.array([column], dtype=np.uint64))[0]
        owners = [placement.names[int(i)] for i in idx]
        return {"column": params["column"], "column_id": str(column), "named_by": how,
                "epoch": placement.epoch,
                "owners": [{"name": n, "live": topo.is_live(n)} for n in owners]}

    async def _get_column(self, request: web.Request, params: Mapping[str, str]) -> Any:
        """``giaannctl column info``: owners in placement order, what each live one holds."""
        try:
            column, how = parse_column(params["column"])
        except ValueError as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        try:
            report = await self._storage_client().column_info(column, timeout_s=COLUMN_INFO_TIMEOUT_S)
        except LookupError:
            raise AdminHTTPError(503, "no storage members known", "no_storage") from None

        def digest(value: int | None) -> str | None:
            return None if value is None else f"{value:016x}"

        return {"column": params["column"], "column_id": str(column), "named_by": how,
                "epoch": report.epoch, "keys_agree": report.keys_agree,
                "strength_agree": report.strength_agree,
                "owners": [{"name": r.node, "live": r.live, "rows": r.rows, "entries": r.entries,
                            "bytes": r.bytes, "keys_digest": digest(r.keys_digest),
                            "strength_digest": digest(r.strength_digest), "batches": r.batches,
                            "error": r.error} for r in report.replicas]}

    def _bind(self, ctx: ServiceContext) -> None:
        """Bind the membership operations (giaannd/operations.py declares their routes)."""
        handlers: dict[str, Handler] = {
            "node.join": self._post_join, "node.leave": self._post_leave, "node.drain": self._post_drain,
            "keys.list": self._get_keys, "keys.install": self._post_key, "keys.use": self._use_key,
            "keys.remove": self._delete_key, "ring.show": self._get_ring, "ring.owners": self._get_owners,
            "ring.usage": self._get_usage, "column.info": self._get_column}
        for op_id, handler in handlers.items():
            ctx.admin.bind(op_id, handler)

    # -- incarnation ---------------------------------------------------------------------------

    @staticmethod
    def _next_incarnation(path: Path) -> int:
        """Read the last start's incarnation, persist and return the next one."""
        try:
            last = int(path.read_text(encoding="ascii").strip() or "0")
        except FileNotFoundError:
            last = -1
        except (ValueError, UnicodeDecodeError):
            log.warning("unreadable %s; starting from incarnation 0 (refutation recovers)", path)
            last = -1
        current = last + 1
        atomic_write_bytes(path, f"{current}\n".encode("ascii"))
        return current


def follow_membership(topology: ClusterView, node: MembershipNode) -> None:
    """Feed ``topology`` from a running membership node: the members alive now, then every event.
    (The subscription lasts as long as the node; events arrive on the loop, in order.)"""
    for info in node.alive_members():
        topology.apply_event(MemberJoined(info.name, info.node_id, info.addr, info.incarnation,
                                          member_status(info), info.meta, "initial"))

    def on_event(event: object) -> None:
        if not isinstance(event, NameConflict):
            topology.apply_event(event)  # type: ignore[arg-type]

    node.on_event(on_event)
