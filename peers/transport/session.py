"""The receive half every stream backend shares: a frame decoder that first drives the handshake
(synchronously, with the sans-IO ``peers.handshake`` objects) and then feeds a ``Connection``.

Driving the handshake synchronously inside the receive callback matters: the frame after ``Ready``
may arrive in the same read, and it must find the ``Connection`` (and its buffer allocator) already
in place. So until the handshake is done the decoder runs ``stepwise`` (one frame per call) with
the small pre-authentication body limit of ``TransportLimits``; once the peer is authenticated the
limit rises to ``MAX_BODY_BYTES`` and the rest of the read is decoded. Protocol errors are counted
by reason and close the link; they never escape to the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Final

from peers import framing, handshake, wire
from peers.errors import HandshakeRejected, LocalProtocolError, RemoteProtocolError, TransportClosed
from peers.transport.base import Identity, Link
from peers.transport.connection import Connection, Metrics
from peers.transport.limits import DEFAULT_HANDSHAKE_TIMEOUT_S, TransportLimits

__all__ = ["Session", "HANDSHAKE_TIMEOUT_S", "MakeConnection"]

log = logging.getLogger(__name__)

#: A connection that has not finished its handshake after this long is dropped (a silent client
#: must not hold a socket forever); ``TransportLimits.handshake_timeout_s`` overrides it.
HANDSHAKE_TIMEOUT_S: Final = DEFAULT_HANDSHAKE_TIMEOUT_S
_DEFAULT_LIMITS: Final = TransportLimits()

MakeConnection = Callable[[handshake.Agreement], Connection]


class Session:
    """Receive side of one link: handshake, then frames to the connection."""

    def __init__(
        self,
        link: Link,
        *,
        client: bool,
        identity: Identity,
        metrics: Metrics,
        make_connection: MakeConnection,
        transports: Sequence[str] = ("inline",),
        ucx_address: bytes | None = None,
        bulk_salt: int = 0,
        limits: TransportLimits = _DEFAULT_LIMITS,
    ) -> None:
        self.link, self.metrics, self._make = link, metrics, make_connection
        self.ready: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self.conn: Connection | None = None
        self._timeout_s = limits.handshake_timeout_s
        # a stranger's frames: small bodies, one frame at a time (module docstring)
        self.decoder = framing.FrameDecoder(self._allocate, max_body_bytes=limits.handshake_max_body_bytes,
                                            stepwise=True)
        args = dict(node_id=identity.node_id, cluster=identity.cluster, keyring=identity.keyring,
                    nonce=os.urandom(wire.NONCE_BYTES), transports=transports, ucx_address=ucx_address,
                    versions=identity.versions, bulk_salt=bulk_salt)
        self._client = handshake.ClientHandshake(**args) if client else None  # type: ignore[arg-type]
        self._server = None if client else handshake.ServerHandshake(**args)  # type: ignore[arg-type]
        self._step = 0

    def start(self) -> None:
        """Client: send Hello. Server: arm the handshake timeout."""
        if self._client is not None:
            self._send(self._client.hello())
        else:
            handle = asyncio.get_running_loop().call_later(self._timeout_s, self._handshake_timeout)
            self.ready.add_done_callback(lambda _f: handle.cancel())

    # ---- called by the backend's receive path ---------------------------------------------------

    def get_buffer(self) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        decoder = self.decoder
        try:
            # authenticated: one whole small frame per read goes straight to the connection
            if decoder.deliver is not None and decoder.whole(nbytes):
                return
            frames = decoder.buffer_updated(nbytes)
            if not frames:
                return
            conn = self.conn
            if conn is not None and not decoder.stepwise:  # authenticated: the hot path
                if len(frames) == 1:
                    conn.on_frame(frames[0])
                    return
                # several frames in one read (pipelined requests): the replies that handlers send
                # while they are dispatched leave together, in one write
                link = self.link
                link.cork()
                try:
                    for frame in frames:
                        conn.on_frame(frame)
                finally:
                    link.uncork()
                return
            while frames:
                stepwise = decoder.stepwise  # the handshake may end in this batch and turn it off
                for frame in frames:
                    if self.conn is not None:
                        self.conn.on_frame(frame)
                    else:
                        self._on_handshake_frame(frame.message)
                if not stepwise or (self.conn is None and self.ready.done()):
                    break  # all decoded, or the handshake failed
                frames = decoder.more()  # the rest of the read, under the limits now in force
        except RemoteProtocolError as exc:
            self.metrics.count_protocol_error(exc.reason)
            log.warning("protocol error, closing peer=%s reason=%s: %s", self._peer(), exc.reason, exc)
            self._fail(exc)
        except LocalProtocolError as exc:  # pragma: no cover - our bug; still contain it
            log.error("local protocol error peer=%s: %s", self._peer(), exc)
            self._fail(exc)

    def lost(self, exc: BaseException | None) -> None:
        if self.conn is not None:
            self.conn.on_lost(exc)
        elif not self.ready.done():
            self.ready.set_exception(TransportClosed(f"connection lost during handshake: {exc or 'EOF'}"))
        self.decoder.close()  # nothing more arrives: give its buffers back now, not at the next GC

    # ---- internals ----------------------------------------------------------------------------

    def _peer(self) -> str:
        return self.conn.peer if self.conn is not None else "?"

    def _allocate(self, message: wire.Message, specs: Sequence[wire.BufferSpec]) -> list[memoryview]:
        if self.conn is None:
            raise RemoteProtocolError("bulk before the handshake finished", reason="bad_message")
        return self.conn.allocate(message, specs)

    def _send(self, message: wire.Message) -> None:
        self.link.write(framing.encode_frame(message))

    def _on_handshake_frame(self, msg: wire.Message) -> None:
        try:
            if self._client is not None:
                if self._step == 0:
                    self._send(self._client.on_welcome(msg))
                    self._step = 1
                else:
                    self._attach(self._client.on_ready(msg))
            else:
                assert self._server is not None
                if self._step == 0:
                    self._send(self._server.on_hello(msg))
                    self._step = 1
                else:
                    ready, agreement = self._server.on_auth(msg)
                    self._send(ready)
                    self._attach(agreement)
        except HandshakeRejected as exc:
            self.metrics.count_rejection(exc.reason)
            log.warning("handshake rejected reason=%s by_peer=%s: %s", exc.reason, exc.by_peer, exc)
            if isinstance(exc.reply, wire.Reject):
                self._send(exc.reply)
            if not self.ready.done():
                self.ready.set_exception(exc)
            self.link.close()

    def _attach(self, agreement: handshake.Agreement) -> None:
        # the peer proved the cluster key: the framing's own limits apply from the next frame on
        self.decoder.max_body_bytes = framing.MAX_BODY_BYTES
        self.decoder.stepwise = False
        self.conn = self._make(agreement)
        self.decoder.allocate = self.conn.allocate  # authenticated: bulk may come, straight there
        self.decoder.deliver = self.conn.on_message
        self.conn.divert_response = self.decoder.divert_response
        self.metrics.connections_opened += 1
        if not self.ready.done():
            self.ready.set_result(self.conn)

    def _handshake_timeout(self) -> None:
        if not self.ready.done():
            self.metrics.count_rejection("timeout")
            self.ready.set_exception(TransportClosed("handshake timed out"))
            self.link.abort()

    def _fail(self, exc: Exception) -> None:
        if self.conn is not None:
            self.conn._shutdown(exc)
        elif not self.ready.done():
            self.ready.set_exception(exc)
        self.link.abort()
