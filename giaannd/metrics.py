"""Per-daemon metrics registry with Prometheus text exposition.

Built on ``prometheus-client``'s ``CollectorRegistry``, one per daemon and never the library's
global ``REGISTRY``: two daemons in one test process (or a library user's own metrics) must not
collide, and the global registry's default process/platform collectors would otherwise be
duplicated. We use the library rather than writing the exposition format because its escaping,
histogram bucket semantics (cumulative ``le``, ``+Inf``, ``_sum``/``_count``) and name
validation are exactly what scrapers expect, and it is small, dependency-free and well kept.

Services receive the ``Metrics`` object in their start context and create their instruments
there; names are prefixed ``giaannd_`` by convention (``giaannd_storage_reads_total``).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

#: The Prometheus text format 0.0.4 content type, which every scraper understands. Our metric
#: names are all legacy-valid ASCII, so ``generate_latest``'s output is valid 0.0.4 text; newer
#: prometheus-client releases label it 1.0.0, which older scrapers reject.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds, 100 µs to 30 s: covers a loopback RPC up to a slow training step.
DEFAULT_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)


class Metrics:
    """Factory and registry for one daemon's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """A monotonically increasing count; ``name`` should end in ``_total``.

        Raises:
            ValueError: the name is invalid or already registered in this registry.
        """
        return Counter(name, doc, labelnames=tuple(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """A value that goes up and down (queue depth, bytes held)."""
        return Gauge(name, doc, labelnames=tuple(labels), registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS_S,
    ) -> Histogram:
        """A distribution (latency, batch size); default buckets suit latencies in seconds."""
        return Histogram(name, doc, labelnames=tuple(labels), buckets=tuple(buckets),
                         registry=self.registry)

    def render(self) -> bytes:
        """Everything registered, in the Prometheus text exposition format."""
        return generate_latest(self.registry)
