"""Role services built on the shared node runtime.

The compute role takes its storage client from the runtime (``storage_factory``), so its reads
and writes use the node's transports and the topology membership feeds.

``giaannd.storage.replication.service.StorageService`` can bind its own listeners and build its own
transports and topology (its standalone mode, used by its tests and benchmarks). Inside the
daemon that would give a node two data planes and two cluster views, so this adapter builds it
on the runtime's instead: no listeners of its own (``listen=[]``), the runtime's transports,
identity and topology, and its request handler registered with the runtime's listeners. The
service object is created in ``start``, once the runtime knows the node id and keyring.

The adapter also connects the service to the node: a full disk (the service refuses writes,
disk_full.py) is gossiped as ``NodeMeta.full``, and ``reclaim_space`` lets the daemon delete a
failed snapshot's temporary before it writes anything at start-up (a disk that temporary filled
would otherwise stop the node from starting).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from giaannd.compute.service import ComputeService
from giaannd.storage.engine.snapshot import remove_temporaries
from giaannd.storage.rebalance.daemon import StorageTopology
from giaannd.storage.replication.service import STORE_DIR, StorageService

if TYPE_CHECKING:
    from giaannd.config import Config
    from giaannd.runtime.node import NodeRuntime
    from giaannd.service import ServiceContext

__all__ = ["StorageRole", "create_compute_service", "create_storage_service"]


class StorageRole:
    """The ``storage`` service of a daemon: a ``StorageService`` on the node runtime."""

    name = "storage"

    def __init__(self, config: Config, runtime: NodeRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.service: StorageService | None = None
        self.topology_ops: StorageTopology | None = None

    async def start(self, ctx: ServiceContext) -> None:
        rt, s = self.runtime, self.config.storage
        self.service = StorageService(
            self.config.data_path("storage"), s.capacity_bytes, [],
            transports=rt.transports, identity=rt.identity, topology=rt.topology,
            node_name=rt.node_name, group_commit_window_s=s.fsync_group_commit_ms / 1000.0,
            snapshot_interval_s=s.snapshot_interval_s, replicas=s.replication_factor,
            on_unreachable=rt.report_unreachable, hint_ramp_s=s.ramp_up_s,
            hint_ramp_start_bytes_per_s=s.hint_ramp_start_bytes_per_s)
        self.service.disk.on_change = self._disk_full_changed
        await self.service.start(ctx)
        rt.serve(self.service.handle)
        self.topology_ops = StorageTopology(self.config, rt, self.service)
        await self.topology_ops.start(ctx)

    async def stop(self, graceful: bool) -> None:
        """The service refuses new writes while it drains; the runtime answers Unavailable
        once it is gone (its listeners close last, with the runtime)."""
        if self.topology_ops is not None:
            await self.topology_ops.stop()
        if self.service is not None:
            try:
                await self.service.stop(graceful)
            finally:
                self.runtime.serve(None)

    def reclaim_space(self) -> tuple[int, int]:
        """Delete snapshot temporaries a failed or interrupted snapshot left (``ReclaimsSpace``)."""
        return remove_temporaries(self.config.data_path("storage") / STORE_DIR)

    def _disk_full_changed(self, full: bool) -> None:
        self.runtime.disk_full = full
        self.runtime.refresh_meta()

    def health(self) -> Mapping[str, Any]:
        out = dict(self.service.health()) if self.service is not None else {}
        out["addresses"] = list(self.runtime.advertised.values())
        if self.topology_ops is not None:
            out.update(self.topology_ops.health())
        if self.runtime.draining:
            out["draining"] = True
        return out


def create_storage_service(config: Config, runtime: NodeRuntime) -> StorageRole:
    """The daemon's storage factory (``giaannd.daemon.ROLE_FACTORIES``)."""
    return StorageRole(config, runtime)


def create_compute_service(config: Config, runtime: NodeRuntime) -> ComputeService:
    """The daemon's compute factory: ``ComputeService`` with the runtime's storage client."""
    return ComputeService.from_config(config, storage_factory=lambda ctx: runtime.storage_client())
