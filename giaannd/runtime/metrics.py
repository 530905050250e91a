"""Prometheus export of the runtime's plain counters (transports, unreachable reports, membership).

Theory of operation
-------------------
The counters live in plain objects (each transport's ``metrics``, ``NodeRuntime``'s unreachable
report counts, ``MembershipNode.counters()``), which have no Prometheus dependency. This
collector, registered once by ``NodeRuntime.start``, reads them at scrape time and yields metric
families: nothing is copied between scrapes and the hot paths only increment integers. Before
membership runs, its families are left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime

__all__ = ["RuntimeCollector"]

class RuntimeCollector(Collector):
    """Exports transport and membership counters at scrape time (they live in plain objects)."""

    def __init__(self, runtime: NodeRuntime) -> None:
        self._rt = runtime

    def collect(self) -> Iterator[Any]:
        fields = ("requests_sent", "requests_served", "bytes_sent", "bytes_received", "deadlines",
                  "cancels", "connections_opened", "connections_closed", "fallbacks")
        for name in fields:
            fam = CounterMetricFamily(f"giaannd_transport_{name}", f"data plane: {name}",
                                      labels=["scheme"])
            for scheme, transport in self._rt.transports.items():
                metrics = getattr(transport, "metrics", None)
                if metrics is not None:
                    fam.add_metric([scheme], float(getattr(metrics, name)))
            yield fam
        fam = CounterMetricFamily("giaannd_data_plane_unreachable_reports",
                                  "peers the data plane could not reach, by what membership was told",
                                  labels=["outcome"])
        fam.add_metric(["reported"], float(self._rt.unreachable_reported))
        fam.add_metric(["rate_limited"], float(self._rt.unreachable_suppressed))
        yield fam
        node = self._rt.membership
        if node is None:
            return
        try:
            counters = node.counters()
        except RuntimeError:  # not started yet
            return
        fam = CounterMetricFamily("giaannd_membership_events", "membership core and glue counters",
                                  labels=["counter"])
        for key, value in sorted(counters.items()):
            if key != "members_live":
                fam.add_metric([key], float(value))
        yield fam
        yield GaugeMetricFamily("giaannd_membership_members_live", "members believed alive",
                                value=float(counters.get("members_live", 0)))
        yield GaugeMetricFamily("giaannd_membership_local_health",
                                "Lifeguard local health score (0 is healthy)",
                                value=float(node.local_health()))
