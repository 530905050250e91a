"""The contract between the daemon and what it runs: ``Service`` and its ``ServiceContext``.

Kept apart from giaannd/daemon.py (the lifecycle) so a role module can type against the contract
without importing the daemon machinery. ``giaannd.daemon`` re-exports both names.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from giaannd.config import Config
from giaannd.metrics import Metrics

if TYPE_CHECKING:
    from giaannd.admin.api import AdminApi
    from giaannd.runtime.node import NodeRuntime

__all__ = ["ReclaimsSpace", "Service", "ServiceContext", "drain_reserve_of"]


@runtime_checkable
class Service(Protocol):
    """A role or subsystem the daemon runs. Everything a service needs arrives in ``start``."""

    name: str

    async def start(self, ctx: ServiceContext) -> None:
        """Start serving; return once ready (long-running loops go in ``ctx.spawn``).

        Bind admin operations (``ctx.admin.bind(op_id, handler)``, giaannd/operations.py) and
        register metrics (``ctx.metrics``) here. A service named after a role (or ``membership``)
        must have bound every operation declared for it by the time ``start`` returns.
        Raising aborts startup: services already started are stopped and the daemon exits 1.
        """

    async def stop(self, graceful: bool) -> None:
        """Stop. ``graceful``: finish or hand off in-flight work and leave the cluster politely
        (the daemon bounds this by the drain timeout, less the shares the services stopped after
        this one reserve: ``drain_reserve_of``). Not graceful: close everything now."""

    def health(self) -> Mapping[str, Any]:
        """A small JSON-able summary for ``/v1/status`` (cheap, synchronous, never raises)."""


def drain_reserve_of(service: Service) -> float:
    """The share of ``node.drain-timeout-s`` (0 to 1) that the services stopped before ``service``
    must leave to its graceful stop: its optional ``drain_reserve`` attribute, 0 when absent.

    A service whose stop has work that decides the next start or the cluster's view of the node
    declares one (the storage role: its final snapshot; membership: the leave), so that a drain
    with no natural end stopped before it (the compute role's running jobs) cannot take the whole
    budget. It is a floor, not a slice: what a service does not use goes to those after it.
    """
    reserve = getattr(service, "drain_reserve", 0.0)
    return min(1.0, max(0.0, float(reserve))) if isinstance(reserve, (int, float)) else 0.0


@runtime_checkable
class ReclaimsSpace(Protocol):
    """A service whose files may include leftovers of writes that a crash or a full disk
    interrupted (a snapshot's temporary): never valid data, but they take space."""

    def reclaim_space(self) -> tuple[int, int]:
        """Delete those leftovers; returns (files, bytes) removed. The daemon calls it once it
        holds the data directory's lock and before it writes anything there (the lock's pid, the
        node id, the admin address, the incarnation...), so a disk the leftovers filled does not
        stop start-up. Synchronous and quick (unlinks only); raises ``OSError`` when it cannot."""


@dataclass
class ServiceContext:
    """What the daemon hands each service in ``start``."""

    config: Config
    node_id: uuid.UUID
    node_name: str
    metrics: Metrics
    admin: AdminApi
    #: Set when shutdown begins; background loops may wait on it.
    stopping: asyncio.Event
    #: Services started before this one, by name (e.g. compute finds membership here).
    services: Mapping[str, Service]
    _spawn: Callable[[Coroutine[Any, Any, Any], str, str], asyncio.Task[Any]]
    _request_stop: Callable[[str], None]
    service_name: str = ""
    #: The node runtime (identity, keyring, transports, topology, storage clients) when the
    #: daemon runs one (``giaannd`` always does; embedders and unit tests may not).
    runtime: NodeRuntime | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` under the daemon's TaskGroup. If it raises, the failure is logged, the
        service is marked failed and the daemon shuts down gracefully with exit status 1.
        It is cancelled at the end of shutdown if still running."""
        return self._spawn(coro, self.service_name, name)

    def request_stop(self, reason: str) -> None:
        """Ask the daemon to shut down gracefully (e.g. ``giaannctl node leave``)."""
        self._request_stop(reason)
