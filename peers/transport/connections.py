"""A connection pool per peer: reuse, reconnect with backoff, and the membership hook.

One multiplexed ``Connection`` per peer is enough (many requests are in flight on it), so the pool
keeps at most one per peer id, opens it on demand (single-flight: concurrent callers share one
connect), and reopens it after it closed. ``fail_peer`` is the hook membership calls when it
declares a peer dead: every pending request to the peer fails at once with ``PeerDead`` and new
requests are refused until ``revive`` (the peer is alive again, e.g. restarted with a higher
incarnation). The pool also checks that the node answering at an address is the one expected.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

from peers.errors import HandshakeRejected, PeerDead, TransportClosed
from peers.transport.base import Result, Transport
from peers.transport.connect import connect
from peers.transport.connection import Connection

__all__ = ["ConnectionPool", "DEFAULT_CONNECT_TIMEOUT_S"]

DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0


class ConnectionPool:
    """Connections to peers by node id, over one transport."""

    def __init__(self, transport: Transport, *, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 rng: random.Random | None = None) -> None:
        self.transport, self.connect_timeout_s = transport, connect_timeout_s
        self._rng = rng or random.Random()
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Task[Connection]] = {}
        self._dead: dict[str, str] = {}

    async def get(self, peer_id: str, address: str) -> Connection:
        """An open connection to ``peer_id`` at ``address`` (reused, or opened with retries).

        Raises:
            PeerDead: the peer was declared dead and not revived (also while this call waited
                for the connect).
            HandshakeRejected: the node at ``address`` is not ``peer_id`` (reason ``wrong_peer``),
                or refused us.
            DeadlineExceeded: no connection within ``connect_timeout_s``.
        """
        if peer_id in self._dead:
            raise PeerDead(f"peer {peer_id} is dead: {self._dead[peer_id]}")
        conn = self._conns.get(peer_id)
        if conn is not None and not conn.is_closed:
            return conn
        task = self._connecting.get(peer_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._open(peer_id, address))
            self._connecting[peer_id] = task
            task.add_done_callback(self._connect_done(peer_id))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # the connect was cancelled by ``fail_peer`` or ``close``, not this caller: say why
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise
            if peer_id in self._dead:
                raise PeerDead(f"peer {peer_id} is dead: {self._dead[peer_id]}") from None
            raise TransportClosed(f"connecting to {peer_id} was abandoned (the peer was declared dead, "
                                  "or the pool closed)") from None

    def _connect_done(self, peer_id: str) -> Callable[[asyncio.Task[Connection]], None]:
        def done(task: asyncio.Task[Connection]) -> None:
            # a task that ``fail_peer`` cancelled ends after a newer connect may have started:
            # remove only our own entry, or the next caller would open a second connection
            if self._connecting.get(peer_id) is task:
                del self._connecting[peer_id]
        return done

    async def _open(self, peer_id: str, address: str) -> Connection:
        conn = await connect(self.transport, address, timeout_s=self.connect_timeout_s, rng=self._rng)
        if conn.peer != peer_id:
            await conn.close("unexpected peer")
            raise HandshakeRejected(f"{address} is {conn.peer}, expected {peer_id}", reason="wrong_peer",
                                    by_peer=False)
        if peer_id in self._dead:  # declared dead while we were connecting
            conn.fail(PeerDead(f"peer {peer_id} is dead: {self._dead[peer_id]}"))
            raise PeerDead(f"peer {peer_id} is dead: {self._dead[peer_id]}")
        self._conns[peer_id] = conn
        return conn

    async def request(self, peer_id: str, address: str, payload: Any = None, bulk: Sequence[Any] = (),
                      **kwargs: Any) -> Result:
        """``get(peer_id, address).request(...)``: see ``Connection.request``."""
        conn = await self.get(peer_id, address)
        return await conn.request(payload, bulk, **kwargs)

    def fail_peer(self, peer_id: str, reason: str) -> int:
        """Membership declared ``peer_id`` dead: fail everything pending to it now.

        Returns the number of requests that were failed.
        """
        self._dead[peer_id] = reason
        task = self._connecting.pop(peer_id, None)
        if task is not None:
            task.cancel()
        conn = self._conns.pop(peer_id, None)
        if conn is None or conn.is_closed:
            return 0
        pending = conn.in_flight
        conn.fail(PeerDead(f"peer {peer_id} declared dead: {reason}"))
        return pending

    def revive(self, peer_id: str) -> None:
        """The peer is alive again: allow connections to it."""
        self._dead.pop(peer_id, None)

    async def close(self) -> None:
        """Close every connection."""
        for task in list(self._connecting.values()):
            task.cancel()
        for conn in list(self._conns.values()):
            await conn.close("pool closing")
        self._conns.clear()
