"""The daemon's lifecycle: startup -> run -> shutdown over a set of role services.

Shape follows uvicorn's ``Server`` (STYLE.md item 24):

- **startup**: lock the data directory, let services delete leftovers of interrupted writes
  (``ReclaimsSpace``: a failed snapshot's temporary that filled the disk) before anything is
  written, load or mint the node id, read the admin token, start the admin API, then start each
  service in order. ``READY=1`` goes to systemd only after every
  service's ``start`` returned, i.e. once the node has joined and is serving.
- **run**: wait on an ``Event`` (no polling) until a signal, a failed service task or an admin
  request asks to stop. A watchdog task pings ``WATCHDOG=1`` at half of ``WATCHDOG_USEC``.
- **shutdown**: ``STOPPING=1``, then services stop in reverse order with ``stop(graceful=True)``
  sharing one ``node.drain-timeout-s`` budget. Each may use what is left of it less the shares
  the services still to stop reserve (``drain_reserve_of``: the storage role's final snapshot,
  membership's leave), so the compute role's drain, which has no natural end (running jobs),
  cannot leave storage nothing. A service that overruns its part (or every
  service, after a second SIGINT) is cancelled and given ``stop(graceful=False)`` with a short
  bound. The admin API stops last so ``giaannctl node status`` can watch the drain.

Services and background work run under one ``asyncio.TaskGroup``; a background task that raises
is logged, marks its service failed and triggers a graceful shutdown with exit status 1, rather
than tearing the group down mid-flight.

Exit statuses: 0 clean stop, 1 a service failed (at run time, or its graceful stop raised: e.g. the
final snapshot failed), 2 an error a restart cannot fix (``ConfigError``, ``HostEnvironmentError``,
``CorruptDataError``; an ``OSError`` at start-up whose errno says the host refuses, ``HOST_ERRNOS``:
a full or read-only disk, permissions), 130 forced by a second SIGINT (128 + SIGINT, the shell
convention).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import inspect
import logging
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from giaannd import __version__
from giaannd.admin.api import AdminApi
from giaannd.atomic_file import atomic_write_bytes, remove_stale_temporaries
from giaannd.config import Config, split_listen
from giaannd.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    HOST_ERRNOS,
    ConfigError,
    CorruptFileError,
    GiaannError,
    HostEnvironmentError,
)
from giaannd.metrics import Metrics
from giaannd.operations import ADMIN_ADDR_FILE, ADMIN_TOKEN_FILE
from giaannd.runtime.loop_watch import LAG_BUCKETS_S, LoopWatch
from giaannd.sdnotify import SdNotifier, watchdog_interval_s
from giaannd.service import ReclaimsSpace, Service, ServiceContext, drain_reserve_of

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime

__all__ = [
    "EXIT_FORCED",
    "ROLE_FACTORIES",
    "Daemon",
    "build_role_services",
    "load_or_create_node_id",
]

log = logging.getLogger(__name__)

EXIT_FORCED = 128 + signal.SIGINT
#: Bound on ``stop(graceful=False)``: it must only close sockets and files, so seconds suffice;
#: beyond this the daemon exits anyway rather than hang a systemd stop job.
FORCE_STOP_TIMEOUT_S = 5.0
LOCK_FILE = "lock"
#: Mode of the directories the daemon creates for its state (the data directory, a node-id file's
#: directory): the daemon's user and group only, as systemd's ``StateDirectoryMode=0750``.
STATE_DIR_MODE = 0o750

#: Role name -> "module:function" building its service. Imported lazily so a build without a
#: role's package still runs the others. The function's contract:
#: ``create_service(config: Config) -> Service`` or, to share the node's transports and cluster
#: view, ``create_service(config: Config, runtime: NodeRuntime) -> Service`` (a parameter named
#: ``runtime`` receives the ``giaannd.runtime.node.NodeRuntime``). The service's ``name`` is the role
#: name, so ``/v1/status`` can report the role's state. Both roles go through adapters that
#: build ``StorageService`` / ``ComputeService`` on the runtime (giaannd/services/roles.py).
ROLE_FACTORIES: dict[str, str] = {
    "storage": "giaannd.services.roles:create_storage_service",
    "compute": "giaannd.services.roles:create_compute_service",
}


def build_role_services(config: Config, runtime: NodeRuntime | None = None
                        ) -> tuple[list[Service], dict[str, str]]:
    """Create the services for ``config.node.roles``; factories with a ``runtime`` parameter get
    ``runtime`` (see ``ROLE_FACTORIES``).

    Returns:
        (services, unavailable): the services built, and role -> reason for roles this build
        cannot run yet (their module is absent). Reported in ``/v1/status``, never hidden.
    """
    services: list[Service] = []
    unavailable: dict[str, str] = {}
    # In ROLE_FACTORIES' order however the roles are listed: services start in order and stop in
    # reverse, and compute must stop before storage (its jobs drain their writes into it).
    for role in sorted(config.node.roles, key=list(ROLE_FACTORIES).index):
        module_name, _, attr = ROLE_FACTORIES[role].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # a missing dependency inside the role is a real error
            unavailable[role] = f"not built into this daemon ({module_name} is absent)"
            continue
        factory = getattr(module, attr, None)
        if factory is None:
            unavailable[role] = f"{module_name} has no {attr}()"
            continue
        takes_runtime = "runtime" in inspect.signature(factory).parameters
        services.append(factory(config, runtime=runtime) if takes_runtime else factory(config))
    return services, unavailable


def load_or_create_node_id(path: Path) -> uuid.UUID:
    """Read this node's UUID from ``path``, creating it (atomically, fsynced) if absent, and its
    directory as the data directory is (mode ``STATE_DIR_MODE``, parents too): ``node-id-file``
    may lie outside the data directory.

    Raises:
        CorruptFileError: the file exists but is not a UUID. It is never overwritten: a new
            identity would orphan the replicas the cluster believes this node holds.
        OSError: the path cannot be read or created.
    """
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        path.parent.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
        node_id = uuid.uuid4()
        atomic_write_bytes(path, f"{node_id}\n".encode("ascii"))
        log.info("created node id node_id=%s file=%s", node_id, path)
        return node_id
    except UnicodeDecodeError:
        raise CorruptFileError(str(path), "not ASCII text; expected a UUID") from None
    try:
        return uuid.UUID(text)
    except ValueError:
        raise CorruptFileError(
            str(path), f"expected a UUID, found {text[:40]!r}; restore it from backup, or delete "
            "it only if this node's data is being discarded too") from None


def _load_node_id(config: Config) -> uuid.UUID:
    """``load_or_create_node_id`` of ``node.node-id-file``. A path the host refuses (a full or
    read-only disk, permissions) is left to the start-up's ``HOST_ERRNOS`` handling; any other
    that cannot be used (a directory in its place, a file where a directory should be) is one
    line naming the key and exit 2, as a restart cannot fix it either."""
    path = config.data_path(config.node.node_id_file)
    try:
        return load_or_create_node_id(path)
    except OSError as exc:
        if exc.errno in HOST_ERRNOS:
            raise
        raise HostEnvironmentError(f"cannot use node id file {path}: {exc.strerror} (set by "
                                   "$.node.node-id-file)", reason="file_access") from None


def _load_token(config: Config) -> str:
    """The admin token: the configured file, or ``<data-dir>/admin.token`` created on demand."""
    if config.admin.token_file:
        path = config.data_path(config.admin.token_file)  # (load_config made it absolute already)
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read admin token file {path}: {exc.strerror}",
                              "$.admin.token-file") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"admin token file {path} is not UTF-8 text: byte "
                              f"{exc.object[exc.start]:#04x} at offset {exc.start}",
                              "$.admin.token-file") from None
        if not token:
            raise ConfigError(f"admin token file {path} is empty", "$.admin.token-file")
        return token
    path = config.data_path(ADMIN_TOKEN_FILE)
    if not path.exists():
        # whole or not at all (the data directory's lock keeps other daemons out): a file created
        # and then left empty by a full disk would stop every later start as corrupt
        atomic_write_bytes(path, (secrets.token_urlsafe(32) + "\n").encode("ascii"), mode=0o600)
        log.info("created admin token file=%s", path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as exc:
        raise CorruptFileError(str(path), "not UTF-8 text", offset=exc.start) from None
    if not token:
        raise CorruptFileError(str(path), "empty admin token")
    return token


@dataclass
class _Slot:
    service: Service
    state: str = "created"
    error: str | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class Daemon:
    """One giaannd process. ``await Daemon(config, services).run()`` returns the exit status.

    Args:
        config: the effective configuration.
        services: started in order, stopped in reverse (membership first, then roles).
        unavailable_roles: role -> reason, reported in status (see ``build_role_services``).
        notifier: sd_notify sender (default: from ``NOTIFY_SOCKET``).
        handle_signals: install SIGTERM/SIGINT handlers (only possible in the main thread;
            embedders and tests running the daemon elsewhere call ``request_stop``).
        runtime: the node runtime handed to every service in its context (it should also be
            the first of ``services``, so it starts first and stops last).
    """

    def __init__(self, config: Config, services: Sequence[Service] = (), *,
                 unavailable_roles: Mapping[str, str] | None = None,
                 notifier: SdNotifier | None = None, handle_signals: bool = True,
                 runtime: NodeRuntime | None = None) -> None:
        names = [s.name for s in services]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate service names: {names}")
        self.config = config
        self.runtime = runtime
        self.metrics = Metrics()
        self.node_name = config.node.name or socket.gethostname()
        self.node_id: uuid.UUID | None = None
        self.admin_address: tuple[str, int] | None = None
        self._slots = [_Slot(s) for s in services]
        self._unavailable = dict(unavailable_roles or {})
        self._notifier = notifier or SdNotifier()
        self._state = "starting"
        self._started_at = time.monotonic()
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping = asyncio.Event()
        self._exit_code = EXIT_OK
        self._tg: asyncio.TaskGroup | None = None
        self._admin: AdminApi | None = None
        self._lock_fd: int | None = None
        self._signals_seen = 0
        self._signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        info = self.metrics.gauge("giaannd_info", "Build and node facts (value is 1).",
                                  ["version", "node_name"])
        info.labels(__version__, self.node_name).set(1)
        self.metrics.gauge("giaannd_uptime_seconds", "Seconds since the daemon started.") \
            .set_function(lambda: time.monotonic() - self._started_at)
        self._service_up = self.metrics.gauge(
            "giaannd_service_up", "1 while the service is running, else 0.", ["service"])
        # Read at scrape time, on the loop (the admin handler runs there): a count that only
        # grows under steady load is a task leak (tools/bench/soak.py watches it).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics.gauge("giaannd_event_loop_tasks",
                           "asyncio tasks not yet done on the daemon's event loop.") \
            .set_function(lambda: len(asyncio.all_tasks(self._loop)) if self._loop else 0)
        lag = self.metrics.histogram(
            "giaannd_event_loop_lag_seconds",
            "How late a timer on the daemon's event loop fires (sampled 4 times a second): the delay "
            "any callback waits on top of its own work.", buckets=LAG_BUCKETS_S)
        stalls = self.metrics.counter(
            "giaannd_event_loop_stalls_total",
            "Times the event loop did not run for node.loop-stall-log-s or longer (each logged with "
            "the stack that held it).")
        self._loop_watch = LoopWatch(config.node.loop_stall_log_s, lag.observe, lambda _held: stalls.inc())

    # -- public ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """starting, running, stopping or stopped."""
        return self._state

    def request_stop(self, reason: str) -> None:
        """Begin a graceful shutdown (idempotent)."""
        if not self._stop_requested.is_set():
            log.info("shutdown requested reason=%s", reason)
            self._stop_requested.set()

    def force_stop(self, reason: str) -> None:
        """Skip what is left of the graceful drain."""
        log.warning("forced shutdown reason=%s", reason)
        self._exit_code = EXIT_FORCED
        self._stop_requested.set()
        self._force.set()

    def status(self) -> dict[str, Any]:
        """The ``/v1/status`` document (``GET /v1/health`` answers from its ``state`` and
        ``draining``: giaannd/admin/api.py ``health_of``)."""
        roles: dict[str, str] = {r: f"unavailable: {why}" for r, why in self._unavailable.items()}
        services: dict[str, Any] = {}
        for slot in self._slots:
            services[slot.service.name] = self._health(slot)
            if slot.service.name in self.config.node.roles:
                roles[slot.service.name] = slot.state
        return {
            "node_name": self.node_name,
            "node_id": str(self.node_id) if self.node_id else None,
            "cluster": self.config.cluster.name,
            "version": __version__,
            "pid": os.getpid(),
            "state": self._state,
            # `giaannctl node drain`: writes refused, the node gossiped as full (it still serves)
            "draining": self.runtime is not None and self.runtime.draining,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
            "roles": {r: roles.get(r, "unavailable") for r in self.config.node.roles},
            "services": services,
        }

    async def run(self) -> int:
        """Run until stopped; returns the exit status.

        Raises:
            GiaannError: startup failed for a reason the user must fix (after cleaning up).
        """
        loop = self._loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        startup_error: GiaannError | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._loop_watch.run(self._stopping), name="loop-watch")
                startup_error = await self._startup_or_interrupt()
                if startup_error is None and not self._stop_requested.is_set():
                    self._state = "running"
                    self._notifier.notify("READY=1", f"STATUS=serving as {self.node_name}")
                    log.info("ready node=%s node_id=%s roles=%s", self.node_name, self.node_id,
                             ",".join(self.config.node.roles) or "-")
                    tg.create_task(self._watchdog(), name="watchdog")
                    await self._stop_requested.wait()
                await self._shutdown()
                for slot in self._slots:
                    for task in slot.tasks:
                        task.cancel()
        finally:
            for sig in self._signals:
                loop.remove_signal_handler(sig)
            self._release_lock()
        if startup_error is not None:
            raise startup_error
        return self._exit_code

    # -- startup --------------------------------------------------------------------------

    async def _startup_or_interrupt(self) -> GiaannError | None:
        """Run startup, abandoning it if a stop is requested meanwhile."""
        startup = asyncio.ensure_future(self._startup())
        waiter = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({startup, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not startup.done():
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await startup
            log.info("startup interrupted")
            return None
        exc = startup.exception()
        if exc is None:
            return None
        self._exit_code = EXIT_FAILURE
        self.request_stop("startup failed")
        if isinstance(exc, OSError):  # a full or read-only disk: one line and exit 2, no traceback
            exc = HostEnvironmentError.from_os_error(exc, self.config.node.data_dir) or exc
        if isinstance(exc, GiaannError):
            self._exit_code = exc.exit_code
            return exc
        log.error("startup failed", exc_info=exc)
        return None

    async def _startup(self) -> None:
        data_dir = Path(self.config.node.data_dir)
        try:
            data_dir.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise HostEnvironmentError(f"cannot create data directory {data_dir}: {exc.strerror} "
                                       "(set by $.node.data-dir)", reason="data_dir_unusable") from None
        self._take_lock(data_dir)
        self.node_id = _load_node_id(self.config)
        self._admin = AdminApi(token=_load_token(self.config), metrics=self.metrics,
                               status=self.status,
                               metrics_require_token=self.config.admin.metrics_require_token,
                               config=self.config.admin)
        host, port = split_listen(self.config.admin.listen)
        try:
            self.admin_address = await self._admin.start(host, port)
        except OSError as exc:
            raise HostEnvironmentError(f"cannot listen on {self.config.admin.listen}: {exc.strerror} "
                                       "(set by $.admin.listen)", reason="listen_failed") from None
        # Written via rename so giaannctl --data-dir never reads a half-written address.
        addr_file = self.config.data_path(ADMIN_ADDR_FILE)
        bound_host, bound_port = self.admin_address
        url_host = f"[{bound_host}]" if ":" in bound_host else bound_host  # RFC 3986 IPv6
        atomic_write_bytes(addr_file, f"http://{url_host}:{bound_port}\n".encode("ascii"))
        log.info("admin api listening address=%s:%d", *self.admin_address)
        for role, why in self._unavailable.items():
            log.warning("role unavailable role=%s reason=%r", role, why)
        started: dict[str, Service] = {}
        for slot in self._slots:
            await self._start_one(slot, started)
            started[slot.service.name] = slot.service

    async def _start_one(self, slot: _Slot, started: Mapping[str, Service]) -> None:
        assert self._admin is not None and self.node_id is not None
        name = slot.service.name
        ctx = ServiceContext(
            config=self.config, node_id=self.node_id, node_name=self.node_name,
            metrics=self.metrics, admin=self._admin, stopping=self._stopping,
            services=dict(started), _spawn=self._spawn, _request_stop=self.request_stop,
            service_name=name, runtime=self.runtime)
        slot.state = "starting"
        self._notifier.notify(f"STATUS=starting {name}")
        log.info("service starting service=%s", name)
        try:
            await slot.service.start(ctx)
            self._admin.require_bound(name)  # a role must serve every operation it declares
        except BaseException as exc:
            slot.state = "failed"
            slot.error = repr(exc)
            raise
        slot.state = "running"
        self._service_up.labels(name).set(1)
        log.info("service running service=%s", name)

    def _take_lock(self, data_dir: Path) -> None:
        """Refuse to share a data directory with another live daemon (flock, released on exit).
        Once held, and before the pid is written into the lock file (the first write), services
        delete leftovers of interrupted writes (``_reclaim_space``)."""
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise HostEnvironmentError(f"data directory {data_dir} is in use by pid {holder}",
                                       reason="data_dir_locked") from None
        self._lock_fd = fd
        self._reclaim_space()
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:  # os.write names no file: name the lock file
            raise HostEnvironmentError.from_os_error(exc, path) or exc from None

    def _reclaim_space(self) -> None:
        """Let every ``ReclaimsSpace`` service delete what interrupted writes left behind, after
        the whole-file writes' temporaries anywhere in the data directory (atomic_file.py)."""
        for path, size in remove_stale_temporaries(self.config.node.data_dir, recursive=True):
            log.info("removed a stale temporary file=%s bytes=%d", path, size)
        for slot in self._slots:
            if isinstance(slot.service, ReclaimsSpace):
                files, freed = slot.service.reclaim_space()
                if files:
                    log.info("reclaimed space service=%s files=%d bytes=%d", slot.service.name,
                             files, freed)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- run --------------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals_seen += 1
        if self._signals_seen > 1 and sig == signal.SIGINT:
            self.force_stop("second SIGINT")
        else:
            self.request_stop(sig.name)

    def _spawn(self, coro: Coroutine[Any, Any, Any], service: str, name: str
               ) -> asyncio.Task[Any]:
        assert self._tg is not None, "spawn is only valid while the daemon runs"
        slot = next(s for s in self._slots if s.service.name == service)
        task = self._tg.create_task(self._supervise(coro, slot, name), name=f"{service}:{name}")
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)
        return task

    async def _supervise(self, coro: Awaitable[Any], slot: _Slot, name: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("service task failed service=%s task=%s", slot.service.name, name)
            slot.state, slot.error = "failed", f"{name}: {exc!r}"
            self._service_up.labels(slot.service.name).set(0)
            self._exit_code = EXIT_FAILURE
            self.request_stop(f"{slot.service.name} failed")

    async def _watchdog(self) -> None:
        interval = watchdog_interval_s()
        if interval is None:
            return
        while not self._stopping.is_set():
            self._notifier.notify("WATCHDOG=1")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)

    # -- shutdown -------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._state = "stopping"
        self._stopping.set()
        self._notifier.notify("STOPPING=1", "STATUS=draining")
        budget_s = self.config.node.drain_timeout_s
        deadline = time.monotonic() + budget_s
        to_stop = [s for s in reversed(self._slots) if s.state in ("running", "failed", "starting")]
        for i, slot in enumerate(to_stop):
            # the shares of the services still to stop are theirs (module docstring)
            reserved_s = budget_s * min(1.0, sum(drain_reserve_of(s.service) for s in to_stop[i + 1:]))
            await self._stop_one(slot, deadline - reserved_s, reserved_s)
        if self._admin is not None:
            await self._admin.stop()
            with contextlib.suppress(FileNotFoundError):
                self.config.data_path(ADMIN_ADDR_FILE).unlink()
        self._state = "stopped"
        log.info("stopped exit_status=%d", self._exit_code)

    async def _stop_one(self, slot: _Slot, deadline: float, reserved_s: float = 0.0) -> None:
        name = slot.service.name
        was_failed = slot.state == "failed"
        slot.state = "stopping"
        graceful = asyncio.ensure_future(slot.service.stop(graceful=True))
        forced = asyncio.ensure_future(self._force.wait())
        try:
            budget_s = max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait({graceful, forced}, timeout=budget_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        if graceful in done and graceful.exception() is None:
            slot.state = "failed" if was_failed else "stopped"
            self._service_up.labels(name).set(0)
            log.info("service stopped service=%s", name)
            return
        if graceful.done():
            # e.g. the storage role's final snapshot failed: nothing acknowledged is lost (the
            # synced log replays), but the stop did not do what it should, so the status says so
            exc = graceful.exception()
            if self._exit_code == EXIT_OK:
                self._exit_code = EXIT_FAILURE
            if isinstance(exc, (GiaannError, OSError)):  # says it all: no traceback
                log.error("graceful stop failed service=%s error=%r", name, exc)
            else:
                log.error("graceful stop failed service=%s", name, exc_info=exc)
        else:
            graceful.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await graceful
            log.warning("graceful stop abandoned service=%s reason=%s reserved_s=%.1f", name,
                        "forced" if self._force.is_set() else "drain timeout", reserved_s)
        try:
            await asyncio.wait_for(slot.service.stop(graceful=False), FORCE_STOP_TIMEOUT_S)
        except Exception:
            log.exception("forced stop failed service=%s", name)
        slot.state = "failed" if was_failed else "killed"
        self._service_up.labels(name).set(0)

    @staticmethod
    def _health(slot: _Slot) -> dict[str, Any]:
        try:
            health = dict(slot.service.health())
        except Exception as exc:  # health must never take the status page down
            health = {"health_error": repr(exc)}
        health["state"] = slot.state
        if slot.error:
            health["error"] = slot.error
        return health
