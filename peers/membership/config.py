"""Membership configuration: one Struct, every field documented, three named profiles.

The field set and the defaults follow hashicorp/memberlist's `DefaultLANConfig`,
`DefaultWANConfig` and `DefaultLocalConfig`; each description says what the field
does, what it trades, and the formula it enters. This is the only place the
defaults live (STYLE.md item 13): the daemon embeds `MembershipConfig` in its
own config tree.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["MembershipConfig"]

_Pos = Meta(gt=0)


class MembershipConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="kebab"):
    """Timing and size knobs of the SWIM + Lifeguard membership protocol."""

    probe_interval_s: Annotated[float, Meta(gt=0, description=(
        "Time between failure-detector probes of one member (shuffled round robin). "
        "Lower detects failures sooner at the cost of more packets. Scaled by the "
        "Lifeguard local-health multiplier (score + 1) while this node is unhealthy."))] = 1.0
    probe_timeout_s: Annotated[float, Meta(gt=0, description=(
        "How long to wait for a direct ack before asking indirect-checks other members "
        "to probe (and opening a TCP fallback probe). Should be above the 99th percentile "
        "round-trip time; must be below probe-interval. Also scaled by the health multiplier."))] = 0.5
    indirect_checks: Annotated[int, Meta(ge=0, le=16, description=(
        "k: members asked to probe a target that missed its direct ack. More makes a "
        "false suspicion less likely under loss, at the cost of k extra ping/ack pairs."))] = 3
    tcp_fallback_probe: Annotated[bool, Meta(description=(
        "Also probe over TCP when the direct UDP probe times out, so a node whose UDP "
        "path is lossy but reachable is not suspected."))] = True
    suspicion_mult: Annotated[int, Meta(ge=1, description=(
        "mult in the minimum suspicion timeout min = mult * max(1, log10(N)) * "
        "probe-interval. Higher gives a suspect more time to refute (fewer false "
        "deaths) and slows detection. Lifeguard expects k = mult - 2 confirmations."))] = 4
    suspicion_max_timeout_mult: Annotated[int, Meta(ge=1, description=(
        "The suspicion timeout starts at this multiple of the minimum and decays "
        "logarithmically to the minimum as independent confirmations arrive (Lifeguard). "
        "With no confirmations a lone accuser waits the full maximum."))] = 6
    retransmit_mult: Annotated[int, Meta(ge=1, description=(
        "A broadcast is piggy-backed at most mult * ceil(log10(N + 1)) times. Higher "
        "raises the chance every member hears it, at the cost of gossip bytes."))] = 4
    gossip_interval_s: Annotated[float, Meta(gt=0, description=(
        "Time between gossip rounds that send queued broadcasts to gossip-nodes random "
        "members. Lower spreads updates faster; nothing is sent when the queue is empty."))] = 0.2
    gossip_nodes: Annotated[int, Meta(ge=1, description=(
        "Fan-out of a gossip round. Convergence takes about log_fanout(N) rounds."))] = 3
    gossip_to_dead_s: Annotated[float, Meta(ge=0, description=(
        "Keep gossiping to a dead member for this long, so a falsely declared node hears "
        "of its death and refutes it."))] = 30.0
    push_pull_interval_s: Annotated[float, Meta(ge=0, description=(
        "Period of the full-state TCP exchange with one random member (anti-entropy). "
        "0 disables it. Scaled up for large clusters: above 32 members the interval is "
        "multiplied by ceil(log2(N) - log2(32)) + 1, as memberlist does."))] = 30.0
    reconnect_interval_s: Annotated[float, Meta(ge=0, description=(
        "How often to try a push-pull with one failed (dead, not left) member, so that the two "
        "sides of a partition that outlived suspicion merge again once it heals: nobody probes or "
        "gossips to a dead member, and push-pull only picks live ones (Serf's reconnect). Each "
        "node tries with probability failed/alive, so the cluster makes about one attempt per "
        "failed member per interval. Stops when the member is reaped (reap-after-s). 0 disables "
        "it (an operator then has to join the halves)."))] = 30.0
    max_concurrent_push_pulls: Annotated[int, Meta(ge=1, description=(
        "Incoming push-pull exchanges served at once; more are refused so that a join "
        "storm cannot exhaust memory (memberlist maxPushPullRequests)."))] = 128
    tcp_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Deadline of one TCP exchange (push-pull, join, fallback probe)."))] = 10.0
    awareness_max_multiplier: Annotated[int, Meta(ge=1, le=8, description=(
        "Lifeguard local health: score in [0, this]; probe interval and timeout are "
        "multiplied by score + 1. Raised by failed probes without nacks and by being "
        "suspected, lowered by successful probes."))] = 8
    lifeguard: Annotated[bool, Meta(description=(
        "Enable the Lifeguard extensions (local health, nacks, decaying suspicion "
        "timeout, buddy system). Off gives plain SWIM with a fixed suspicion timeout of "
        "the minimum; exists to show what Lifeguard buys."))] = True
    dead_node_reclaim_s: Annotated[float, Meta(ge=0, description=(
        "A dead or left member's name may be taken by a different node id after this "
        "long; before that a claim by a different node id is a name conflict."))] = 0.0
    reap_after_s: Annotated[float, Meta(gt=0, description=(
        "Forget dead and left members after this long (memberlist/Serf reap)."))] = 3600.0
    max_packet_bytes: Annotated[int, Meta(ge=512, le=65000, description=(
        "Upper bound of one UDP datagram after encryption. 1400 stays under a 1500 MTU "
        "with IP/UDP headers; compound packets are filled up to it."))] = 1400
    join_attempts: Annotated[int, Meta(ge=1, description=(
        "Rounds of trying every seed before join() gives up with a clear error."))] = 5
    join_backoff_s: Annotated[float, Meta(gt=0, description=(
        "First delay between join rounds; doubles each round with full jitter."))] = 0.5
    leave_propagate_s: Annotated[float, Meta(ge=0, description=(
        "How long leave() keeps answering probes while its leave message spreads."))] = 1.0
    max_incarnation_step: Annotated[int, Meta(ge=1, le=2**40, description=(
        "Most an accusation (suspect, dead) may raise a member's incarnation above the one this "
        "node knows (0 for an unknown member); an alive message may go one further, the "
        "refutation of such an accusation. Larger values are clamped, not trusted: a member only "
        "ever adds 1 per refutation or metadata update, while one forged message at the wire's "
        "limit would otherwise leave its victim unable to refute (issue 16). Lower limits what "
        "one forged message can do; too low (below the changes a member makes while another "
        "cannot hear it) slows convergence after long partitions."))] = 2**32
    address_confirm_timeout_s: Annotated[float, Meta(gt=0, description=(
        "A live member's claimed new address is used only after it answered a ping (UDP and "
        "TCP) as that member; meanwhile the old address stays in use and the member is told of "
        "the claim at it, so a forged one is refuted. The claim is dropped when no answer comes "
        "within this time (a later copy of the claim starts again). A member that really moved "
        "answers within one round trip."))] = 3.0

    @classmethod
    def lan(cls) -> MembershipConfig:
        """memberlist's DefaultLANConfig: one data centre, sub-millisecond RTTs."""
        return cls()

    @classmethod
    def wan(cls) -> MembershipConfig:
        """memberlist's DefaultWANConfig: links across regions, higher RTT and loss."""
        return cls(probe_interval_s=5.0, probe_timeout_s=3.0, suspicion_mult=6,
                   gossip_interval_s=0.5, gossip_nodes=4, gossip_to_dead_s=60.0,
                   push_pull_interval_s=60.0, reconnect_interval_s=60.0, tcp_timeout_s=30.0,
                   address_confirm_timeout_s=15.0)

    @classmethod
    def loopback(cls) -> MembershipConfig:
        """Tests on one host: tight timings so a failure is seen within a few seconds."""
        return cls(probe_interval_s=0.2, probe_timeout_s=0.1, indirect_checks=2,
                   suspicion_mult=3, retransmit_mult=3, gossip_interval_s=0.05,
                   gossip_to_dead_s=5.0, push_pull_interval_s=5.0, reconnect_interval_s=2.0,
                   tcp_timeout_s=1.0,
                   leave_propagate_s=0.3, join_backoff_s=0.1, address_confirm_timeout_s=1.0)

    @classmethod
    def profile(cls, name: str) -> MembershipConfig:
        """Look a profile up by name: ``lan``, ``wan`` or ``loopback``.

        Raises:
            ValueError: unknown profile name.
        """
        makers = {"lan": cls.lan, "wan": cls.wan, "loopback": cls.loopback,
                  "loopback-test": cls.loopback}
        try:
            return makers[name]()
        except KeyError:
            raise ValueError(f"unknown membership profile {name!r}; "
                             f"expected one of {sorted(makers)}") from None
