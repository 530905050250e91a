"""Prometheus export of the runtime's plain counters (transports, unreachable reports, membership).

Theory of operation
-------------------
The counters live in plain objects (each transport's ``metrics``, ``NodeRuntime``'s unreachable
report counts, ``MembershipNode.counters()``), which have no Prometheus dependency. This
collector, registered once by ``NodeRuntime.start``, reads them at scrape time and yields metric
families: nothing is copied between scrapes and the hot paths only increment integers. Before
membership runs, its families are left out.

Each plain counter becomes its own metric (``giaannd_membership_probes_total``), named and
explained in the tables below, rather than one family with a ``counter`` label: a label must not
mix different quantities (https://prometheus.io/docs/practices/naming/#labels). Table entries are
exported from zero, so a dashboard's ``rate()`` has a series before the first event. Membership
counters the table does not know yet (added in peers/membership later) are still exported, with a
generic HELP; tests/unit/daemon/test_metric_tables.py keeps the table complete.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime

__all__ = ["MEMBERSHIP_COUNTERS", "MEMBERSHIP_REJECTED_PREFIX", "TRANSPORT_COUNTERS", "RuntimeCollector"]

#: ``peers.transport.connection.Metrics`` field -> (metric, HELP); labelled by ``scheme``.
TRANSPORT_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "requests_sent": ("giaannd_transport_requests_sent_total",
                      "Data-plane requests this node sent to peers, counted once written."),
    "requests_served": ("giaannd_transport_requests_served_total",
                        "Data-plane requests from peers this node answered, counted when the reply is sent."),
    "bytes_sent": ("giaannd_transport_sent_bytes_total",
                   "Bulk (array) bytes sent in data-plane requests and replies, frame headers excluded."),
    "bytes_received": ("giaannd_transport_received_bytes_total",
                       "Bulk (array) bytes received in data-plane requests and replies, frame headers excluded."),
    "deadlines": ("giaannd_transport_deadlines_total",
                  "Data-plane requests this node sent that ran past their deadline unanswered."),
    "cancels": ("giaannd_transport_cancels_total",
                "Data-plane requests cancelled: ours abandoned (deadline, caller gone) and peers' "
                "Cancel frames that stopped a handler here."),
    "connections_opened": ("giaannd_transport_connections_opened_total",
                           "Data-plane connections that completed the handshake (either direction)."),
    "connections_closed": ("giaannd_transport_connections_closed_total",
                           "Data-plane connections closed, for any reason (either direction)."),
    "fallbacks": ("giaannd_transport_fallbacks_total",
                  "ucx:// connections whose bulk data falls back to the TCP stream (peer without UCX)."),
}

#: ``MembershipNode.counters()`` key -> (metric, HELP) (keys: peers/membership/state.py, node.py).
MEMBERSHIP_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "address_claims": ("giaannd_membership_address_claims_total",
                       "Gossip claims that a live member moved to a new address, held back until the "
                       "member answers there (a forged claim never takes effect)."),
    "address_claims_confirmed": ("giaannd_membership_address_claims_confirmed_total",
                                 "Address claims confirmed by the member answering at its new address; "
                                 "only then is the new address used."),
    "address_claims_expired": ("giaannd_membership_address_claims_expired_total",
                               "Address claims dropped because nothing answered at the claimed address "
                               "within address-confirm-timeout-s."),
    "incarnations_clamped": ("giaannd_membership_incarnations_clamped_total",
                             "Received incarnations capped at max-incarnation-step above the known one "
                             "(a suspect or dead claim far in the future cannot overflow a refutation)."),
    "packets_sent": ("giaannd_membership_packets_sent_total",
                     "Gossip UDP packets sent carrying a probe, ack or join message (piggy-backed "
                     "broadcasts ride along)."),
    "gossip_packets_sent": ("giaannd_membership_gossip_packets_sent_total",
                            "Gossip UDP packets sent carrying only queued broadcasts (gossip ticks)."),
    "probes": ("giaannd_membership_probes_total", "Direct probes (Ping) of a member started by this node."),
    "indirect_probes": ("giaannd_membership_indirect_probes_total",
                        "Indirect probe requests sent to relays after a direct probe went unanswered."),
    "probes_failed": ("giaannd_membership_probes_failed_total",
                      "Probes that got no ack, directly or through a relay, by their deadline."),
    "fallback_probe_acks": ("giaannd_membership_fallback_probe_acks_total",
                            "Probes answered only over the TCP fallback (UDP to that member is lossy)."),
    "pings_wrong_target": ("giaannd_membership_pings_wrong_target_total",
                           "Pings received that named another member (a stale address, e.g. after a restart)."),
    "suspicions": ("giaannd_membership_suspicions_total",
                   "Alive members marked suspect here (own failed probe or a gossiped Suspect)."),
    "suspicion_confirmations": ("giaannd_membership_suspicion_confirmations_total",
                                "Independent confirmations received for a running suspicion (Lifeguard)."),
    "refutes": ("giaannd_membership_refutes_total",
                "Times this node refuted a suspicion or death claim about itself (incarnation bumped)."),
    "refutations_sent_to_accuser": ("giaannd_membership_refutations_sent_to_accuser_total",
                                    "Refutations also sent straight to the member that accused this node."),
    "name_conflicts": ("giaannd_membership_name_conflicts_total",
                       "Alive claims for a known name from a different node id or address."),
    "members_failed": ("giaannd_membership_members_failed_total",
                       "Members marked dead here (own suspicion timed out, or a gossiped death)."),
    "members_left": ("giaannd_membership_members_left_total", "Members that left the cluster gracefully."),
    "meta_updates_while_leaving": ("giaannd_membership_meta_updates_while_leaving_total",
                                   "Metadata updates asked for while this node was leaving: not gossiped (an "
                                   "Alive of ours would replace the queued leave)."),
    "members_reaped": ("giaannd_membership_members_reaped_total",
                       "Dead or left members forgotten after membership.reap-after-s."),
    "push_pulls_served": ("giaannd_membership_push_pulls_served_total",
                          "Full-state push-pull exchanges (joins and anti-entropy) answered over TCP."),
    "reconnect_attempts": ("giaannd_membership_reconnect_attempts_total",
                           "Push-pulls tried with a dead member so a healed partition merges "
                           "(membership.reconnect-interval-s)."),
    "unreachable_reports": ("giaannd_membership_unreachable_reports_total",
                            "Data-plane reports that a member could not be reached (each starts a suspicion)."),
    "udp_errors": ("giaannd_membership_udp_errors_total", "Errors the gossip UDP socket reported."),
    "stream_errors": ("giaannd_membership_stream_errors_total",
                      "Gossip TCP streams (push-pull, fallback probe) that failed with an I/O error or timeout."),
    "streams_refused_busy": ("giaannd_membership_streams_refused_busy_total",
                             "Inbound gossip TCP streams refused at membership.max-concurrent-push-pulls."),
    "subscriber_events_dropped": ("giaannd_membership_subscriber_events_dropped_total",
                                  "Member events dropped for a subscriber that fell behind (oldest first)."),
}

#: Keys ``rejected_<reason>`` (peers/membership/node.py) become one metric labelled by reason:
#: the same quantity (packets dropped), so the label does not mix units.
MEMBERSHIP_REJECTED_PREFIX: Final = "rejected_"
_REJECTED = ("giaannd_membership_packets_rejected_total",
             "Gossip packets and frames dropped before decoding, by reason (wrong_key, malformed...).")


class RuntimeCollector(Collector):
    """Exports transport and membership counters at scrape time (they live in plain objects)."""

    def __init__(self, runtime: NodeRuntime) -> None:
        self._rt = runtime

    def collect(self) -> Iterator[Any]:
        for field, (name, doc) in TRANSPORT_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["scheme"])
            for scheme, transport in self._rt.transports.items():
                metrics = getattr(transport, "metrics", None)
                if metrics is not None:
                    fam.add_metric([scheme], float(getattr(metrics, field)))
            yield fam
        fam = CounterMetricFamily(
            "giaannd_data_plane_unreachable_reports_total",
            "Peers the data plane could not reach: reported to membership, or not (rate-limited).",
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
        yield from _membership_families(counters)
        yield GaugeMetricFamily("giaannd_membership_members_live",
                                "Members this node currently believes alive, itself included.",
                                value=float(counters.get("members_live", 0)))
        yield GaugeMetricFamily("giaannd_membership_local_health",
                                "Lifeguard local health score: 0 is healthy, higher scales probe timeouts up.",
                                value=float(node.local_health()))


def _membership_families(counters: Mapping[str, int]) -> Iterator[CounterMetricFamily]:
    for key, (name, doc) in MEMBERSHIP_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=float(counters.get(key, 0)))
    rejected = CounterMetricFamily(*_REJECTED, labels=["reason"])
    for key, value in sorted(counters.items()):
        if key.startswith(MEMBERSHIP_REJECTED_PREFIX):
            rejected.add_metric([key[len(MEMBERSHIP_REJECTED_PREFIX):]], float(value))
        elif key not in MEMBERSHIP_COUNTERS and key != "members_live" and key.isidentifier():
            yield CounterMetricFamily(f"giaannd_membership_{key.lower()}_total",
                                      f"Membership counter {key} (peers/membership).", value=float(value))
    yield rejected
