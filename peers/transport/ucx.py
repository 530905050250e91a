"""``ucx://host:port`` — control on TCP, bulk over UCX worker-address endpoints (ucxx).

Why this shape (transport-baseline.md §3, measured on these machines):

- ucxx endpoints made through a *listener* always have error handling on, which on one host limits
  UCX to its TCP lanes: no faster than our own asyncio TCP. Endpoints made from a *worker address*
  with error handling off get shared memory (sysv eager + cma rendezvous): 27 GB/s at 1 MiB,
  0.93× memcpy at 256 MiB. So the worker address travels in the handshake (``Hello/Welcome``) and
  bulk buffers go over such an endpoint, created lazily on the first send.
- Those endpoints never report a dead peer, so liveness comes from the TCP control connection (its
  loss fails everything pending) and from membership (``Connection.fail(PeerDead(...))``).
- A pending ucxx receive burns a core, so nothing is posted in advance: a receive is posted only
  once the control channel has announced the buffer (its ``BufferSpec``), into a destination of
  exactly the announced size. UCX truncation is silent for the sender; lengths first makes it
  impossible, and a receiver-side ``UCXXMessageTruncatedError`` is still mapped to
  ``RemoteProtocolError``.
- Tags: each side picks a ``bulk_salt`` unique in its process and sends it in the handshake; the
  sender tags buffer ``i`` of request ``id`` with the *receiver's* salt (``connection.bulk_tag``),
  and the receiver matches with a worker-level tagged receive.
- Progress mode **blocking**: the worker's event fd is watched by the asyncio loop, so an idle
  process uses no CPU, and round trips are 15–27 µs. The default (a progress thread) gave 4 ms p99
  and fights the event loop on 2 cores; python futures gave 170–200 µs round trips.
- Environment set before ucxx is imported (``setdefault``: an operator's value wins):
  ``UCX_WARN_UNUSED_ENV_VARS=n`` (ucxx sets ``UCX_MEMTYPE_CACHE`` that UCX 1.21 no longer knows),
  ``UCX_LOG_LEVEL=error``, ``UCX_TCP_TX_SEG_SIZE=256K``/``UCX_TCP_RX_SEG_SIZE=1M`` (UCX's TCP lanes,
  if ever used, are 3–5× faster tuned), ``UCX_TLS=^self``: UCX 1.21's loopback transport
  (``self``, an endpoint to the process's own worker) segfaults when the buffer sent is CUDA
  memory (seen on an H100 and an H200, 2026-11-28: ``tests/gpu``'s same-process send crashed in
  ``ucp_worker_progress``; with ``self`` excluded, or ``UCX_PROTO_ENABLE=n``, it passed, and a send
  to another process passed either way). Without ``self`` a node's endpoint to itself goes over
  shared memory like any other on the host.

ucxx is imported lazily (importing this module does not import it); its exceptions are translated
here. ucxx's context is per process, so one ``UcxRuntime`` is shared by every transport instance.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import weakref
from typing import Any, ClassVar, Final

import numpy as np

from peers.errors import RemoteProtocolError, TransportClosed, TransportUnavailable
from peers.transport.base import BulkChannel, Handler, Identity
from peers.transport.connection import Connection
from peers.transport.limits import TransportLimits
from peers.transport.pool import BufferPool
from peers.transport.session import Session
from peers.transport.tcp import TcpLink, TcpTransport

__all__ = ["UcxTransport", "UcxRuntime", "UCX_ENV_DEFAULTS"]

log = logging.getLogger(__name__)

UCX_ENV_DEFAULTS: Final = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_LOG_LEVEL": "error",
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_TLS": "^self",
}
PROGRESS_MODE: Final = "blocking"
#: Bulk smaller than this (per frame) goes inline on the TCP control stream: below it one TCP
#: write is cheaper than the extra UCX message (tools/bench/transport.py, docs/transport.md).
INLINE_BELOW_BYTES: Final = 256 * 2**10


class UcxRuntime:
    """The process's ucxx context: initialised once, on first use."""

    _instance: ClassVar[UcxRuntime | None] = None

    def __init__(self) -> None:
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            import ucxx
        except ImportError as exc:  # pragma: no cover - ucxx is a dependency
            raise TransportUnavailable(f"ucxx not importable: {exc}") from exc
        try:
            ucxx.init(progress_mode=PROGRESS_MODE)
        except RuntimeError:  # someone in this process initialised ucxx already: share its context
            log.info("ucxx already initialised in this process; using its progress mode")
        self.ucxx = ucxx
        self.errors: tuple[type[BaseException], ...] = (ucxx.exceptions.UCXError,)
        self.truncated: type[BaseException] = ucxx.exceptions.UCXMessageTruncatedError
        self.address: bytes = ucxx.get_worker_address().tobytes()
        self._salts = itertools.count(random.randrange(1, 1 << 22))
        self._patched: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    def ensure_progress(self) -> None:
        """Make ucxx progress on the running loop, re-arming after every event.

        ucxx 0.52's blocking mode arms the worker once, and its fd callback only calls
        ``progress()`` without re-arming: after the first message the (level-triggered) epoll fd
        stays readable and the loop spins at ~0.5 core while idle (measured by
        tools/bench/transport.py and /tmp probes). We replace the reader with one that progresses
        and then re-arms through ucxx's own ``_arm_worker`` task (which waits until the loop has no
        other ready work, ucx-py#413). If ucxx's internals differ, we keep its behaviour and log.
        """
        loop = asyncio.get_running_loop()
        ctx = self.ucxx.core._get_ctx()
        ctx.continuous_ucx_progress(event_loop=loop)
        if loop in self._patched:
            return
        self._patched.add(loop)
        try:
            from ucxx._lib_async.application_context import ProgressTasks

            mode = ProgressTasks[loop]
            fd = mode.worker.epoll_file_descriptor
            arm = mode._arm_worker
        except (ImportError, KeyError, AttributeError) as exc:  # pragma: no cover - other ucxx
            log.warning("cannot fix ucxx blocking progress; idle CPU may be high: %s", exc)
            return

        def on_event() -> None:
            mode.worker.progress()
            if mode.arm_task is None or mode.arm_task.done():
                mode.arm_task = loop.create_task(arm())

        loop.remove_reader(fd)
        loop.add_reader(fd, on_event)

    @classmethod
    def get(cls) -> UcxRuntime:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def next_salt(self) -> int:
        return next(self._salts) & 0x7FFFFF or next(self._salts) & 0x7FFFFF


def _ucx_buffer(buf: Any) -> Any:
    """What ucxx accepts: host bytes as a uint8 array; device memory as the object itself
    (ucxx reads ``__cuda_array_interface__``)."""
    if isinstance(buf, memoryview):
        return np.frombuffer(buf, np.uint8)
    return getattr(buf, "obj", buf)  # connection._DeviceDest wraps a device destination


class UcxBulk(BulkChannel):
    """Out-of-band bulk to one peer over a worker-address endpoint (error handling off)."""

    min_bytes = 0  # set by UcxTransport from its ``inline_below_bytes``

    def __init__(self, runtime: UcxRuntime, peer_address: bytes) -> None:
        self._rt, self._peer_address = runtime, peer_address
        self._ep: Any = None
        self._ep_lock = asyncio.Lock()
        self._closed = False
        self._receives = 0

    @property
    def pending_receives(self) -> int:
        return self._receives

    async def _endpoint(self) -> Any:
        async with self._ep_lock:
            if self._ep is None:
                address = self._rt.ucxx.get_ucx_address_from_buffer(self._peer_address)
                self._ep = await self._rt.ucxx.create_endpoint_from_worker_address(
                    address, endpoint_error_handling=False)
            return self._ep

    async def send(self, tag: int, view: memoryview) -> None:
        if self._closed:
            raise TransportClosed("ucx bulk channel closed")
        ep = await self._endpoint()
        try:
            await ep.send(_ucx_buffer(view), tag, force_tag=True)
        except self._rt.errors as exc:
            raise TransportClosed(f"ucx send failed: {exc}") from exc

    async def recv(self, tag: int, dest: memoryview) -> None:
        if self._closed:
            raise TransportClosed("ucx bulk channel closed")
        self._receives += 1
        try:
            await self._rt.ucxx.recv(_ucx_buffer(dest), tag)
        except self._rt.truncated as exc:
            raise RemoteProtocolError(f"ucx message longer than announced: {exc}", reason="truncated") from exc
        except self._rt.errors as exc:
            raise TransportClosed(f"ucx receive failed: {exc}") from exc
        finally:
            self._receives -= 1

    def close(self) -> None:
        self._closed = True
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.abort()


class UcxTransport(TcpTransport):
    """TCP control connection + UCX bulk; falls back to inline TCP bulk when the peer has no UCX."""

    scheme: ClassVar[str] = "ucx"

    def __init__(self, identity: Identity, *, pool: BufferPool | None = None, checksum: bool = False,
                 inline_below_bytes: int = INLINE_BELOW_BYTES, limits: TransportLimits | None = None) -> None:
        super().__init__(identity, pool=pool, checksum=checksum, limits=limits)
        self.inline_below_bytes = inline_below_bytes
        self.runtime = UcxRuntime.get()
        self.runtime.ensure_progress()
        self._fallback_logged = False

    def _session(self, link: TcpLink, *, client: bool, handler: Handler | None,
                 on_close: Any = None) -> Session:
        salt = self.runtime.next_salt()

        def make(agreement: Any) -> Connection:
            bulk = None
            if agreement.bulk == "ucx" and agreement.peer_ucx_address:
                bulk = UcxBulk(self.runtime, agreement.peer_ucx_address)
                bulk.min_bytes = self.inline_below_bytes
            else:
                self.metrics.fallbacks += 1
                if not self._fallback_logged:
                    self._fallback_logged = True
                    log.warning("ucx unavailable with peer=%s, bulk falls back to tcp", agreement.peer_node_id)
            return Connection(link, peer=agreement.peer_node_id, handler=handler, pool=self.pool,
                              metrics=self.metrics, checksum=self.checksum, on_close=on_close,
                              bulk=bulk, bulk_salt=(agreement.peer_bulk_salt, salt))

        return Session(link, client=client, identity=self.identity, metrics=self.metrics, make_connection=make,
                       transports=("ucx", "inline"), ucx_address=self.runtime.address, bulk_salt=salt,
                       limits=self.limits)
