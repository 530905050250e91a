"""Role services built on the shared node runtime.

Each role is built from its config section and the node runtime, the one way there is:

- compute: ``ComputeService(config.compute, ...)`` takes its storage client from the runtime
  (``storage_factory``), so its reads and writes use the node's transports and the topology
  membership feeds; a spread evaluation reaches the other compute nodes over the same data plane
  (``eval_peers`` and the ``ComputeCall`` handler, giaannd/compute/eval_wire.py);
- storage: ``StorageService(config.storage, ..., runtime)`` serves on the runtime's listeners
  (``StorageRole`` registers its handler) and delivers hints over the runtime's transports and
  view, so a node has one data plane and one view of the cluster; ``StorageRole`` adds the
  topology operations (giaannd/storage/rebalance/daemon.py).

``StorageRole`` also connects the service to the node: a full disk (the service refuses writes,
disk_full.py) is gossiped as ``NodeMeta.full``, and ``reclaim_space`` lets the daemon delete a
failed snapshot's temporary before it writes anything at start-up (a disk that temporary filled
would otherwise stop the node from starting).

In-process test clusters (tools/cluster_harness) build nodes with these same factories.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from giaannd.storage.engine.snapshot import remove_temporaries
from giaannd.storage.rebalance.daemon import StorageTopology
from giaannd.storage.replication.service import STORE_DIR, StorageService

if TYPE_CHECKING:
    from giaannd.compute.service import ComputeService
    from giaannd.config import Config
    from giaannd.runtime.node import NodeRuntime
    from giaannd.service import ServiceContext

__all__ = ["StorageRole", "create_compute_service", "create_storage_service"]


class StorageRole:
    """The ``storage`` service of a daemon: a ``StorageService`` on the node runtime."""

    name = "storage"
    #: Share of the drain budget the compute role (stopped before) must leave to this stop
    #: (giaannd/service.py ``drain_reserve_of``): in-flight applies, a running operation's
    #: clean-up (up to 10 s) and the final snapshot, without which the next start replays the
    #: whole update log. Half: compute's jobs resume after a restart; a skipped snapshot costs
    #: the replay.
    drain_reserve = 0.5

    def __init__(self, config: Config, runtime: NodeRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.service = StorageService(config.storage, config.data_path("storage"), runtime)
        self.service.disk.on_change = self._disk_full_changed
        self.topology_ops: StorageTopology | None = None

    async def start(self, ctx: ServiceContext) -> None:
        rt = self.runtime
        await self.service.start(ctx)
        rt.serve(self.service.handle)
        self.topology_ops = StorageTopology(self.config, rt, self.service)
        await self.topology_ops.start(ctx)

    async def stop(self, graceful: bool) -> None:
        """The service refuses new writes while it drains; the runtime answers Unavailable
        once it is gone (its listeners close last, with the runtime)."""
        if self.topology_ops is not None:
            await self.topology_ops.stop()
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
        out = dict(self.service.health())
        out["addresses"] = list(self.runtime.advertised.values())
        if self.topology_ops is not None:
            out.update(self.topology_ops.health())
        if self.runtime.draining:
            out["draining"] = True
        return out


def create_storage_service(config: Config, runtime: NodeRuntime) -> StorageRole:
    """The daemon's storage factory (``giaannd.daemon.ROLE_FACTORIES``)."""
    return StorageRole(config, runtime)


def create_compute_service(config: Config, runtime: NodeRuntime | None) -> ComputeService:
    """The daemon's compute factory: ``ComputeService`` with the runtime's storage client, and a
    spread evaluation's shares over the runtime's data plane both ways (giaannd/compute/eval_wire.py):
    ``eval_peers`` names the alive compute members at eval time, and this node serves the shares
    other nodes send it (until the runtime stops)."""
    # Imported here: a storage-only daemon never loads the compute role's modules (start-up time).
    from giaannd.compute.eval_wire import EvalPeers, share_server
    from giaannd.compute.routes import STORAGE_ERRORS
    from giaannd.compute.service import ComputeService

    service = ComputeService.from_config(config, storage_factory=lambda ctx: runtime.storage_client()
                                         if runtime is not None else None)
    if runtime is not None:
        max_bytes = config.compute.eval_share_max_bytes
        service.eval_peers = EvalPeers(runtime, max_bytes, config.compute.eval_connect_timeout_s)
        runtime.serve_compute(share_server(service.eval_share, max_bytes, STORAGE_ERRORS))
    return service
