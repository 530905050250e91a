"""A look at the storage cluster from any node: owner counts per node, and each node's fill.

Two read-only views the membership service serves (``ring.show`` carries the first, ``ring.usage``
is the second) and the status page (giaannd/admin/status_page.py) polls:

- **Owner counts** (``owner_counts``): how many of a fixed sample of ``OWNER_SAMPLE`` column ids
  each placement member owns, as one of the R replicas and as the primary. Column ids are hashes
  (giaannd/model/ids.py), so the sample's counts are the ring's shares; pure and cheap (one
  ``owner_indices`` pass), it needs no storage node.
- **Fill** (``storage_usage``): each placement member's RAM (used of capacity), disk (its storage
  files, its file system's free and total bytes), rows and entries, asked over the data plane
  (``GetUsage``) with a per-node deadline, and its row-size distribution (``row_sizes``: element
  k counts the rows of 2**k to 2**(k+1) - 1 entries; null from a node that predates it). A node
  that is down or slow is listed with its error, never failing the whole view.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from giaannd.errors import AdminHTTPError
from peers.placement import Placement

if TYPE_CHECKING:
    from giaannd.client.storage_client import StorageClient
    from giaannd.cluster.view import ClusterView

__all__ = ["OWNER_SAMPLE", "USAGE_TIMEOUT_S", "owner_counts", "storage_usage"]

log = logging.getLogger(__name__)

#: Column ids sampled for the owner counts: enough that a member's share is within about 1.5
#: percentage points (binomial standard error at 4096 draws), cheap enough for every poll.
OWNER_SAMPLE: Final = 4096
#: Deadline of each node's ``GetUsage`` for the fill view (a status page must answer promptly).
USAGE_TIMEOUT_S: Final = 2.0

# Spread over the id space: consecutive multiples of the 64-bit golden ratio (Fibonacci hashing).
_SAMPLE_IDS: Final = (np.arange(1, OWNER_SAMPLE + 1, dtype=np.uint64)
                      * np.uint64(0x9E3779B97F4A7C15))


def owner_counts(placement: Placement) -> dict[str, dict[str, int]]:
    """For each member of ``placement``: ``owned`` (sample ids it holds a replica of) and
    ``primary`` (sample ids it is first owner of), out of ``OWNER_SAMPLE``."""
    idx = placement.owner_indices(_SAMPLE_IDS)
    owned = np.bincount(idx.reshape(-1), minlength=len(placement.names))
    primary = np.bincount(idx[:, 0], minlength=len(placement.names))
    return {name: {"owned": int(owned[i]), "primary": int(primary[i])}
            for i, name in enumerate(placement.names)}


async def storage_usage(topology: ClusterView, client: StorageClient) -> Mapping[str, Any]:
    """The fill view (module docstring): ``{"epoch", "nodes": [...]}``, one entry per placement
    member in placement order.

    Raises:
        AdminHTTPError: 503 when no storage member is known.
    """
    try:
        placement = topology.placement
    except LookupError:
        raise AdminHTTPError(503, "no storage members known", "no_storage") from None

    async def one(name: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": name, "live": topology.is_live(name)}
        if not doc["live"]:
            return {**doc, "error": "not live"}
        try:
            u = await asyncio.wait_for(client.usage(name), USAGE_TIMEOUT_S)
        except TimeoutError:
            return {**doc, "error": f"no answer within {USAGE_TIMEOUT_S:g}s"}
        except Exception as exc:  # any failure of one node is shown for that node alone
            log.debug("usage of %s failed: %r", name, exc)
            return {**doc, "error": f"{type(exc).__name__}: {exc}"}
        return {**doc, "capacity_bytes": u.capacity_bytes, "used_bytes": u.used_bytes,
                "rows": u.num_rows, "entries": u.num_entries, "full": u.is_full,
                "hints_held": u.hints_held, "disk_bytes": u.disk_bytes,
                "disk_free_bytes": u.disk_free_bytes, "disk_total_bytes": u.disk_total_bytes,
                "row_sizes": u.row_size_log2}

    nodes = await asyncio.gather(*(one(name) for name in placement.names))
    return {"epoch": placement.epoch, "nodes": list(nodes)}
