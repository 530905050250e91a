"""The topology verbs on the admin API (``giaannctl node ...``): thin glue that builds a
``Rebalance`` (rebalance/operations.py) from the request and the cluster view, starts it in the
``OperationRegistry`` and answers at once with its progress (docs/topology.md, "Admin API").
Their routes and arguments are declared in giaannd/operations.py; this module binds handlers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.errors import AdminHTTPError
from giaannd.json_body import json_object
from giaannd.operations import Binder, Handler
from giaannd.storage.rebalance.cluster_lock import OperationLockBusy, OperationLockUnavailable
from giaannd.storage.rebalance.join_generation import JoinGeneration
from giaannd.storage.rebalance.operations import (
    ClusterControl,
    DataLossError,
    OperationRegistry,
    Rebalance,
    TopologyOpError,
    members_after,
)
from giaannd.storage.rebalance.unseal import SealsInUse, unseal_left
from giaannd.storage.repair.local import repair

__all__ = ["register_admin_routes"]


def register_admin_routes(admin: Binder, control: ClusterControl, registry: OperationRegistry | None = None,
                          *, local_node: Callable[[], StorageNode | None] | None = None,
                          repair_fn: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                          generation: JoinGeneration | None = None) -> OperationRegistry:
    """Bind the topology verbs of ``giaannctl node ...`` (operation ids) on the admin API:

    ===========================  ==================================================================
    ``node.decommission``        stream this node's columns away, then switch (the daemon then
                                 leaves membership); body optional: ``{"rate_bytes_s": N}``
    ``node.join-ring``           this node (``local_node()``) joins the placement set: the old
                                 owners stream it its share (remote sources); body optional:
                                 ``{"rate_bytes_s": N}``
    ``node.replace``             ``{"node_id": DEAD}``: this node takes over a dead member
                                 (remove DEAD + add this node)
    ``node.removenode``          ``{"node_id": NAME}``: re-replicate a dead member's columns from
                                 the survivors and drop it
    ``node.repair``              hints, then rebuild missing batches, then compare
    ``node.topology.status``     the running / last operation's progress
    ``node.topology.pause``,     act on the running / last operation; ``rate`` takes
    ``.resume``, ``.cancel``,    ``{"rate_bytes_s": N or null}``
    ``.rate``
    ``node.registers.unseal``    drop the register seals a dead coordinator left here, under the
                                 cluster's lock (unseal.py, "After a coordinator died")
    ===========================  ==================================================================

    Verbs answer at once with the operation's progress (it runs in the background); re-issuing a
    verb returns the same operation. Errors: 400 bad body (not a JSON object, a field the verb does not
    take, a rate that is not a number > 0 or null), 404 unknown member / nothing running,
    409 another operation is running (here, or anywhere in the cluster: the operation lock,
    cluster_lock.py), 422 the operation would lose data. ``local_node`` gives this
    node's own ``StorageNode`` (name, data address, weight) for join / replace; without it (or
    when it returns None: not a storage node) those verbs answer 404. Sources need not be local:
    the operation drives remote ones through their stream endpoints.
    """
    reg = registry or OperationRegistry()

    async def start(op: Rebalance) -> dict[str, Any]:
        try:
            return (await reg.begin(op)).progress()
        except (TopologyOpError, OperationLockBusy) as exc:  # here, or in the cluster (cluster_lock.py)
            raise AdminHTTPError(409, str(exc), "conflict") from None

    async def decommission(request: Any, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("rate_bytes_s",), null_is_empty=True)
        view = control.view()
        if view.local is None or view.local not in view:
            raise AdminHTTPError(404, "this node is not a storage member", "not_served")
        others = tuple(n for n in view.names if n != view.local)  # stream from here: the source is local
        # This node coordinates and sources its own decommission: with fixed stream ids, one killed
        # mid-stream meets its old streams when the verb is run again after its restart (refused:
        # the new sender's cuts cannot continue them); the operation then fails and discards them on
        # their receivers, and the next run opens new ones. With an id of its own each run, the old
        # streams' rows made every receiver refuse the verb until its idle sweep (2 h).
        own = own_streams() if generation is not None else {}
        return await start(Rebalance(control, "decommission", members_after(view, remove=[view.local]),
                               avoid_sources=others, rate_bytes_s=rate_of(body), **own))

    def rate_of(body: Mapping[str, Any]) -> float | None:
        rate = body.get("rate_bytes_s")
        # not a bool (an int to Python), and > 0: NaN (which JSON parsing accepts) would fail the
        # streams' throttle later, and <= 0 would be taken as unthrottled (null says that)
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
            raise AdminHTTPError(400, "rate_bytes_s must be a number > 0 (bytes/s) or null", "bad_request")
        return rate

    def me() -> StorageNode:
        node = local_node() if local_node is not None else None
        if node is None:
            raise AdminHTTPError(404, "this node is not a storage node: it cannot join", "not_served")
        return node

    def dead_member(body: Mapping[str, Any], view: ClusterView) -> str:
        name = body.get("node_id")
        if not isinstance(name, str) or name not in view:
            raise AdminHTTPError(404, f"unknown storage member {name!r}", "not_found")
        if view.is_live(name):
            raise AdminHTTPError(409, f"{name} is alive: decommission it instead", "conflict")
        return name

    async def start_checked(op: Rebalance) -> dict[str, Any]:
        try:
            op.check_dead_owners()  # refuse data loss before starting
        except DataLossError as exc:
            raise AdminHTTPError(422, str(exc), "data_loss") from None
        return await start(op)

    async def removenode(request: Any, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("node_id", "rate_bytes_s"), null_is_empty=True)
        view = control.view()
        name = dead_member(body, view)
        return await start_checked(Rebalance(control, "removenode", members_after(view, remove=[name]),
                                       rate_bytes_s=rate_of(body)))

    def own_streams() -> dict[str, Any]:
        # This node coordinates its own join (or replace): fixed stream ids, so that if it restarts
        # mid-join the next one resumes the streams the sources still run (Rebalance.stream_nonce);
        # new ones once an abandoned operation's were discarded (join_generation.py).
        if generation is None:
            return {"stream_nonce": 0}
        try:
            return {"stream_nonce": generation.current(), "after_discard": generation.advance}
        except ValueError as exc:
            raise AdminHTTPError(500, str(exc), "bad_state") from None

    async def join(request: Any, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("rate_bytes_s",), null_is_empty=True)
        node, view = me(), control.view()
        return await start(Rebalance(control, "join", members_after(view, add=[node]), rate_bytes_s=rate_of(body),
                               **own_streams()))

    async def replace(request: Any, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("node_id", "rate_bytes_s"), null_is_empty=True)
        node, view = me(), control.view()
        name = dead_member(body, view)
        if name == node.name:
            raise AdminHTTPError(409, "a node cannot replace itself", "conflict")
        return await start_checked(Rebalance(control, "replace", members_after(view, add=[node], remove=[name]),
                                       rate_bytes_s=rate_of(body), **own_streams()))

    async def do_repair(request: Any, params: Mapping[str, str]) -> Any:
        return await (repair_fn() if repair_fn is not None else repair(control))

    def current() -> Rebalance:
        if reg.current is None:
            raise AdminHTTPError(404, "no topology operation has run", "not_found")
        return reg.current

    async def status(request: Any, params: Mapping[str, str]) -> Any:
        return current().progress()

    def act(what: Callable[[Rebalance], object]) -> Handler:
        async def handler(request: Any, params: Mapping[str, str]) -> Any:
            op = current()
            what(op)
            return op.progress()
        return handler

    async def set_rate(request: Any, params: Mapping[str, str]) -> Any:
        op = current()
        op.set_rate(rate_of(await json_object(request, ("rate_bytes_s",), null_is_empty=True)))
        return op.progress()

    async def unseal_registers(request: Any, params: Mapping[str, str]) -> Any:
        view = control.view()
        service = control.service(view.local) if view.local is not None else None
        if service is None or service.registers is None:
            raise AdminHTTPError(404, "this node keeps no registers (not a storage member)", "not_served")

        def running() -> str | None:
            op = reg.current
            return None if op is None or op.state in ("done", "failed", "cancelled") else f"{op.kind}, {op.state}"

        try:
            unsealed, locked = await unseal_left(service, control, running=running,
                                                 override=lambda: view.override is not None,
                                                 is_live=view.is_live)
        except (OperationLockBusy, SealsInUse) as exc:
            raise AdminHTTPError(409, str(exc), "conflict") from None
        except OperationLockUnavailable as exc:  # an operation may run without it: not here
            raise AdminHTTPError(503, f"{exc}: seals are dropped only under the lock", "unavailable") from None
        return {"node": view.local, "unsealed": unsealed, "cluster_lock": "released" if locked else "none"}

    handlers: dict[str, Handler] = {
        "node.decommission": decommission, "node.removenode": removenode, "node.join-ring": join,
        "node.replace": replace, "node.repair": do_repair, "node.topology.status": status,
        "node.topology.pause": act(lambda op: op.pause()), "node.topology.resume": act(lambda op: op.resume()),
        "node.topology.cancel": act(lambda op: op.cancel()), "node.topology.rate": set_rate,
        "node.registers.unseal": unseal_registers}
    for op_id, handler in handlers.items():
        admin.bind(op_id, handler)
    return reg
