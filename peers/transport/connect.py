"""``connect()`` with a deadline and full-jitter exponential backoff (dask ``comm/core.py``; the
AWS architecture blog's "full jitter": sleep ~ U(0, min(cap, base · 2^attempt))), so a restarting
peer is not stampeded by every node retrying in lock-step."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Final

from peers.errors import DeadlineExceeded, HandshakeRejected, PeersError, TransportClosed
from peers.transport.base import Transport
from peers.transport.connection import Connection

__all__ = ["connect", "backoff_delay", "backoff_delays", "BACKOFF_BASE_S", "BACKOFF_CAP_S", "ATTEMPT_TIMEOUT_S"]

log = logging.getLogger(__name__)

BACKOFF_BASE_S: Final = 0.01
BACKOFF_CAP_S: Final = 1.0
#: One attempt (TCP connect + handshake) may take at most this long, within the overall deadline.
ATTEMPT_TIMEOUT_S: Final = 5.0


def backoff_delay(attempt: int, rng: random.Random, *, base_s: float = BACKOFF_BASE_S,
                  cap_s: float = BACKOFF_CAP_S) -> float:
    """Full-jitter delay before retry ``attempt`` (0-based): U(0, min(cap, base·2^attempt)). Pure."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 62)))


def backoff_delays(n: int, rng: random.Random) -> list[float]:
    """The first ``n`` delays (for tests and docs)."""
    return [backoff_delay(i, rng) for i in range(n)]


async def connect(transport: Transport, address: str, *, timeout_s: float,
                  rng: random.Random | None = None) -> Connection:
    """Connect with retries until ``timeout_s`` has passed.

    Handshake rejections are not retried (a wrong key stays wrong).

    Raises:
        HandshakeRejected: the peer refused us (or we it).
        DeadlineExceeded: no attempt succeeded in time; chained to the last error.
    """
    rng = rng or random.Random()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    attempt = 0
    last: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DeadlineExceeded(f"could not connect to {address} within {timeout_s}s: {last}") from last
        try:
            return await transport.connect_once(address, timeout_s=min(remaining, ATTEMPT_TIMEOUT_S))
        except HandshakeRejected:
            raise
        except (TransportClosed, DeadlineExceeded, OSError) as exc:
            last = exc
        except PeersError as exc:  # a protocol error during the handshake: retrying may help
            last = exc
        delay = min(backoff_delay(attempt, rng), max(deadline - loop.time(), 0.0))
        log.debug("connect retry address=%s attempt=%d delay_s=%.3f: %s", address, attempt, delay, last)
        attempt += 1
        await asyncio.sleep(delay)
