"""The Daemon in-process: service lifecycle, drain budget, failures, admin API auth and routes.

Real aiohttp server on a loopback port chosen by the OS; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from giaannd.config import Config, load_config
from giaannd.daemon import Daemon
from giaannd.errors import AdminHTTPError, ConfigError, CorruptFileError, GiaannError
from giaannd.operations import operations_of
from giaannd.service import Service, ServiceContext

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
WAIT_S = 10


class Recorder(Service):
    """A service that records its lifecycle calls and binds ``binds`` (operation ids) to its item
    handler; behaviour is tuned per test."""

    def __init__(self, name: str, log: list[str], *, stop_delay_s: float = 0.0,
                 fail_start: bool = False, fail_task: bool = False, binds: Sequence[str] = ()) -> None:
        self.name = name
        self.log = log
        self.binds = binds
        self.stop_delay_s = stop_delay_s
        self.fail_start = fail_start
        self.fail_task = fail_task
        self.ctx: ServiceContext | None = None

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.log.append(f"start {self.name} after={sorted(ctx.services)}")
        if self.fail_start:
            raise RuntimeError("boom at start")
        for op_id in self.binds:
            ctx.admin.bind(op_id, self._item)
        if self.fail_task:
            ctx.spawn(self._crash(), "crash")

    async def _crash(self) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("background boom")

    async def _item(self, request: Any, params: Mapping[str, str]) -> Any:
        item = params.get("column", "")
        if item == "missing":
            raise AdminHTTPError(404, "no such item", "not_found")
        if item == "bug":
            raise ValueError("handler bug")
        return {"service": self.name, "item": item}

    async def stop(self, graceful: bool) -> None:
        self.log.append(f"stop {self.name} graceful={graceful}")
        if graceful and self.stop_delay_s:
            await asyncio.sleep(self.stop_delay_s)

    def health(self) -> Mapping[str, Any]:
        return {"items": 3}


def _config(tmp_path: Path, **sets: str) -> Config:
    overrides = [f"node.data-dir={tmp_path / 'data'}", "admin.listen=127.0.0.1:0",
                 "node.name=test-node", "node.roles=[]"]
    return load_config(environ={}, overrides=overrides + [f"{k}={v}" for k, v in sets.items()])


@asynccontextmanager
async def running(daemon: Daemon) -> AsyncIterator[asyncio.Task[int]]:
    task = asyncio.create_task(daemon.run())
    async with asyncio.timeout(WAIT_S):
        while daemon.state == "starting" and not task.done():
            await asyncio.sleep(0.01)
    try:
        yield task
    finally:
        daemon.request_stop("test over")
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(task, return_exceptions=True)


def _url(daemon: Daemon, path: str) -> str:
    assert daemon.admin_address is not None
    host, port = daemon.admin_address
    return f"http://{host}:{port}{path}"


def _auth(cfg: Config) -> dict[str, str]:
    token = cfg.data_path("admin.token").read_text().strip()
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.asyncio
async def test_daemon_starts_in_order_and_stops_in_reverse(tmp_path: Path) -> None:
    log: list[str] = []
    cfg = _config(tmp_path)
    daemon = Daemon(cfg, [Recorder("a", log), Recorder("b", log)], handle_signals=False)
    async with running(daemon) as task:
        assert daemon.state == "running"
        status = daemon.status()
        assert status["services"]["a"] == {"items": 3, "state": "running"}
        assert (tmp_path / "data" / "admin.addr").read_text().startswith("http://127.0.0.1:")
    assert task.result() == 0
    assert log == ["start a after=[]", "start b after=['a']",
                   "stop b graceful=True", "stop a graceful=True"]
    assert daemon.state == "stopped"
    assert not (tmp_path / "data" / "admin.addr").exists()


@pytest.mark.asyncio
async def test_daemon_drain_timeout_forces_slow_service(tmp_path: Path) -> None:
    log: list[str] = []
    cfg = _config(tmp_path, **{"node.drain-timeout-s": "0.2"})
    daemon = Daemon(cfg, [Recorder("fast", log), Recorder("slow", log, stop_delay_s=30)],
                    handle_signals=False)
    async with running(daemon) as task:
        pass
    assert task.result() == 0
    assert log[-3:] == ["stop slow graceful=True", "stop slow graceful=False",
                        "stop fast graceful=True"]
    assert daemon.status()["services"]["slow"]["state"] == "killed"


class EndOfStop(Recorder):
    """A service whose graceful stop has end-of-stop work that takes a few loop turns (the storage
    role's final snapshot runs in a worker thread; membership's leave waits while it spreads);
    ``drain_reserve`` is its declared share of the budget (giaannd/service.py)."""

    def __init__(self, name: str, log: list[str], work: str, drain_reserve: float) -> None:
        super().__init__(name, log)
        self.work = work
        self.drain_reserve = drain_reserve

    async def stop(self, graceful: bool) -> None:
        await super().stop(graceful)
        if graceful:
            await asyncio.to_thread(lambda: None)
            await asyncio.to_thread(lambda: None)
            self.log.append(f"{self.work} {self.name}")


class EndlessDrain(Recorder):
    """The compute role with a job that never finishes: its graceful stop waits until cancelled."""

    async def stop(self, graceful: bool) -> None:
        await super().stop(graceful)
        if graceful:
            await asyncio.Event().wait()


@pytest.mark.asyncio
async def test_daemon_drain_leaves_reserved_shares_to_the_services_stopped_after(tmp_path: Path) -> None:
    """A node with both roles (named apart from the real ones, whose admin operations these do
    not bind): compute's drain (a job that never ends) may not use the whole
    ``node.drain-timeout-s``: it is cut where the shares the storage role and membership reserve
    begin, so the final snapshot is written and the leave announced. It used to take the whole
    budget: storage was then cancelled before its snapshot (the restart replays the whole log) and
    membership before its leave."""
    log: list[str] = []
    cfg = _config(tmp_path, **{"node.drain-timeout-s": "2.0"})
    services = [EndOfStop("gossip", log, "leave", 0.05), EndOfStop("store", log, "snapshot", 0.5),
                EndlessDrain("jobs", log)]
    daemon = Daemon(cfg, services, handle_signals=False)
    async with running(daemon) as task:
        pass
    assert task.result() == 0
    stops = [line for line in log if not line.startswith("start")]
    assert stops == ["stop jobs graceful=True", "stop jobs graceful=False",
                     "stop store graceful=True", "snapshot store",
                     "stop gossip graceful=True", "leave gossip"]
    states = {name: s["state"] for name, s in daemon.status()["services"].items()}
    assert states == {"jobs": "killed", "store": "stopped", "gossip": "stopped"}


@pytest.mark.asyncio
async def test_daemon_force_stop_skips_drain(tmp_path: Path) -> None:
    log: list[str] = []
    daemon = Daemon(_config(tmp_path), [Recorder("slow", log, stop_delay_s=30)],
                    handle_signals=False)
    async with running(daemon) as task:
        daemon.request_stop("first")
        await asyncio.sleep(0.1)
        daemon.force_stop("second")
    assert task.result() == 130
    assert log[-2:] == ["stop slow graceful=True", "stop slow graceful=False"]


@pytest.mark.asyncio
async def test_daemon_failed_start_stops_started_services(tmp_path: Path) -> None:
    log: list[str] = []
    services = [Recorder("ok", log), Recorder("bad", log, fail_start=True), Recorder("never", log)]
    daemon = Daemon(_config(tmp_path), services, handle_signals=False)
    async with asyncio.timeout(WAIT_S):
        code = await daemon.run()
    assert code == 1
    assert log == ["start ok after=[]", "start bad after=['ok']",
                   "stop bad graceful=True", "stop ok graceful=True"]


@pytest.mark.asyncio
async def test_daemon_failed_background_task_stops_with_exit_1(tmp_path: Path) -> None:
    log: list[str] = []
    daemon = Daemon(_config(tmp_path), [Recorder("x", log, fail_task=True)],
                    handle_signals=False)
    async with asyncio.timeout(WAIT_S):
        code = await daemon.run()
    assert code == 1
    health = daemon.status()["services"]["x"]
    assert health["state"] == "failed" and "background boom" in health["error"]


@pytest.mark.asyncio
async def test_daemon_refuses_corrupt_node_id_and_shared_data_dir(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    Path(cfg.node.data_dir).mkdir()
    cfg.data_path("node-id").write_text("garbage")
    with pytest.raises(CorruptFileError):
        async with asyncio.timeout(WAIT_S):
            await Daemon(cfg, handle_signals=False).run()
    cfg.data_path("node-id").unlink()
    first = Daemon(cfg, handle_signals=False)
    async with running(first):
        with pytest.raises(GiaannError, match="is in use by pid"):
            async with asyncio.timeout(WAIT_S):
                await Daemon(cfg, handle_signals=False).run()


@pytest.mark.asyncio
async def test_daemon_configured_token_file_must_exist(tmp_path: Path) -> None:
    cfg = _config(tmp_path, **{"admin.token-file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError) as info:
        async with asyncio.timeout(WAIT_S):
            await Daemon(cfg, handle_signals=False).run()
    assert info.value.path == "$.admin.token-file"


@pytest.mark.asyncio
async def test_admin_auth_routes_and_errors(tmp_path: Path) -> None:
    log: list[str] = []
    cfg = _config(tmp_path)
    daemon = Daemon(cfg, [Recorder("svc", log, binds=["column.info"])], handle_signals=False)
    async with running(daemon), aiohttp.ClientSession() as http:
        auth = _auth(cfg)
        async def get(path: str, headers: dict[str, str] | None = None,
                      method: str = "GET") -> tuple[int, Any]:
            async with http.request(method, _url(daemon, path), headers=headers) as resp:
                ctype = resp.headers.get("Content-Type", "")
                return resp.status, await (resp.json() if "json" in ctype else resp.text())

        status, body = await get("/v1/status", auth)
        assert status == 200
        assert body["node_name"] == "test-node" and body["state"] == "running"
        assert body["node_id"] == cfg.data_path("node-id").read_text().strip()
        assert (await get("/v1/columns/thing"))[0] == 401
        assert (await get("/v1/status"))[0] == 200  # a read-only view: tokenless from loopback
        assert (await get("/v1/status", {"Authorization": "Bearer wrong"}))[0] == 401
        assert (await get("/v1/nosuch"))[0] == 401  # no probing without the token
        assert await get("/v1/columns/thing", auth) == (200, {"service": "svc", "item": "thing"})
        assert (await get("/v1/columns/missing", auth))[1]["code"] == "not_found"
        assert (await get("/v1/columns/bug", auth))[0] == 500
        assert (await get("/v1/nosuch", auth))[1]["code"] == "not_served"
        assert (await get("/v1/status", auth, method="DELETE"))[0] == 405
        assert (await get("/v1/members", auth))[0] == 404
        daemon_ctx = daemon._slots[0].service.ctx  # type: ignore[attr-defined]
        daemon_ctx.admin.set_members_source(lambda: [{"name": "test-node", "state": "alive"}])
        assert (await get("/v1/members", auth))[1] == {
            "members": [{"name": "test-node", "state": "alive"}]}
        status, metrics = await get("/metrics")  # tokenless from loopback
        assert status == 200
        assert 'giaannd_admin_requests_total{method="GET",route="/v1/status",status="200"}' \
            in metrics
        assert 'giaannd_service_up{service="svc"} 1.0' in metrics
        status, page = await get("/")
        assert status == 200 and "test-node" in page and "alive" in page
        with pytest.raises(ValueError, match="already bound"):
            daemon_ctx.admin.bind("column.info", daemon_ctx.admin._get_status)
        with pytest.raises(ValueError, match="not declared"):
            daemon_ctx.admin.bind("svc.item", daemon_ctx.admin._get_status)


class Gated(Service):
    """A service whose start and stop wait for the test, so the daemon can be caught starting
    and stopping."""

    name = "gated"

    def __init__(self) -> None:
        self.started, self.may_start = asyncio.Event(), asyncio.Event()
        self.stopping, self.may_stop = asyncio.Event(), asyncio.Event()

    async def start(self, ctx: ServiceContext) -> None:
        self.started.set()
        await self.may_start.wait()

    async def stop(self, graceful: bool) -> None:
        self.stopping.set()
        await self.may_stop.wait()

    def health(self) -> Mapping[str, Any]:
        return {}


@pytest.mark.asyncio
async def test_admin_health_is_tokenless_and_follows_the_daemon(tmp_path: Path) -> None:
    """GET /v1/health (issue 18.4): no token, 200 only when ready; starting, drained (node drain)
    and stopping answer 503."""
    gated, runtime = Gated(), types.SimpleNamespace(draining=False)
    daemon = Daemon(_config(tmp_path), [gated], handle_signals=False, runtime=runtime)  # type: ignore[arg-type]
    task = asyncio.create_task(daemon.run())
    try:
        async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as http:
            async def health() -> tuple[int, Any]:
                async with http.get(_url(daemon, "/v1/health")) as resp:
                    return resp.status, await resp.json()

            await gated.started.wait()
            assert await health() == (503, {"status": "starting"})
            gated.may_start.set()
            while daemon.state != "running":
                await asyncio.sleep(0.01)
            assert await health() == (200, {"status": "ready"})
            assert daemon.status()["draining"] is False
            runtime.draining = True  # what `giaannctl node drain` sets
            assert await health() == (503, {"status": "draining"})
            assert daemon.status()["draining"] is True
            runtime.draining = False
            async with http.get(_url(daemon, "/v1/keys")) as resp:
                assert resp.status == 401  # the rest of /v1 still needs the token
            daemon.request_stop("test")
            await gated.stopping.wait()
            assert await health() == (503, {"status": "draining"})
            gated.may_stop.set()
            assert await task == 0
    finally:
        gated.may_start.set()
        gated.may_stop.set()
        daemon.request_stop("test over")
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_admin_metrics_require_token(tmp_path: Path) -> None:
    cfg = _config(tmp_path, **{"admin.metrics-require-token": "true"})
    daemon = Daemon(cfg, handle_signals=False)
    async with running(daemon), aiohttp.ClientSession() as http:
        async with http.get(_url(daemon, "/metrics")) as resp:
            assert resp.status == 401
        for view in ("/", "/v1/status", "/v1/members"):  # the status page and what it polls
            async with http.get(_url(daemon, view)) as resp:
                assert resp.status == 401, view
        async with http.get(_url(daemon, "/metrics"), headers=_auth(cfg)) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")


@pytest.mark.asyncio
async def test_daemon_status_reports_roles(tmp_path: Path) -> None:
    cfg = _config(tmp_path, **{"node.roles": '["storage", "compute"]'})
    storage_ops = [op.id for op in operations_of("storage")]
    daemon = Daemon(cfg, [Recorder("storage", [], binds=storage_ops)], handle_signals=False,
                    unavailable_roles={"compute": "not built"})
    async with running(daemon):
        assert daemon.status()["roles"] == {"storage": "running",
                                            "compute": "unavailable: not built"}


@pytest.mark.asyncio
async def test_daemon_role_leaving_an_operation_unbound_fails_startup(tmp_path: Path) -> None:
    log: list[str] = []
    storage_ops = [op.id for op in operations_of("storage")]
    daemon = Daemon(_config(tmp_path, **{"node.roles": '["storage"]'}),
                    [Recorder("storage", log, binds=storage_ops[1:])], handle_signals=False)
    async with asyncio.timeout(WAIT_S):
        code = await daemon.run()
    assert code == 1
    health = daemon.status()["services"]["storage"]
    assert health["state"] == "failed" and f"binding its admin operations {storage_ops[0]} " in health["error"]
    assert log == ["start storage after=[]", "stop storage graceful=True"]
