"""Retransmit-limited piggy-back queue (memberlist `TransmitLimitedQueue`).

Invariants: at most one queued broadcast per member name (a newer message about
a member invalidates the older one); each is sent at most ``limit`` times;
least-transmitted (then newest) go first, so fresh news spreads before old.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BroadcastQueue", "retransmit_limit"]

T = TypeVar("T")


def retransmit_limit(mult: int, n: int) -> int:
    """``mult * ceil(log10(n + 1))``: memberlist `retransmitLimit`."""
    return mult * math.ceil(math.log10(n + 1))


@dataclass(slots=True)
class _Item(Generic[T]):
    key: str
    message: T
    size: int
    transmits: int
    order: int


class BroadcastQueue(Generic[T]):
    """Queued messages keyed by member name, handed out within a byte budget."""

    def __init__(self) -> None:
        self._items: dict[str, _Item[T]] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def queue(self, key: str, message: T, size: int) -> None:
        """Queue a message about member ``key``, replacing any older one about it."""
        self._order += 1
        self._items[key] = _Item(key, message, size, 0, self._order)

    def transmits(self, key: str) -> int | None:
        """Times the queued message about ``key`` was sent; None when none is queued."""
        item = self._items.get(key)
        return None if item is None else item.transmits

    def get(self, overhead: int, budget: int, limit: int,
            max_count: int | None = None) -> list[tuple[T, int]]:
        """Take (message, size) pairs that fit in ``budget`` bytes, each costing size + overhead.

        At most ``max_count`` pairs (a receiver drops a compound packet holding more messages
        than it decodes, whatever its size). Every message handed out counts one transmission;
        those that reach ``limit`` are dropped from the queue.
        """
        if not self._items or (max_count is not None and max_count <= 0):
            return []
        out: list[tuple[T, int]] = []
        used = 0
        for item in sorted(self._items.values(), key=lambda i: (i.transmits, -i.order)):
            cost = item.size + overhead
            if used + cost > budget:
                continue
            used += cost
            out.append((item.message, item.size))
            item.transmits += 1
            if item.transmits >= limit:
                del self._items[item.key]
            if budget - used < overhead + 8 or len(out) == max_count:
                break
        return out
