"""``connect()`` with a deadline and full-jitter exponential backoff (dask ``comm/core.py``; the
AWS architecture blog's "full jitter": sleep ~ U(0, min(cap, base · 2^attempt))), so a restarting
peer is not stampeded by every node retrying in lock-step."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Final

from peers.errors import DeadlineExceeded, HandshakeRejected, PeersError, TransportClosed
from peers.retry import RetryPolicy, retry
from peers.transport.base import Transport
from peers.transport.connection import Connection

__all__ = ["connect", "BACKOFF_BASE_S", "BACKOFF_CAP_S", "CONNECT_BACKOFF", "ATTEMPT_TIMEOUT_S"]

log = logging.getLogger(__name__)

BACKOFF_BASE_S: Final = 0.01
BACKOFF_CAP_S: Final = 1.0
#: Waits between connection attempts (peers/retry.py); the caller's timeout bounds the attempts.
CONNECT_BACKOFF: Final = RetryPolicy(BACKOFF_BASE_S, BACKOFF_CAP_S)
#: One attempt (TCP connect + handshake) may take at most this long, within the overall deadline.
ATTEMPT_TIMEOUT_S: Final = 5.0


async def connect(transport: Transport, address: str, *, timeout_s: float,
                  rng: random.Random | None = None) -> Connection:
    """Connect with retries until ``timeout_s`` has passed.

    Handshake rejections are not retried (a wrong key stays wrong); a protocol error during the
    handshake is (the peer may have been half-started).

    Raises:
        HandshakeRejected: the peer refused us (or we it).
        DeadlineExceeded: no attempt succeeded in time; chained to the last error.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def attempt() -> Connection:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DeadlineExceeded("no time left for an attempt")
        return await transport.connect_once(address, timeout_s=min(remaining, ATTEMPT_TIMEOUT_S))

    def note(failures: int, exc: BaseException, wait_s: float) -> None:
        log.debug("connect retry address=%s attempt=%d delay_s=%.3f: %s", address, failures - 1, wait_s, exc)

    try:
        return await retry(attempt, CONNECT_BACKOFF, retry_on=(TransportClosed, DeadlineExceeded, OSError, PeersError),
                           give_up=lambda exc: isinstance(exc, HandshakeRejected), on_retry=note,
                           deadline=deadline, rng=rng)
    except HandshakeRejected:
        raise
    except (TransportClosed, DeadlineExceeded, OSError, PeersError) as exc:
        raise DeadlineExceeded(f"could not connect to {address} within {timeout_s}s: {exc}") from exc
