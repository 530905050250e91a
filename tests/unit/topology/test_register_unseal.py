"""``giaannctl node registers unseal`` (rebalance/unseal.py, "After a coordinator died"): the seals
a topology operation left when its coordinator died are dropped only under the cluster's topology
lock (cluster_lock.py), and only while no operation runs here and no placement override is in
force here. Before the route, nothing but the next operation reaching its register handoff (or an
operator deleting ``registers.seals`` with the node stopped) ever dropped them.

Real ``RegisterStore`` and ``ClusterLock`` over a fake register and control; then an in-process
cluster at R = 2, where the sealed node holds the lock's own register sealed too."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import register_owners
from giaannd.errors import AdminHTTPError
from giaannd.operations import OPERATIONS
from giaannd.storage.engine import register_store as rs
from giaannd.storage.engine.register_store import RegisterStore
from giaannd.storage.rebalance import register_handoff as rh
from giaannd.storage.rebalance.cluster_lock import LOCK_KEY, ClusterLock, OperationLockUnavailable
from giaannd.storage.rebalance.operations import OperationRegistry
from giaannd.storage.rebalance.routes import register_admin_routes
from tests.unit.topology.test_cluster_lock import MemoryRegister
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

EPOCH = "epoch-old"
KEYS = ["jobs/a/row", "jobs/b/row"]


class Binder:
    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def bind(self, op_id: str, handler: Any) -> None:
        self.handlers[op_id] = handler


class Control:
    """The cluster as the route sees it: this node ``s1`` with its register store, and the
    cluster's lock (a real ``ClusterLock`` over an in-memory register), or none (``lock=None``:
    the in-process control)."""

    def __init__(self, store: RegisterStore | None, lock: ClusterLock | None, *, override: bool = False,
                 local: str | None = "s1") -> None:
        self.store, self._lock = store, lock
        self._view = SimpleNamespace(local=local, override=("s1", "s3") if override else None,
                                     is_live=lambda name: True)
        self.unlocked: list[int] = []

    def view(self) -> Any:
        return self._view

    def service(self, name: str) -> Any:
        return SimpleNamespace(registers=self.store, node_name="s1", topology=None) if name == "s1" else None

    async def lock(self, op_id: str, kind: str) -> int | None:
        return None if self._lock is None else await self._lock.acquire(op_id, kind)

    async def unlock(self, token: int) -> None:
        assert self._lock is not None
        self.unlocked.append(token)
        assert await self._lock.release(token)


@pytest.fixture
def store(tmp_path: Any) -> Any:
    s = RegisterStore.open(tmp_path)
    s.seal(KEYS, EPOCH)  # left by an operation whose coordinator then died
    yield s
    s.close()


def _route(control: Control, registry: OperationRegistry | None = None) -> Any:
    binder = Binder()
    register_admin_routes(binder, control, registry)  # type: ignore[arg-type]
    return binder.handlers["node.registers.unseal"]


def _sealed(store: RegisterStore) -> bool:
    return all(store.sealed(k, EPOCH) for k in KEYS) and (store.path.with_name(rs.SEALS_FILE)).exists()


async def test_register_unseal_is_declared_for_giaannctl() -> None:
    op = OPERATIONS["node.registers.unseal"]
    assert (op.method, op.path, op.service, op.command) == ("POST", "/v1/node/registers/unseal", "storage",
                                                          "node registers unseal")


async def test_register_unseal_drops_a_dead_coordinators_seals_under_the_lock(store: RegisterStore) -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    await ClusterLock(reg, "s9", lambda n: n in live).acquire("join:aa->bb", "join")  # s9 then died
    held_during_unseal = []
    unseal = store.unseal

    def watched_unseal() -> int:
        held_during_unseal.append(reg.holder())
        return unseal()

    store.unseal = watched_unseal  # type: ignore[method-assign]
    control = Control(store, ClusterLock(reg, "s1", lambda n: n in live))
    answer = await _route(control)(None, {})
    assert answer == {"node": "s1", "unsealed": 2, "cluster_lock": "released"}
    assert not any(store.sealed(k, EPOCH) for k in KEYS)
    assert not store.path.with_name(rs.SEALS_FILE).exists()  # durably: a restart does not bring them back
    # the unseal ran holding the lock (no operation could seal this node meanwhile), which it took
    # over from the dead coordinator and then released
    holder = held_during_unseal[0]
    assert holder is not None and holder.coordinator == "s1" and holder.kind == "registers-unseal"
    assert reg.holder() is None and len(control.unlocked) == 1


async def test_register_unseal_refused_while_a_live_coordinator_holds_the_lock(store: RegisterStore) -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    token = await ClusterLock(reg, "s2", lambda n: n in live).acquire("removenode:aa->bb", "removenode")
    with pytest.raises(AdminHTTPError) as err:
        await _route(Control(store, ClusterLock(reg, "s1", lambda n: n in live)))(None, {})
    assert err.value.status == 409 and "s2" in err.value.message
    assert _sealed(store)  # its operation may still need them
    holder = reg.holder()
    assert holder is not None and holder.token == token  # untouched


async def test_register_unseal_refused_when_the_lock_cannot_be_reached(store: RegisterStore) -> None:
    reg = MemoryRegister()
    reg.down = True  # an operation may be running without the lock: the node cannot tell
    with pytest.raises(AdminHTTPError) as err:
        await _route(Control(store, ClusterLock(reg, "s1", lambda n: True)))(None, {})
    assert err.value.status == 503 and _sealed(store)


class _LostAnswer(MemoryRegister):
    """The lock's write takes effect, then its answers are lost (``RegisterUnavailable``)."""

    async def cas(self, key: str, expect: Any, value: bytes = b"", timeout_s: float | None = None) -> Any:
        out = await super().cas(key, expect, value, timeout_s)
        if value:
            raise RegisterUnavailable("1 of 3 owners answered (need 2)")
        return out


async def test_register_unseal_gives_back_a_lock_whose_write_was_in_doubt(store: RegisterStore) -> None:
    if "token" not in inspect.signature(OperationLockUnavailable).parameters:
        pytest.skip("this cluster_lock.py reports no write in doubt")
    reg = MemoryRegister()
    lost = _LostAnswer()
    lost.values = reg.values  # one register: the write lands, the answer does not
    control = Control(store, ClusterLock(lost, "s1", lambda n: True))
    with pytest.raises(AdminHTTPError) as err:
        await _route(control)(None, {})
    assert err.value.status == 503 and _sealed(store)
    assert reg.holder() is None  # left held, every other node's operation would be refused


class _Running:
    kind, state = "join", "cutover"


async def test_register_unseal_refused_while_an_operation_runs_here(store: RegisterStore) -> None:
    registry = OperationRegistry()
    registry.current = _Running()  # type: ignore[assignment]
    reg = MemoryRegister()
    control = Control(store, ClusterLock(reg, "s1", lambda n: True))
    with pytest.raises(AdminHTTPError) as err:
        await _route(control, registry)(None, {})
    assert err.value.status == 409 and "join, cutover" in err.value.message
    # refused before it takes the lock: it would take over a lock this node's running operation
    # wrote in doubt (test_cluster_lock_sealed_write.py)
    assert _sealed(store) and reg.holder() is None and control.unlocked == []


async def test_register_unseal_refused_while_a_placement_override_is_in_force_here(store: RegisterStore) -> None:
    reg = MemoryRegister()
    control = Control(store, ClusterLock(reg, "s1", lambda n: True), override=True)
    with pytest.raises(AdminHTTPError) as err:
        await _route(control)(None, {})
    assert err.value.status == 409 and "override" in err.value.message
    assert _sealed(store) and reg.holder() is None


async def test_register_unseal_with_the_in_process_control_and_after_an_ended_operation(store: RegisterStore) -> None:
    registry = OperationRegistry()
    registry.current = SimpleNamespace(kind="join", state="failed")  # type: ignore[assignment]
    assert await _route(Control(store, None), registry)(None, {}) == {
        "node": "s1", "unsealed": 2, "cluster_lock": "none"}
    assert not any(store.sealed(k, EPOCH) for k in KEYS)
    # nothing sealed: answered all the same
    assert (await _route(Control(store, None))(None, {}))["unsealed"] == 0


async def test_register_unseal_on_a_node_without_registers_is_404() -> None:
    with pytest.raises(AdminHTTPError) as err:
        await _route(Control(None, None, local=None))(None, {})
    assert err.value.status == 404


class _NodeControl:
    """Node ``me`` of an in-process cluster as its daemon's control shows it to the route: its
    view, its storage service and the lock over its own register client (daemon_control.py)."""

    def __init__(self, cluster: Cluster, me: str) -> None:
        self.cluster, self.me = cluster, me
        client = cluster.services[me].register_client
        assert client is not None
        self.cluster_lock = ClusterLock(client, me, lambda name: name in cluster.services)

    def view(self) -> Any:
        return self.cluster.topologies[self.me]

    def service(self, name: str) -> Any:
        return self.cluster.services[name] if name == self.me else None

    async def lock(self, op_id: str, kind: str) -> int | None:
        return await self.cluster_lock.acquire(op_id, kind)

    async def unlock(self, token: int) -> None:
        assert await self.cluster_lock.release(token)


@pytest.mark.parametrize("coordinator", ["ghost", "live"])
async def test_register_unseal_when_the_lock_register_itself_is_sealed_here(tmp_path: Any, coordinator: str) -> None:
    """In process, real registers, R = 2 (a quorum is both owners): a decommission sealed an owner
    of the topology lock's register and of a job's register, and its coordinator died with the
    lock held. Both registers refuse everything, for good: the lock too, so the route decides from
    the sealed node's own state of the lock's register (no quorum can have gone without it). A
    holder that is a live member keeps the seals (409)."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        topology = cluster.client_topology
        leaver = register_owners(topology, LOCK_KEY)[0]
        key = next(k for k in (f"jobs/j{i}/row" for i in range(64)) if leaver in register_owners(topology, k))
        client = cluster.services[leaver].register_client
        assert client is not None
        first = await client.cas(key, None)
        assert (await client.cas(key, first.version, b"v1")).ok
        holder = "ghost" if coordinator == "ghost" else next(n for n in cluster.services if n != leaver)
        await ClusterLock(client, holder, lambda name: name in cluster.services).acquire(
            f"decommission:{leaver}", "decommission")  # then its coordinator is gone (or not)
        members = [(m.name, m.weight) for m in topology.placement.members]
        await rh.serve(cluster.services[leaver], rh.RegisterExport(members, [m for m in members if m[0] != leaver], 2))
        for sealed in (key, LOCK_KEY):
            with pytest.raises(RegisterUnavailable):
                await client.read(sealed, timeout_s=5)
        route = _route(_NodeControl(cluster, leaver))  # type: ignore[arg-type]
        if coordinator == "live":
            with pytest.raises(AdminHTTPError) as err:
                await route(None, {})
            assert err.value.status == 409 and holder in err.value.message
            with pytest.raises(RegisterUnavailable):
                await client.read(key, timeout_s=5)
            return
        answer = await route(None, {})
        assert answer["unsealed"] >= 1 and answer["cluster_lock"] == "released"
        now = await client.cas(key, None, timeout_s=5)
        assert now.value == b"v1" and (await client.cas(key, now.version, b"v2")).ok
        assert (await client.read(LOCK_KEY)).value == b""  # the dead coordinator's lock is gone
        assert not (cluster.storage_dir(leaver) / "registers" / rs.SEALS_FILE).exists()
    finally:
        await cluster.close()


async def test_register_store_unseal_key_drops_one_seal_durably(tmp_path: Any) -> None:
    s = RegisterStore.open(tmp_path)
    s.seal(["a", "b"], EPOCH)
    assert s.unseal_key("a") and not s.unseal_key("a")
    s.close()
    s = RegisterStore.open(tmp_path)
    assert not s.sealed("a", EPOCH) and s.sealed("b", EPOCH)
    assert s.unseal_key("b") and not (tmp_path / rs.SEALS_FILE).exists()
    s.close()
