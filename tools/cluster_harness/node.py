"""One node of an in-process cluster, built and run the way ``giaannd`` builds and runs it.

``InProcessNode`` takes a ``Config`` and builds what ``giaannd.cli`` builds from it: a
``NodeRuntime``, a ``MembershipService`` when the cluster gossips, and the role services from the
daemon's own factories (``giaannd.daemon.build_role_services``). ``start`` gives each service a
``ServiceContext`` (its own metrics and an admin API object that collects routes without listening)
and starts them in the daemon's order; ``stop`` stops them in reverse, gracefully or not, bounded.
What it leaves out of ``giaannd.daemon.Daemon`` is the process's business: signals, sd_notify,
the data-directory lock and the admin HTTP listener.

``node_config`` writes the config of such a node (loopback, one listener, the harness's cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec

from giaannd.admin.api import AdminApi
from giaannd.config import ClusterConfig, ComputeConfig, Config, Role, StorageConfig, TransportConfig
from giaannd.daemon import build_role_services, load_or_create_node_id
from giaannd.metrics import Metrics
from giaannd.runtime.node import NodeRuntime
from giaannd.service import Service, ServiceContext
from giaannd.services.membership import MembershipService
from giaannd.services.roles import StorageRole
from giaannd.storage.rebalance.endpoint import StreamEndpoint
from giaannd.storage.replication.service import StorageService
from peers.transport.memory import MemoryNetwork

__all__ = ["STOP_TIMEOUT_S", "InProcessNode", "node_config"]

log = logging.getLogger(__name__)

#: Bound on one service's start or stop (a hang fails the test instead of stalling it).
STOP_TIMEOUT_S: Final = 30.0


def node_config(root: Path, name: str, *, roles: list[Role], bind: str, cluster: str, key_file: Path,
                storage: StorageConfig, seeds: list[str] | None = None) -> Config:
    """The config of one in-process node: ``Config.loopback`` with one data-plane listener
    (``bind``), the cluster's name and key file, the given ``storage`` section, and compute reads
    unramped (a returning node serves its full share at once, as the tests expect)."""
    base = Config.loopback(str(root / name), name=name, roles=roles)
    return msgspec.structs.replace(
        base, cluster=ClusterConfig(name=cluster, key_file=str(key_file), seeds=list(seeds or [])),
        transport=TransportConfig(bind=[bind]), storage=storage,
        compute=ComputeConfig(read_ramp_up_s=0.0))


class InProcessNode:
    """A node in this process (module docstring).

    Args:
        config: the node's configuration (``node_config``).
        network: the ``MemoryNetwork`` its ``mem://`` listeners and dials use.
        gossip: run the membership service (SWIM over UDP on loopback), as ``giaannd`` does;
            without it the cluster harness feeds the node's view itself.
        roles: build and run the role services of ``config.node.roles``. False: the runtime (and
            membership) only, e.g. the harness's client, a compute node's runtime whose storage
            clients the tests drive without a compute service.
    """

    def __init__(self, config: Config, *, network: MemoryNetwork, gossip: bool = False,
                 roles: bool = True) -> None:
        self.config = config
        self.name = config.node.name
        self.runtime = NodeRuntime(config, transport_options={"mem": {"network": network}})
        self.membership = MembershipService(self.runtime) if gossip else None
        services: list[Service] = []
        if roles:
            services, unavailable = build_role_services(config, self.runtime)
            if unavailable:
                raise RuntimeError(f"roles unavailable in this build: {unavailable}")
        self.roles = services
        self.metrics = Metrics()
        self.admin = AdminApi(token=secrets.token_urlsafe(16), metrics=self.metrics,
                              status=lambda: {"node_name": self.name})
        self.stopping = asyncio.Event()
        self.node_id: uuid.UUID | None = None
        self.stop_requested: str | None = None
        #: exceptions of background tasks (the daemon would log them and stop with status 1)
        self.failures: list[BaseException] = []
        self._started: dict[str, Service] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- what tests use ---------------------------------------------------------------------------
    @property
    def storage_role(self) -> StorageRole | None:
        return next((r for r in self.roles if isinstance(r, StorageRole)), None)

    @property
    def storage(self) -> StorageService | None:
        role = self.storage_role
        return role.service if role is not None else None

    @property
    def endpoint(self) -> StreamEndpoint | None:
        role = self.storage_role
        return role.topology_ops.endpoint if role is not None and role.topology_ops is not None else None

    @property
    def address(self) -> str:
        """The data-plane address it advertises."""
        return next(iter(self.runtime.advertised.values()))

    @property
    def gossip_address(self) -> str:
        node = self.membership.node if self.membership is not None else None
        if node is None:
            raise RuntimeError(f"{self.name} runs no membership")
        return f"{node.addr[0]}:{node.addr[1]}"

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, before_roles: Callable[[NodeRuntime], Awaitable[None]] | None = None) -> None:
        """Start the runtime, membership, then the roles (``giaannd.cli``'s order); ``before_roles``
        runs after the runtime (and membership) started, before any role: where the harness
        settles the node's ring as ring sync would. On failure, what started is stopped."""
        Path(self.config.node.data_dir).mkdir(parents=True, exist_ok=True)
        self.node_id = load_or_create_node_id(self.config.data_path(self.config.node.node_id_file))
        first = [s for s in (self.runtime, self.membership) if s is not None]
        try:
            for service in first:
                await self._start_one(service)
            if before_roles is not None:
                await before_roles(self.runtime)
            for role in self.roles:
                await self._start_one(role)
        except BaseException:
            # what started is stopped (its listeners closed): the caller never gets this node to
            # stop, and a socket left bound made a later test fail (an unclosed-socket warning)
            with contextlib.suppress(Exception):
                await self.stop(graceful=False)
            raise

    async def _start_one(self, service: Service) -> None:
        assert self.node_id is not None
        ctx = ServiceContext(
            config=self.config, node_id=self.node_id, node_name=self.name, metrics=self.metrics,
            admin=self.admin, stopping=self.stopping, services=dict(self._started),
            _spawn=self._spawn, _request_stop=self._request_stop, service_name=service.name,
            runtime=self.runtime)
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await service.start(ctx)
        self._started[service.name] = service

    async def stop(self, graceful: bool) -> None:
        """Stop every started service in reverse order (``graceful``: drain, snapshot, leave, then
        the background tasks are cancelled, as the daemon does; else the background tasks go
        first and everything closes at once, as a crash leaves things)."""
        self.stopping.set()
        if not graceful:
            await self._cancel_tasks()
        for service in reversed(list(self._started.values())):
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await service.stop(graceful)
        self._started.clear()
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, coro: Coroutine[Any, Any, Any], service: str, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{service}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task failed task=%s", task.get_name(), exc_info=exc)
            self.failures.append(exc)

    def _request_stop(self, reason: str) -> None:
        self.stop_requested = reason

    def services(self) -> Mapping[str, Service]:
        """The services running now, by name."""
        return dict(self._started)
