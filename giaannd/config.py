"""The daemon's configuration: the only place defaults live (STYLE.md items 13-15).

One tree of msgspec Structs, every field ``Annotated[..., Meta(description=...)]`` with a default,
so the TOML loader, ``giaannd config show --defaults`` and ``docs/config.md``
(``tools/gen_config_docs.py``) all read the same source. Structs are ``kw_only``,
``forbid_unknown_fields`` (a typo is an error, not a silently ignored key) and ``rename="kebab"``
(TOML keys are ``capacity-bytes``; Python attributes are ``capacity_bytes``).

Layers, later wins: built-in defaults < TOML file < environment (``GIAANND_SECTION__FIELD``) <
command line (``--set section.field=value``). Every error becomes a ``ConfigError`` naming the key
path, e.g. ``Expected int >= 1 - at `$.storage.replication-factor```, which the CLI turns into exit 2.
"""

from __future__ import annotations

import inspect
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

from giaannd.errors import ConfigError
from peers.membership.config import MembershipConfig as PeersMembershipConfig
from peers.transport.limits import (
    DEFAULT_HANDSHAKE_MAX_BODY_BYTES,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS_PER_HOST,
    DEFAULT_MAX_PENDING_HANDSHAKES,
    TransportLimits,
)
from peers.transport.registry import scheme_of
from peers.transport.tcp import parse_host_port

__all__ = [
    "DEFAULT_READ_CHUNK_BYTES",
    "ENV_PREFIX",
    "JoinMode",
    "MAX_COLUMN_ROWS_ENTRIES",
    "MAX_READ_CHUNK_BYTES",
    "PLACEMENT_WEIGHT",
    "AdminConfig",
    "ClusterConfig",
    "ComputeConfig",
    "Config",
    "LoggingConfig",
    "MembershipConfig",
    "NodeConfig",
    "StorageConfig",
    "TransportConfig",
    "load_config",
    "membership_profile_values",
    "parse_override",
    "parse_seed",
    "split_listen",
    "to_toml",
]

#: Environment overrides are ``GIAANND_<SECTION>__<FIELD>``; ``__`` separates section and field
#: because field names themselves contain ``_`` (for ``-``).
ENV_PREFIX = "GIAANND_"

Role = Literal["storage", "compute"]
#: ``storage.join-mode``: what a storage node not yet in the ring does at start.
JoinMode = Literal["auto", "bootstrap", "manual"]
_GIB = 1 << 30
#: Default of ``storage.read-chunk-bytes`` (its description says why); the storage node's read handler
#: and the storage client take it from here when no config is given (tests, tools).
DEFAULT_READ_CHUNK_BYTES = 8 * 2**20
#: Ceiling of ``storage.read-chunk-bytes``: one part must stay under the protocol's per-reply entry cap
#: (protocol.MAX_READ_PART_ENTRIES, 8 Mi entries = 168 MiB at 21 B each).
MAX_READ_CHUNK_BYTES = 128 * 2**20
#: Defaults of ``storage.register-ram-bytes`` / ``register-spill-bytes`` / ``register-disk-bytes``
#: (their descriptions say why); the register store (storage/engine/register_store.py) takes them
#: from here when no config is given (tests, tools).
DEFAULT_REGISTER_RAM_BYTES = 64 * 2**20
DEFAULT_REGISTER_SPILL_BYTES = 4096
DEFAULT_REGISTER_DISK_BYTES = 64 * _GIB
#: ``storage.placement-weight``'s default and, until placement uses weights, its only accepted
#: value (``_validate``).
PLACEMENT_WEIGHT = 1.0
#: Ceiling of ``compute.column-rows-max-entries`` (and of its default): 10 Mi entries of one column
#: are ~1 GB of JSON in one admin answer; more is an export's job (``POST /v1/export``).
MAX_COLUMN_ROWS_ENTRIES = 10_000_000


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="kebab"):
    """Base for config sections: strict keys, kebab-case names."""


class NodeConfig(_Section):
    """This process: its name, where it keeps state and which roles it runs."""

    name: Annotated[str, Meta(description=(
        "Human-readable node name shown in `giaannctl members list` and logs. Empty means the "
        "host name. It is a label only: identity is the node id, so renaming a node is safe."
    ))] = ""
    data_dir: Annotated[str, Meta(min_length=1, description=(
        "Directory for everything the node persists: node id, column snapshots, write-ahead log, "
        "admin token and the actual admin address. Created (mode 0750) on first start. systemd "
        "units point this at the StateDirectory. A relative path is taken from the directory of "
        "the config file that sets it (set by the environment or `--set`: from the working "
        "directory), once, at load; the other path keys are relative to this one."
    ))] = "/var/lib/giaannd"
    node_id_file: Annotated[str, Meta(min_length=1, description=(
        "File, relative to `data-dir` unless absolute, holding this node's UUID. Created on first "
        "start, with its directory (mode 0750) if that is missing, and never rewritten: a path "
        "that cannot be used or a corrupt file stops the daemon (exit 2) instead of silently "
        "minting a new identity, which would orphan the replicas this node holds."
    ))] = "node-id"
    roles: Annotated[list[Role], Meta(description=(
        "Roles this node runs: `storage` (owns column replicas), `compute` (training and "
        "inference workers), or both. A node with no roles only gossips and serves the admin API."
    ))] = msgspec.field(default_factory=lambda: ["storage", "compute"])
    drain_timeout_s: Annotated[float, Meta(gt=0, description=(
        "On SIGTERM the services get this long, in total, to finish in-flight work, hand off "
        "replicas and leave gossip before they are stopped forcefully. They stop one after "
        "another (compute, storage, membership), and each may use what is left of it less the "
        "shares reserved for those after it: half for the storage role (its final snapshot; "
        "without it the next start replays the whole update log) and 5 % for membership (the "
        "leave). So on a node with both roles compute's running jobs get at most 45 % of it (they "
        "resume after a restart) and cannot leave storage nothing; what a service does not use "
        "goes to the next. Keep systemd's TimeoutStopSec above it plus 5 s per service for "
        "forced stops (the shipped unit uses 90 s for the 60 s default)."
    ))] = 60.0
    loop_stall_log_s: Annotated[float, Meta(ge=0, description=(
        "When the daemon's event loop (which serves gossip, reads, writes and the admin API) has "
        "not run for this long, a watching thread logs a WARNING with the Python stack that holds "
        "it, once per stall, and counts it (`giaannd_event_loop_stalls_total`). The loop's "
        "scheduling delay is always sampled (`giaannd_event_loop_lag_seconds`). A stall longer "
        "than `membership.probe-timeout-s` (0.5 s on the lan profile) leaves peers' probes "
        "unanswered and can get the node suspected; set this at or below it to see every such "
        "stall. 0 turns the thread off."
    ))] = 1.0


class ClusterConfig(_Section):
    """Which cluster this node belongs to and how it finds it."""

    name: Annotated[str, Meta(min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description=(
        "Cluster name, checked in the handshake so two clusters on one network never merge."
    ))] = "giaann"
    key_file: Annotated[str, Meta(description=(
        "File holding the cluster key used to authenticate the handshake (HMAC), relative to "
        "`data-dir` unless absolute. Empty means no key: acceptable on loopback only. Rotate "
        "with `giaannctl keys install/use/remove`."
    ))] = ""
    seeds: Annotated[list[str], Meta(description=(
        "Addresses of existing members to join at start (`host:port` of their membership "
        "listener). Empty starts a new cluster. One reachable seed is enough; list several so a "
        "restart succeeds while one seed is down."
    ))] = msgspec.field(default_factory=list)


class AdminConfig(_Section):
    """The admin HTTP API used by giaannctl, Prometheus and the status page."""

    listen: Annotated[str, Meta(min_length=1, description=(
        "`host:port` the admin API listens on. Loopback by default: the API can start training "
        "and drain the node, so expose it beyond the host only behind a firewall. Port 0 picks a "
        "free port; the address actually bound is written to `<data-dir>/admin.addr`. A host name "
        "binds only the first address it resolves to (one listening socket, as for the data plane)."
    ))] = "127.0.0.1:7480"
    token_file: Annotated[str, Meta(description=(
        "File holding the bearer token every `/v1/` request must present, relative to "
        "`data-dir` unless absolute. Empty means `<data-dir>/admin.token`, created with mode "
        "0600 on first start (what `giaannctl --data-dir` reads); give giaannctl another file "
        "with `--token-file` (or `GIAANNCTL_TOKEN_FILE`). A configured file must exist and be "
        "non-empty."
    ))] = ""
    metrics_require_token: Annotated[bool, Meta(description=(
        "Require the token for `/metrics` and the status page even from loopback. By default "
        "a scrape from a loopback address needs no token (Prometheus agents usually run on the "
        "host); requests from other addresses always need it."
    ))] = False
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30, description=(
        "Largest request body accepted. Admin requests are small JSON documents (corpora and "
        "exports travel by path, never through the API), so 1 MiB is far above any real one. A "
        "larger declared `Content-Length` is refused with 413 before any of it is read; a chunked "
        "body is refused with 413 as soon as it passes the limit."
    ))] = 1 << 20
    header_timeout_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "A connection must deliver a complete request line and headers within this many seconds "
        "of opening, or of its previous request's end; otherwise it is closed. This is also how "
        "long an idle keep-alive connection stays open. Bounds slowloris clients, which would "
        "otherwise hold a connection (and a slot of `max-connections`) forever. Raise it only "
        "for clients on very slow links."
    ))] = 10.0
    body_timeout_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "Once its headers are in, a request's body must arrive in full within this many seconds, "
        "or the request is answered 408 and the connection closed. With `max-body-bytes` = 1 MiB "
        "the default demands about 35 KB/s of a client."
    ))] = 30.0
    max_connections: Annotated[int, Meta(ge=1, le=65536, description=(
        "Admin connections open at once. One more is answered 503 and closed at once, so a "
        "flood of connections costs at most this many file descriptors. Each idle or slow "
        "connection is freed after `header-timeout-s`. Keep it well under the process's open-file "
        "limit (the daemon's data plane needs descriptors too)."
    ))] = 256


class LoggingConfig(_Section):
    """Logging to stderr (journald under systemd)."""

    level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description=(
        "Lowest level written. `debug` logs every admin request and membership message."
    ))] = "info"
    format: Annotated[Literal["auto", "plain", "journal", "json"], Meta(description=(
        "`plain` prefixes lines with a timestamp; `journal` omits it and prefixes the syslog "
        "priority (`<6>`) that journald parses. `auto` picks `journal` when stderr is the stream "
        "named by `JOURNAL_STREAM` (that is, under systemd) and `plain` otherwise. `json` writes "
        "one object per line (`time`, `level`, `logger`, `message`, and each `key=value` field of "
        "the message as a key) for log shippers such as Loki or Elasticsearch."
    ))] = "auto"


class TransportConfig(_Section):
    """Data-plane listeners: how other nodes reach this one for column traffic."""

    bind: Annotated[list[str], Meta(description=(
        "Listener URLs, one per transport, e.g. `tcp://0.0.0.0:7470`, `ucx://10.0.0.5:7471`. "
        "The scheme selects the backend. Port 0 picks a free port."
    ))] = msgspec.field(default_factory=lambda: ["tcp://127.0.0.1:7470"])
    advertise: Annotated[list[str], Meta(description=(
        "URLs other nodes should dial, in preference order (UCX before TCP). Empty advertises "
        "the bound listeners; set it when binding a wildcard or behind NAT."
    ))] = msgspec.field(default_factory=list)
    max_pending_handshakes: Annotated[int, Meta(ge=1, description=(
        "Accepted connections that have not finished the handshake (not yet proved the cluster "
        "key), at once; further ones are closed on accept and counted as refused. Each holds a "
        "64 KiB receive buffer, so the cap bounds what strangers can pin (128 × 64 KiB = 8 MiB); "
        "real peers finish in milliseconds. Raise it only for very large clusters reconnecting "
        "at once."
    ))] = DEFAULT_MAX_PENDING_HANDSHAKES
    max_connections_per_host: Annotated[int, Meta(ge=1, description=(
        "Open accepted connections from one remote IP address; further ones are closed on "
        "accept. A peer needs one pooled connection plus a few for streams and clients; the "
        "default leaves room for a whole loopback test cluster on 127.0.0.1 while keeping one "
        "host from exhausting file descriptors."
    ))] = DEFAULT_MAX_CONNECTIONS_PER_HOST
    handshake_timeout_s: Annotated[float, Meta(gt=0, description=(
        "An accepted connection that has not completed the handshake after this long is "
        "dropped. The handshake is two round trips; lower values free a stranger's slot "
        "sooner, too low ones cut off peers on slow links."
    ))] = DEFAULT_HANDSHAKE_TIMEOUT_S
    handshake_max_body_bytes: Annotated[int, Meta(ge=1024, le=16 * 2**20, description=(
        "Largest frame body accepted before the handshake completed (a Hello is under 2 KiB). "
        "A larger announced length closes the connection before anything is allocated; after "
        "the handshake the framing limit (16 MiB) applies."
    ))] = DEFAULT_HANDSHAKE_MAX_BODY_BYTES

    def limits(self) -> TransportLimits:
        """The admission limits every transport of this node is built with."""
        return TransportLimits(
            max_pending_handshakes=self.max_pending_handshakes,
            max_connections_per_host=self.max_connections_per_host,
            handshake_timeout_s=self.handshake_timeout_s,
            handshake_max_body_bytes=self.handshake_max_body_bytes)


class _MembershipBase(_Section):
    """Gossip membership (SWIM + Lifeguard): where it listens and its timing profile.

    Every timing and size knob of ``peers.membership.config.MembershipConfig`` is also a key of
    this section (same name, same description and bounds). Unset keys take the value of the named
    `profile`; a set key overrides just that knob. The profiles and the knobs' documentation live
    in ``peers/membership/config.py`` only, so there is one source of truth.
    """

    profile: Annotated[Literal["loopback", "lan", "wan"], Meta(description=(
        "Timing profile (memberlist's Local/LAN/WAN): probe interval, timeouts and gossip fan-out "
        "tuned for one host, a data-centre network, or links with ~100 ms RTT. The timing keys "
        "below override single values of the profile."
    ))] = "lan"
    bind_address: Annotated[str, Meta(min_length=1, description=(
        "Address the membership (gossip) listener binds, for both UDP (probes, gossip) and TCP "
        "(push-pull, join)."
    ))] = "127.0.0.1"
    bind_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "UDP/TCP port of the membership listener; 0 picks a free port (the bound port is what "
        "other members and `giaannctl members list` see). Seeds name this port."
    ))] = 7946
    advertise_address: Annotated[str, Meta(description=(
        "Host other members should use to reach this node's membership listener. Empty means "
        "`bind-address`; required with a wildcard `bind-address` (`0.0.0.0`, `::`), which no other "
        "member could send to. A name is resolved once at start "
        "and its first address advertised (members send datagrams to an address)."
    ))] = ""

    def resolved(self) -> PeersMembershipConfig:
        """The effective ``peers`` membership config: the profile, then each key set here."""
        base = PeersMembershipConfig.profile(self.profile)
        changes = {name: getattr(self, name) for name in _TUNING_FIELDS
                   if getattr(self, name, None) is not None}
        return msgspec.structs.replace(base, **changes) if changes else base


def _tuning_fields() -> list[tuple[str, Any, Any]]:
    """One optional field per ``peers`` membership knob, keeping its type, bounds and text."""
    out: list[tuple[str, Any, Any]] = []
    hints = get_type_hints(PeersMembershipConfig, include_extras=True)
    for info in msgspec.structs.fields(PeersMembershipConfig):
        tp = hints[info.name]
        base_tp, metas = get_args(tp)[0], [m for m in get_args(tp)[1:] if isinstance(m, Meta)]
        text = " ".join(m.description for m in metas if m.description)
        bounds = {k: getattr(m, k) for m in metas for k in ("gt", "ge", "lt", "le")
                  if getattr(m, k) is not None}
        desc = f"{text} Unset: the profile's value."
        inner = Annotated[base_tp, Meta(**bounds)] if bounds else base_tp
        out.append((info.name, Annotated[inner | None, Meta(description=desc)], None))
    return out


_TUNING_FIELDS: tuple[str, ...] = tuple(f.name for f in msgspec.structs.fields(PeersMembershipConfig))

if TYPE_CHECKING:
    MembershipConfig = _MembershipBase
else:
    MembershipConfig = msgspec.defstruct(
        "MembershipConfig", _tuning_fields(), bases=(_MembershipBase,), kw_only=True,
        forbid_unknown_fields=True, rename="kebab", module=__name__)
    MembershipConfig.__doc__ = inspect.cleandoc(_MembershipBase.__doc__ or "")


def membership_profile_values(field: str) -> dict[str, Any]:
    """``{profile: value}`` of one timing knob across the named profiles (for docs/config.md)."""
    return {name: getattr(PeersMembershipConfig.profile(name), field)
            for name in ("loopback", "lan", "wan")}


class StorageConfig(_Section):
    """The storage role: column replicas in RAM, persisted to the data directory."""

    capacity_bytes: Annotated[int, Meta(gt=0, le=2**63 - 1, description=(
        "RAM this node offers for column replicas; writes beyond it are refused rather than "
        "swapping. Placement does not weight ownership by it (nor by `placement-weight`): every "
        "storage node owns about the same share, so give storage nodes equal capacities."
    ))] = 8 * _GIB
    replication_factor: Annotated[int, Meta(ge=1, le=16, description=(
        "Replicas per column. Tolerates `replication-factor - write-quorum` failed owners for "
        "writes and `replication-factor - 1` for reads. Must match across the cluster."
    ))] = 3
    write_quorum: Annotated[int, Meta(ge=1, le=16, description=(
        "Replicas that must acknowledge an update before it is reported applied; at most "
        "`replication-factor`. Majority (rf // 2 + 1) is the usual choice."
    ))] = 2
    placement_weight: Annotated[float, Meta(gt=0, le=1000, description=(
        "This node's weight in placement, recorded in the storage ring and gossiped in the node's "
        "metadata. Not supported yet: only the default, 1, is accepted, and any other value stops "
        "the daemon at load (exit 2). The daemon places columns with the unweighted rendezvous "
        "strategy (`hash`), so every storage node owns about the same share whatever its weight "
        "(measured when other values were still taken: weights 1 and 9 gave 50.2 % and 49.8 % of "
        "100,000 keys). The weighted strategy exists (`peers.placement`, ARCHITECTURE §6) but "
        "switching a running cluster to it would move ownership without streaming the rows, so it "
        "waits for a topology operation that does."
    ))] = PLACEMENT_WEIGHT
    snapshot_interval_s: Annotated[float, Meta(gt=0, description=(
        "Seconds between the snapshot timer's turns (with a phase and jitter: snapshot-jitter); "
        "at each turn the whole store is snapshotted if the log since the last snapshot is at "
        "least snapshot-min-log-ratio of its size. A snapshot truncates the log, which bounds "
        "the log replay of a restart."
    ))] = 300.0
    snapshot_min_log_ratio: Annotated[float, Meta(ge=0, le=100, description=(
        "A timer snapshot is skipped until the log written since the last snapshot is at least this share"
        " of the store's size (its used bytes, `giaannd_storage_used_bytes`): a snapshot writes the whole"
        " store, so on a timer alone its cost per second grows with the node (at 1.9 GB and a 20 s "
        "interval the cluster bench's nodes were writing one nearly all the time), while with this the "
        "store is rewritten once per this share of it logged (write amplification at most 1 / ratio) and "
        "a restart replays at most about this share of the store's bytes of log plus one interval's. 0 "
        "snapshots every interval when anything was logged (the behaviour before this key). The stop's "
        "final snapshot is not affected."
    ))] = 0.1
    snapshot_jitter: Annotated[float, Meta(ge=0, lt=1, description=(
        "Spread of the snapshot timer, so the replicas of a column never snapshot together: each "
        "wait after the first is `snapshot-interval-s * (1 + jitter * (2u - 1))`, u uniform in "
        "[0, 1) from a generator seeded by the node's name; the first is `snapshot-interval-s * "
        "(0.5 + phase)`, phase in [0, 1) from the name, which spreads nodes started together over "
        "a whole interval. The mean interval is unchanged; 0 keeps every later wait exact (nodes "
        "keep their phases, and two with close phases snapshot together each time)."
    ))] = 0.2
    fold_jitter: Annotated[float, Meta(ge=0, lt=1, description=(
        "Spread of the point at which the store folds its delta runs into its base (they hold 1/4 "
        "of it: a fold moves the whole base, seconds at 10^8 entries, while this node's reads go to "
        "other replicas and its writes are held), so replicas that hold the same rows do not fold "
        "together: each fold's point "
        "is scaled by `1 + jitter * (2u - 1)`, u uniform in [0, 1) from a generator seeded by the "
        "node's name, drawn anew after every fold. The mean point is unchanged; 0 folds every "
        "node at exactly 1/4 (docs/storage.md \"Folds off the event loop\")."
    ))] = 0.2
    fold_defer_bytes: Annotated[int, Meta(ge=0, description=(
        "While a fold of the delta runs moves the rows (seconds at 10^8 entries), a writer's batch is "
        "logged and acknowledged at once and applied to the rows when the fold ends, up to this many "
        "bytes of batches held in memory; past them, and for a retry of a batch held already, a write "
        "waits for the fold. 0 makes every write wait for the fold (the behaviour before this key). "
        "docs/storage.md \"Folds off the event loop\"."
    ))] = 256 << 20
    snapshot_busy_share: Annotated[float, Meta(gt=0, le=1, description=(
        "The most of its time a snapshot's writing thread works: after each slice of work (a few "
        "thousand rows, or about 1 MiB written) it rests `work * (1 - share) / share`. Writes go "
        "on while a snapshot is written, but the writing thread competes with them for Python's "
        "GIL (and, on a busy host, for a core); a smaller share leaves more to applies and makes "
        "the snapshot take up to 1 / share as long (and rows changed meanwhile are kept twice "
        "that much longer). 1 never rests."
    ))] = 0.5
    snapshot_drop_cache: Annotated[bool, Meta(description=(
        "Not with snapshot-direct-io (unless the file system refuses it). "
        "true: a timer's snapshot leaves the page cache as it is written (`posix_fadvise(DONTNEED)` "
        "on each part once it is on disk and checksummed), so that writing it does not evict other "
        "pages (a mapped base's, the log's) for a file read only after a crash: for nodes whose "
        "snapshot is larger than their free memory, where the kernel would otherwise reclaim a "
        "snapshot's size of cache every time. The stop's final snapshot stays cached (the next start "
        "maps it). Off by default: on a machine with memory to spare it saved no CPU (snapshot "
        "writes 1.62 kept against 1.74 CPU s/GB dropped, docs/storage.md \"Snapshots out of the page "
        "cache\") and a restart after a crash then reads the snapshot from disk (1.4-1.9 s/GB against "
        "0.94 from the cache)."
    ))] = False
    snapshot_direct_io: Annotated[bool, Meta(description=(
        "true: a timer's snapshot is written with `O_DIRECT`, from aligned buffers straight to the "
        "disk, leaving no page-cache copy (snapshot-drop-cache then has no effect on it): no "
        "snapshot's size of page cache is filled, written back and reclaimed each time, none of a "
        "mapped base's or the log's pages are evicted for it, and its kernel CPU falls from 0.2-1.2 "
        "to 0.1-0.3 s per GB (the whole write 0.83-0.87 against 0.86-0.96 CPU s/GB through the cache "
        "on the development VM: docs/storage.md \"Direct snapshot writes\"). For nodes whose "
        "snapshot is larger than their free memory, the mission's size. The price: a restart after a "
        "crash reads that snapshot from disk (the cluster bench's recovery 1.23 -> 1.89 s/GB on a host "
        "with memory to spare), as a node whose snapshot exceeds its free memory must anyway; hence "
        "off by default. The stop's final snapshot is always written through the page cache (the next "
        "start maps it). Where the file system refuses `O_DIRECT` (tmpfs on older kernels, some "
        "network file systems) the snapshot is written through the page cache instead, with a "
        "warning once."
    ))] = False
    snapshot_load_copy_rows: Annotated[bool, Meta(description=(
        "No effect since snapshot format 2 (the row engine, issue 14 phase 2): a restart reads the "
        "snapshot's arrays straight into the engine, with no per-row buffers to share or copy. "
        "Kept so that configuration files that set it still load."
    ))] = False
    snapshot_load_map: Annotated[bool, Meta(description=(
        "At start-up, map the newest snapshot file read-only and let the rows' keys and offsets be "
        "views of it instead of reading it into fresh memory (the strengths, which applies change in "
        "place, are still copied): the kernel then maps the page cache's pages instead of faulting in "
        "fresh ones (docs/storage.md \"Where a snapshot load goes\"). Done when no log record follows "
        "the snapshot (the stop's final snapshot) or the log after it is small (under a quarter of the "
        "store and one replay window: a kill -9 between snapshots), whose replay then leaves its new "
        "keys in a delta run instead of merging them into the mapped arrays. Until the first fold into "
        "the base replaces those arrays the snapshot file stays mapped: once the next snapshot deletes "
        "it, its disk space is held (counted in the node's disk use) until then, and its pages are page "
        "cache the kernel may evict and read back. Every checksum and row check is the same. A larger "
        "log is replayed into a read snapshot. false always reads."
    ))] = True
    replay_threads: Annotated[int, Meta(ge=0, le=1024, description=(
        "Threads that replay the update log at start-up: a replay window's rows are grouped and "
        "added in that many threads, each on its own rows, with the same result as one thread bit "
        "for bit (docs/storage.md \"Replay in threads\"); the snapshot's row checks and a mapped "
        "load's copies run in as many (\"Row checks and copies in threads\"). 0 uses every CPU the daemon may run on "
        "(its affinity mask); 1 replays in the opening thread only. Nothing else runs on the node "
        "while it replays: it serves nothing until the store is open."
    ))] = 0
    restart_read_ahead_bytes: Annotated[int, Meta(ge=0, le=1 << 40, description=(
        "At start-up, how far ahead of the store's recovery a thread asks the kernel to read the "
        "snapshot and the log segments after it (`POSIX_FADV_WILLNEED` in 128 KiB steps: one call "
        "for a whole file is cut to the device's readahead size, a few MiB). When those files are not "
        "in the page cache (after a reboot, or evicted) the disk then reads while the load checks "
        "what came before, instead of each fault waiting for its own read (docs/storage.md "
        "\"Reading a restart's files ahead\"). The window bounds the page cache filled ahead of "
        "use. 0 turns it off."
    ))] = 256 << 20
    fsync_group_commit_ms: Annotated[float, Meta(ge=0, le=1000, description=(
        "Window in which log appends share one fsync. Larger windows raise write throughput and "
        "add that much latency to each acknowledged write; 0 syncs every append."
    ))] = 5.0
    ramp_up_s: Annotated[float, Meta(ge=0, le=3600, description=(
        "Seconds over which hint delivery to a storage member that came back up (or joined) is "
        "paced: a token bucket whose rate grows linearly from `hint-ramp-start-bytes-per-s` to 16 "
        "times that, then unpaced. Spreads a long outage's hints so the returning node also serves "
        "new writes and reads; delivery always completes. 0 delivers at once."
    ))] = 30.0
    hint_ramp_start_bytes_per_s: Annotated[float, Meta(gt=0, description=(
        "Hint delivery rate to a member at the start of its ramp (see `ramp-up-s`). Bytes "
        "deliverable during the ramp: 8.5 x this x ramp-up-s (1 GiB at 4 MiB/s over 30 s)."
    ))] = 4.0 * 2**20
    hint_retry_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "Seconds between retries of the hints held for members that are live, besides the "
        "delivery a member's return starts at once. Catches a target that came back before its "
        "failure was noticed (no \"came up\" event); shorter delivers sooner in that case at the "
        "cost of one request per such target per retry."
    ))] = 5.0
    heap_trim_interval_s: Annotated[float, Meta(ge=0, le=3600, description=(
        "Seconds between returns of the C heap's free pages to the kernel (glibc `malloc_trim`, "
        "in a worker thread). Applies and merges free many temporaries of up to 32 MiB that "
        "glibc keeps mapped: measured on a cluster training run, a storage node's RSS was 47-54 B "
        "per 21-byte entry without it and 29 after one trim. A trim costs about 1 ms per 10 MB "
        "freed since the last one, during which other threads' allocations may wait. A node that "
        "logged nothing over a whole interval first folds its delta runs into the base (in a "
        "worker thread, like an apply's fold: one move of the base's entries; a delta entry costs "
        "16-32 B more than a base entry). 0: never (the heap then only shrinks after a start-up's "
        "replay, and delta runs wait for the next apply's fold)."
    ))] = 30.0
    malloc_mmap_threshold_bytes: Annotated[int, Meta(ge=0, le=1 << 30, description=(
        "C heap blocks of this size or more get their own mapping, returned to the kernel when "
        "freed (glibc `mallopt` M_MMAP_THRESHOLD, set at the storage service's start, for the "
        "whole process). glibc's default threshold slides up to the largest block freed (32 MiB), "
        "so applies' and merges' temporaries of 1-32 MiB stay resident in the main arena, which "
        "`malloc_trim` did not return: a settled cluster node kept 3.4-10.7 B per stored entry "
        "in no live array, 1.6-1.9 with 1 MiB. The cost: such blocks pay their page faults at "
        "every allocation (one-process apply CPU ~15 % more at 1 MiB). 0: glibc's default."
    ))] = 1 << 20
    join_mode: Annotated[JoinMode, Meta(description=(
        "What a storage node not yet active in the storage ring (giaannd/cluster/ring.py) does at start. "
        "`auto`: after joining the seeds, pull the ring (up to 3 s); if it has no active member "
        "the node bootstraps (adds itself), else it stays standby and starts the streaming join. "
        "`bootstrap`: add itself to the ring at once (the initial nodes of a new cluster). "
        "`manual`: stay standby until `giaannctl node join-ring`. A node already active stays "
        "active; a node the ring marks removed (decommissioned) never re-adds itself."
    ))] = "auto"
    stream_bind: Annotated[str, Meta(description=(
        "Listener of this node's stream endpoint (topology operations: column streams in, "
        "source control, repair), advertised in its metadata as `stream`: a `tcp://host:port` URL "
        "(it listens on the node's tcp:// transport; `mem://NAME` on a node bound to mem:// only). "
        "Empty: the host of the first `tcp://` entry of `transport.bind`, port 0."
    ))] = ""
    release_delay_s: Annotated[float, Meta(ge=0, le=86400, description=(
        "Seconds after a committed ring change that took columns away from this node before "
        "their rows are deleted (if no stream has run here meanwhile and no override is set). "
        "Leaves time for writes computed under the old placement to drain."
    ))] = 30.0
    retry_base_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "Backoff of the storage role's background retries: a snapshot that failed (a full disk, an "
        "I/O error) and the automatic repair after a torn log tail. The wait after failure n is "
        "drawn from U(0, min(`retry-cap-s`, retry-base-s x 2^n)) (full jitter), so nodes that "
        "failed together do not retry in step."
    ))] = 1.0
    retry_cap_s: Annotated[float, Meta(gt=0, le=86400, description=(
        "Ceiling of the retry backoff (see `retry-base-s`): a node whose disk stays full tries "
        "its snapshot at least this often, so it catches up soon after space returns."
    ))] = 60.0
    disk_full_probe_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "While the node refuses writes because its disk is full (a write failed with ENOSPC or "
        "EDQUOT), how often it checks the free space of its data directory's file system "
        "(statvfs) to resume writes by itself."
    ))] = 5.0
    disk_resume_free_bytes: Annotated[int, Meta(ge=0, description=(
        "Free bytes the data directory's file system needs before writes resume after a disk-full "
        "refusal. Hysteresis: resuming at the first free byte would flip between full and not "
        "full, and gossip each flip, on every write; one update-log segment (64 MiB) leaves room "
        "for a burst of writes and the first blocks of the snapshot that shrinks the log."
    ))] = 64 * 2**20
    error_log_interval_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "Repeated storage errors of one kind (writes refused for a full disk, a log write "
        "failing with the same error, a snapshot retried) are logged at most once per this many "
        "seconds, with the number held back; counters and /v1/status show every one."
    ))] = 10.0
    auto_repair: Annotated[bool, Meta(description=(
        "When recovery cut a torn update-log tail (bytes a crash or a damaged disk left "
        "incomplete, possibly acknowledged ones), repair this node from its live peers by itself "
        "once it has joined (what `giaannctl node repair` does). Off: /v1/status still shows "
        "`torn_tail_bytes` and the operator runs the repair."
    ))] = True
    read_chunk_bytes: Annotated[int, Meta(ge=4096, le=MAX_READ_CHUNK_BYTES, description=(
        "Bytes (21 per entry) of one read reply: a storage node answers a `ReadRows` with rows up "
        "to this many bytes and lists any row larger than it, which the client then reads in parts "
        "of this size (`ReadRowPart`), four in flight, into one preallocated row: no row is too "
        "big to read. Larger parts cost fewer round trips; smaller ones bound what a node copies "
        "and holds per request (one part per request in flight). The storage node caps a "
        "client's parts at its own value; a client reads with the value of its own config. 8 MiB: "
        "a part is copied in about a millisecond, and four in flight keep a loopback connection "
        "busy (tools/bench/bigrow.py). Streams (rebalance) cut rows by their own chunk size."
    ))] = DEFAULT_READ_CHUNK_BYTES
    auto_repair_timeout_s: Annotated[float, Meta(gt=0, le=86400, description=(
        "Bound on the automatic repair: attempts that find no live peer or a peer that does not "
        "answer are retried with the `retry-base-s` backoff until this many seconds after start; "
        "then the repair is reported failed (status, log, metrics) and left to the operator."
    ))] = 600.0
    stream_window: Annotated[int, Meta(ge=1, le=64, description=(
        "Items (chunks of rows, forwarded writes) a topology stream this node sends (join, "
        "decommission, removenode, replace) keeps unacknowledged on the wire. The receiver applies "
        "them in order as they arrive and acknowledges each once durable, so the source's reads, "
        "the wire, the receiver's applies and its fsyncs overlap, and items applied together share "
        "one fsync. A receiver that restarts makes the source re-send at most this many items "
        "(each up to a 4 MiB chunk), and the receiver holds at most this many items' buffers per "
        "stream. 1: stop and wait (one item, one fsync per round trip). Capped at 64."
    ))] = 4
    register_ram_bytes: Annotated[int, Meta(ge=2**20, description=(
        "Live register state this node keeps in RAM (docs/replication.md, \"Registers\"): keys, "
        "values under `register-spill-bytes` (cluster jobs' rows, lease shards, the job index: a "
        "few KiB per job, at most 64 unfinished jobs) and ~110 bytes of bookkeeping per key, "
        "corpus chunks included. A change past it is refused (`register_store_full`) with nothing "
        "changed; 64 MiB is far above real use and bounds what a client can make a node hold."
    ))] = DEFAULT_REGISTER_RAM_BYTES
    register_spill_bytes: Annotated[int, Meta(ge=256, le=2**21, description=(
        "Register values this long or longer are kept on disk only (the register log already "
        "holds them; the node keeps their offset and reads the record back, checksummed, on a "
        "read): cluster jobs' corpus chunks (K sentences: tens to hundreds of KB, written once). "
        "Shorter values, rewritten by every compare-and-set, stay in RAM."
    ))] = DEFAULT_REGISTER_SPILL_BYTES
    register_disk_bytes: Annotated[int, Meta(ge=2**20, description=(
        "Live register values kept on disk (those of `register-spill-bytes` or more): the corpus "
        "chunks of running cluster jobs, about replication-factor / storage nodes of each corpus's "
        "size (msgpack, ~1.3x the CoNLL-U text's token columns). A change past it is refused "
        "(`register_store_full`); the register log may reach 4x this before it is compacted."
    ))] = DEFAULT_REGISTER_DISK_BYTES


class ComputeConfig(_Section):
    """The compute role: training workers and inference sessions."""

    train_workers: Annotated[int, Meta(ge=1, le=1024, description=(
        "Concurrent training workers on this node, each processing one sentence batch."
    ))] = 2
    coalesce_k: Annotated[int, Meta(ge=1, le=65536, description=(
        "Sentences whose column updates are merged before being sent to owners. Larger K sends "
        "fewer, bigger updates (throughput) at the cost of staler reads within a batch."
    ))] = 32
    row_cache_bytes: Annotated[int, Meta(ge=0, description=(
        "RAM for caching column rows read from storage nodes during inference; 0 disables it."
    ))] = 1 * _GIB
    max_sessions: Annotated[int, Meta(ge=1, le=100000, description=(
        "Concurrent inference (generate/eval) sessions; further requests get a busy error."
    ))] = 64
    read_ramp_up_s: Annotated[float, Meta(ge=0, le=3600, description=(
        "Seconds over which a storage member that came back up (or joined) is ramped into this "
        "node's reads: it serves a fraction of the rows it is first in line for that grows linearly "
        "from 0.1 to 1 (the other live replicas serve the rest), so a cold node is not flooded. "
        "0 sends it its full share at once."
    ))] = 30.0
    read_fewest_nodes: Annotated[bool, Meta(description=(
        "Send the rows of one read to as few live storage nodes as possible (a greedy cover over "
        "each row's owners) instead of each row to its own first owner. Each request costs a "
        "fixed ~0.1 ms of CPU at both ends, so with R = 3 on 3 nodes a 16-row read takes one "
        "request instead of three (tools/bench/readpath.py). The trade-off: a client's reads lean "
        "on the nodes that own most of what it asks at once instead of spreading by row. Failover "
        "to the other owners and the read ramp (which turns the grouping off while a member ramps) "
        "are unchanged."
    ))] = False
    infer_read_fewest_nodes: Annotated[bool, Meta(description=(
        "Inference's row fetches (generate, eval) group each read's rows on as few live storage "
        "nodes as possible, whatever read-fewest-nodes says for other reads. A fetch is a prompt's "
        "rows (up to 64, or several prompts' with infer-readahead-prompts): one request "
        "instead of one per first owner halves it (R = 3 on 3 nodes: 1.35 -> 0.66 ms per prompt "
        "read; docs/compute.md, Inference). Off: inference reads follow read-fewest-nodes."
    ))] = True
    infer_readahead_prompts: Annotated[int, Meta(ge=0, le=4096, description=(
        "Prompts of an evaluation whose rows are read before their session starts: when a "
        "session starts, the first rows (up to 64) of the next this-many prompts are asked for, "
        "refilled by halves, so one request carries several prompts and the rows arrive while "
        "earlier prompts step (one session at a time otherwise waits one read per prompt). Rows "
        "held are bounded by (max-sessions + this) x 64. 0 turns it off (docs/compute.md, Inference)."
    ))] = 16
    row_memory_keep_bytes: Annotated[int, Meta(ge=0, description=(
        "Memory of large rows (rows read in parts, over storage.read-chunk-bytes) that this "
        "node's reads dropped, kept idle up to this many bytes and received into again, mapped "
        "and already faulted in: the next large row skips the kernel's zeroing of fresh pages "
        "(a 10^8-entry row read 0.43-0.61x a raw socket into kept memory against 0.21-0.38x into "
        "fresh; docs/replication.md). The cost is up to this much idle RSS between large reads. "
        "0 keeps none."
    ))] = 256 * 1024 * 1024
    infer_remember_bytes: Annotated[int, Meta(ge=0, le=1 << 40, description=(
        "Memory each inference session may spend remembering the rows of >= 2,048 entries it "
        "fired (8 bytes per entry, 20 with test-set constants), so that a row fired again skips "
        "the slot map: checked, not looked up (3-6x less per entry at 10^5-10^6 entries; "
        "docs/model.md, The LIF step). At most max-sessions x this in all, next to the sessions' "
        "own state (~120 bytes per neuron). 0: nothing remembered."
    ))] = 48 << 20
    resume_jobs: Annotated[bool, Meta(description=(
        "Resume unfinished training jobs from their journals (<data-dir>/compute/jobs/) when the "
        "node starts, under the same writer id and batch ids, so nothing is counted twice. Off: "
        "the journals stay on disk and the jobs are listed as not resumed in the log."
    ))] = True
    corpus_dir: Annotated[str, Meta(description=(
        "The only directory whose files `POST /v1/train` and `POST /v1/eval` read (`giaannctl "
        "train start`, `eval --corpus`): a relative request path is taken inside it, symlinks "
        "are resolved before the check, and a path that ends up outside is refused with 403. "
        "Without it the admin token would make the daemon read, and cache a tagged copy of, any "
        "file it can read (its cluster key; /etc/shadow as root). Empty means "
        "`<data-dir>/corpora`; relative to `data-dir` unless absolute; created (mode 0750) on "
        "start. Put corpora there or point this at where they live."
    ))] = ""
    export_dir: Annotated[str, Meta(description=(
        "The only directory `POST /v1/export` (`giaannctl export`) writes into, with the same "
        "rules as `corpus-dir`, so the token cannot replace the daemon's own files (admin token, "
        "ring, keys). Inside it an existing file that is not a previous export is only replaced "
        "when the request says `overwrite`. Empty means `<data-dir>/exports`; relative to "
        "`data-dir` unless absolute; created (mode 0750) on start."
    ))] = ""
    export_page_bytes: Annotated[int, Meta(ge=64 * 1024, le=16 * 1024 * 1024, description=(
        "Bytes of one scan page an export asks of each storage node (`ScanRows.max-bytes`; "
        "storage caps it at 16 MiB). The export reads every live node's share concurrently and "
        "merges them k-way in key order, holding about two pages per node (the merge's and the "
        "one in flight), so its memory is about 2 x nodes x this, whatever the model size. "
        "A row bigger than a page comes in pieces. Larger pages: fewer requests (each costs "
        "a round trip and a placement filter), more memory; 4 MiB reaches the scan's full "
        "speed (docs/operations.md, \"Limits and hardening\")."
    ))] = 4 * 1024 * 1024
    export_chunk_entries: Annotated[int, Meta(ge=1024, le=16 * 1024 * 1024, description=(
        "Entries an export turns into JSONL lines at a time (one line each, about 150 bytes as "
        "text, ~400 bytes while being made), so the text in memory stays near 25 MiB at the "
        "default however big a merged scan page is. Smaller: less memory, more per-chunk work "
        "(one lookup of each distinct source row and target neuron per chunk)."
    ))] = 65_536
    column_rows_default_entries: Annotated[int, Meta(ge=1, le=MAX_COLUMN_ROWS_ENTRIES, description=(
        "Entries `GET /v1/columns/{column}/rows` (`giaannctl column rows`) answers when the "
        "request names no `limit`: the column's rows in key order, its entries cut after this "
        "many (`truncated`; `total_entries` still counts them all). About 100 bytes of JSON per "
        "entry: 100,000 entries are a ~10 MB answer, quick to read and to plot."
    ))] = 100_000
    column_rows_max_entries: Annotated[int, Meta(ge=1, le=MAX_COLUMN_ROWS_ENTRIES, description=(
        "The most entries one `column rows` request may ask for (`limit`; more is a 400). The "
        "node holds them twice while it answers (the rows read from storage, ~21 bytes an entry, "
        "and the JSON, ~100 bytes an entry, plus Python lists of the words while it is built), "
        "so 10,000,000 entries cost a few GB for the length of the request."
    ))] = 10_000_000
    cluster_jobs: Annotated[bool, Meta(description=(
        "Training jobs are cluster jobs (docs/compute.md, \"One job across every compute node\"): "
        "`train start` streams the corpus into the storage cluster's registers and every compute "
        "node with this on works on the job's windows under leases, including nodes that join "
        "mid-job; any node answers `train status` for it, and the job survives the loss of the "
        "node that received it. Off: a job runs on the receiving node only (journaled on its "
        "disk), unless the request says `\"cluster\": true`. On (the default), a request says "
        "`\"cluster\": false` (`giaannctl train start --local`) for a node-local job, and one "
        "asking for more than one epoch without saying `cluster` is node-local (a cluster job "
        "trains one epoch). Every compute node of a cluster should use the same setting, or the "
        "nodes with it off sit cluster jobs out."
    ))] = True
    eval_spread: Annotated[bool, Meta(description=(
        "`eval` spreads its prompts over every live compute node (docs/compute.md, \"One "
        "evaluation across every compute node\"): the receiving node encodes them, each node runs "
        "a contiguous share, the figures are merged exactly and the reply's `by_node` says what "
        "each node did. Off: the receiving node runs every prompt, unless the request says "
        "`\"spread\": true`. With one compute node it makes no difference."
    ))] = True
    eval_share_timeout_s: Annotated[float, Meta(gt=0, le=86400, description=(
        "Bound on one other node's share of a spread `eval`; past it (or on any failure of that "
        "node) the share is redone on the receiving node, so the result stays complete. Longer "
        "than a share takes: about prompts / nodes / 2,000 prompts per second."
    ))] = 600.0
    eval_share_max_bytes: Annotated[int, Meta(ge=1024, le=1 << 30, description=(
        "Largest encoded share of a spread `eval` (its prompts, encoded, and their flags: about "
        "1 KB per prompt) this node sends to another compute node or accepts from one. A larger "
        "share is run on the receiving node instead, and the reply's `redone` says why; a larger "
        "one received is refused (`BadRequest`) before it is decoded. The receiver decodes a share "
        "into Python objects several times its size, so this bounds that memory."
    ))] = 64 << 20
    eval_connect_timeout_s: Annotated[float, Meta(gt=0, le=600, description=(
        "Bound on connecting to another compute node to send it its share of a spread `eval`. A "
        "live node answers in milliseconds; a node that died but is still listed alive refuses "
        "until this passes, which is what it costs before its share is redone on the receiving "
        "node (and it is reported to membership as unreachable)."
    ))] = 3.0
    eval_history: Annotated[int, Meta(ge=0, le=100_000, description=(
        "Successful `eval`s this node remembers for `GET /v1/evals` (`giaannctl evals list`): "
        "when, top-1 and its counts, the sentences trained by the jobs the node knew then, and "
        "what was evaluated. Kept in `<data-dir>/compute/eval-history.json`, rewritten "
        "atomically after each eval (~185 bytes per entry); beyond the bound the oldest are "
        "forgotten. 0 keeps no history and writes no file."
    ))] = 1000
    lease_s: Annotated[float, Meta(gt=0, le=3600, description=(
        "A cluster job's lease on its windows is taken over by another node once it has gone "
        "unrenewed this long (seen by the other node's clock: no clock sync needed, only equal "
        "rates). Shorter: a dead node's windows are redone sooner; longer: fewer renewals and no "
        "take-over during a long pause (GC, a slow storage write). Take-over happens within "
        "lease-s + lease-probe-interval-s of the last renewal."
    ))] = 10.0
    lease_renew_s: Annotated[float, Meta(ge=0, le=3600, description=(
        "Renew a held lease when no write confirmed it for this long; must be below lease-s. "
        "0 means lease-s / 3 (two renewals may fail before the lease is lost)."
    ))] = 0.0
    lease_probe_interval_s: Annotated[float, Meta(gt=0, le=600, description=(
        "How often a node reads a cluster job's row, its home lease shard and the shards it "
        "holds leases in (and the job index, to find new jobs). Register reads per node per "
        "interval: about 3 per job; a cancel or a new job is seen within one interval."
    ))] = 1.0
    lease_idle_probe_s: Annotated[float, Meta(gt=0, le=600, description=(
        "How often a node reads a cluster job's row while it holds no lease and the stage has no "
        "window left to grant (the stage's last windows run elsewhere): the next stage and the "
        "job's end are seen this soon instead of up to `lease-probe-interval-s` late, which was "
        "most of a short job's overhead. Costs one register read per interval per such node, "
        "only during a stage's tail. Capped by `lease-probe-interval-s`."
    ))] = 0.1
    lease_windows: Annotated[int, Meta(ge=1, le=4096, description=(
        "Windows (of coalesce-k sentences) per lease grant. More: fewer register writes per "
        "window; fewer: less redone when a node dies (at most one lease's windows) and a finer "
        "spread of the job's tail over the nodes."
    ))] = 4
    lease_shards: Annotated[int, Meta(ge=1, le=256, description=(
        "Lease shards per stage of a new cluster job (capped by its windows). Every grant in a "
        "shard is a compare-and-set on one register, so grants per second grow with shards; "
        "about one shard per six compute nodes keeps conflicting writes moderate "
        "(docs/compute.md figures)."
    ))] = 1
    tag_processes: Annotated[int, Meta(ge=0, le=256, description=(
        "Processes that tag the raw-text windows of cluster jobs on this node (spaCy, one model "
        "each: about a second to start and ~150 MB of RAM per process). Up to train-workers windows "
        "are tagged at once, so set it to min(cores, train-workers) for tagging to use every core. "
        "0 tags in one worker thread of the daemon (no extra processes)."
    ))] = 0
    lexicon: Annotated[str, Meta(description=(
        "Ever-POS lexicon the delimiter rules read (docs/model.md, \"The lexicon\"): empty for the "
        "one shipped with giaannd, or a file, relative to `data-dir` unless absolute: giaannd's "
        "format, the reference's `everPos.wordnet.pkl.gz` (parsed safely: it cannot run code) or "
        "`word<TAB>UPOS` lines. It decides column spans, so every compute node of a cluster must "
        "use the same one; a file that cannot be read stops the node at start."
    ))] = ""
    model_profile: Annotated[Literal["word", "giaann-v2"], Meta(description=(
        "How text becomes columns and features (docs/model.md, \"Model profiles\"): `word` (the "
        "default) trains word-level tokens, one sentence per sequence, with hashed, grow-only "
        "dictionaries; `giaann-v2` is the reference's v2 profile: o200k_base subwords that inherit "
        "their word's POS, 3-sentence sequences, fixed 200k dictionaries (needs the `bpe-openai` "
        "package). The two cannot share a cluster: a training job records its profile in "
        "storage's vocabulary and refuses to start on a cluster trained under the other, so every "
        "compute node of a cluster must use the same one."
    ))] = "word"
    device: Annotated[Literal["auto", "cpu", "cuda"], Meta(description=(
        "Where this node's training batches and inference (LIF) steps compute (docs/compute.md, "
        "\"Devices\"). `cpu`: the numpy path, the fastest on a CPU (small arrays, per-call overhead "
        "dominates torch there). `cuda`: torch on the first CUDA device; a host without a usable "
        "one stops the node at start with a config error (exit 2) rather than running on the "
        "CPU at a fraction of the speed it was sized for. `auto`: `cuda` where a CUDA device is "
        "usable, else `cpu`. The default is `cpu` because the CUDA path has not yet run on a "
        "GPU (README, \"Known gaps\"); results agree with the CPU path within float32 tolerance."
    ))] = "cpu"


class Config(_Section):
    """The whole daemon configuration; one TOML file maps onto it section by section."""

    node: Annotated[NodeConfig, Meta(description="This node.")] = msgspec.field(
        default_factory=NodeConfig)
    cluster: Annotated[ClusterConfig, Meta(description="Cluster identity and seeds.")] = (
        msgspec.field(default_factory=ClusterConfig))
    admin: Annotated[AdminConfig, Meta(description="Admin API.")] = msgspec.field(
        default_factory=AdminConfig)
    logging: Annotated[LoggingConfig, Meta(description="Logging.")] = msgspec.field(
        default_factory=LoggingConfig)
    transport: Annotated[TransportConfig, Meta(description="Data-plane transports.")] = (
        msgspec.field(default_factory=TransportConfig))
    membership: Annotated[MembershipConfig, Meta(description="Gossip membership.")] = (
        msgspec.field(default_factory=MembershipConfig))
    storage: Annotated[StorageConfig, Meta(description="Storage role.")] = msgspec.field(
        default_factory=StorageConfig)
    compute: Annotated[ComputeConfig, Meta(description="Compute role.")] = msgspec.field(
        default_factory=ComputeConfig)

    @classmethod
    def loopback(cls, data_dir: str, name: str = "", roles: list[Role] | None = None) -> Config:
        """Profile for a node of a local cluster on one host (tools/local_cluster, tests).

        Every listener is on 127.0.0.1 with port 0 (the OS picks; the admin address lands in
        ``<data-dir>/admin.addr``), membership uses the ``loopback`` timing profile and the
        replication factor drops to 1 so a single node can serve writes.
        """
        return cls(
            node=NodeConfig(name=name, data_dir=data_dir,
                            roles=["storage", "compute"] if roles is None else roles),
            admin=AdminConfig(listen="127.0.0.1:0"),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            membership=MembershipConfig(profile="loopback", bind_address="127.0.0.1",
                                        bind_port=0),
            storage=StorageConfig(replication_factor=1, write_quorum=1),
        )

    def data_path(self, name: str) -> Path:
        """Resolve ``name`` against ``node.data-dir`` unless it is absolute."""
        return Path(self.node.data_dir) / name


def _validate(cfg: Config) -> Config:
    """Cross-field rules msgspec's per-field constraints cannot express."""
    _check_finite(cfg)
    if cfg.storage.write_quorum > cfg.storage.replication_factor:
        raise ConfigError(
            f"write-quorum ({cfg.storage.write_quorum}) exceeds replication-factor "
            f"({cfg.storage.replication_factor})", "$.storage.write-quorum")
    if cfg.storage.placement_weight != PLACEMENT_WEIGHT:
        # Refused rather than ignored: a key that silently does nothing misleads whoever sizes
        # nodes by it. Weighted placement is not switched on because changing a running cluster's
        # strategy would move ownership without streaming the rows (docs/storage.md, Placement).
        raise ConfigError(
            f"placement-weight {cfg.storage.placement_weight} is not supported yet: placement "
            "ignores weights (every storage node owns an equal share), and switching a running "
            "cluster to weighted placement would move ownership without streaming the rows; leave "
            f"it at {PLACEMENT_WEIGHT:g}", "$.storage.placement-weight")
    if len(set(cfg.node.roles)) != len(cfg.node.roles):
        raise ConfigError(f"duplicate role in {cfg.node.roles}", "$.node.roles")
    gossip = cfg.membership.resolved()
    if gossip.probe_timeout_s >= gossip.probe_interval_s:
        raise ConfigError(
            f"probe-timeout-s ({gossip.probe_timeout_s}) must be below probe-interval-s "
            f"({gossip.probe_interval_s}) (profile {cfg.membership.profile!r} plus overrides)",
            "$.membership.probe-timeout-s")
    c = cfg.compute
    if c.lease_renew_s and c.lease_renew_s >= c.lease_s:
        raise ConfigError(f"lease-renew-s ({c.lease_renew_s}) must be below lease-s ({c.lease_s})",
                          "$.compute.lease-renew-s")
    _check_addresses(cfg)
    return cfg


def _check_finite(cfg: Config) -> None:
    """TOML has ``inf``, and keys bounded only below took it; the daemon's arithmetic does not
    (``node.drain-timeout-s = inf`` gave the services' stops ``inf - inf`` = nan seconds: none).
    NaN fails every bound already."""
    for section in msgspec.structs.fields(cfg):
        part = getattr(cfg, section.name)
        for f in msgspec.structs.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"Expected a finite `float`, got {value}",
                                  f"$.{section.encode_name}.{f.encode_name}")


#: Bind addresses that mean "every interface": not an address anyone can send to.
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})


def _is_port(text: str, low: int = 0) -> bool:
    # ASCII digits only: int() also reads other scripts' digits ("٣" is 3)
    return text.isascii() and text.isdigit() and low <= int(text) <= 65535


def _check_url(url: str, path: str) -> str:
    """A data-plane URL as the transports read it (``scheme://host:port``, ``mem://NAME``);
    returns its scheme."""
    try:
        scheme = scheme_of(url)
        if scheme == "mem" and not url.partition("://")[2]:
            raise ValueError(f"expected mem://name, got {url!r}")
        if scheme != "mem":
            parse_host_port(url, scheme)
    except ValueError as exc:  # (urlsplit's port error does not name the URL)
        raise ConfigError(str(exc) if url in str(exc) else f"{url!r}: {exc}", path) from None
    return scheme


def parse_seed(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) of a membership listener: a ``cluster.seeds`` entry, or a
    seed ``node join`` names (services/membership.py).

    Raises:
        ValueError: not host:port with a port in 1..65535.
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not _is_port(port, low=1):
        raise ValueError(f"seed {text!r} is not host:port")
    host = host.strip("[]")
    try:
        host.encode("idna")  # as the resolver encodes it: an empty or over-long label fails there
    except UnicodeError:
        raise ValueError(f"seed {text!r}: {host!r} is not a host name or address") from None
    if "\x00" in host:
        raise ValueError(f"seed {text!r}: a host name holds no NUL character")
    return host, int(port)


def split_listen(listen: str) -> tuple[str, int]:
    """``admin.listen`` as the daemon binds it: ``host:port`` (``[v6]:port``; an empty host is
    127.0.0.1).

    Raises:
        ConfigError: not host:port with a port in 0..65535.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not _is_port(port):
        raise ConfigError(f"expected host:port, got {listen!r}", "$.admin.listen")
    return host.strip("[]") or "127.0.0.1", int(port)


def _check_addresses(cfg: Config) -> None:
    """Addresses no listener could bind or no peer could dial. The daemon finds them too, but only
    at start, after it made the data directory, node id and admin token (a bad ``stream-bind``
    after the node had joined the ring, and with exit 1), so they are refused here first."""
    split_listen(cfg.admin.listen)
    _check_transport(cfg.transport)
    for seed in cfg.cluster.seeds:
        try:
            parse_seed(seed)
        except ValueError as exc:
            raise ConfigError(str(exc), "$.cluster.seeds") from None
    m = cfg.membership
    if m.advertise_address in _WILDCARDS:
        raise ConfigError(f"advertise-address {m.advertise_address!r} is a wildcard no other member "
                          "can reach: advertise this node's address", "$.membership.advertise-address")
    if m.bind_address in _WILDCARDS and not m.advertise_address:
        # (the address gossip carries is where members send probes: runtime/node.py refuses the
        # data plane's equivalent, a wildcard bind without transport.advertise, for that reason)
        raise ConfigError(f"bind-address {m.bind_address!r} is a wildcard no other member can "
                          "reach: set advertise-address to this node's address",
                          "$.membership.advertise-address")
    stream = cfg.storage.stream_bind
    if stream:
        # the stream endpoint listens on the tcp:// transport, or mem:// on a node without one
        # (storage/rebalance/daemon_control.py)
        has = {url.partition("://")[0] for url in cfg.transport.bind}
        want = "mem" if "tcp" not in has and "mem" in has else "tcp"
        if _check_url(stream, "$.storage.stream-bind") != want:
            raise ConfigError(f"expected a {want}:// address (the stream endpoint listens on this "
                              f"node's {want}:// transport), got {stream!r}",
                              "$.storage.stream-bind")
    _check_port_clashes(cfg)


def _check_transport(t: TransportConfig) -> None:
    """``transport.bind`` and ``advertise`` as the runtime binds and gossips them (runtime/node.py
    ``_bind`` checks the same, for configs built without this loader): URLs its backends parse, a
    wildcard bind only with an advertised URL of its scheme, and advertised URLs a peer can dial
    (no port 0, no wildcard host) of a scheme this node listens on."""
    bound = {_check_url(url, "$.transport.bind") for url in t.bind}
    advertised: set[str] = set()
    for url in t.advertise:
        scheme = _check_url(url, "$.transport.advertise")
        if scheme != "mem":
            host, port = parse_host_port(url, scheme)
            if port == 0:
                raise ConfigError(f"{url!r} advertises port 0, where no peer can reach this node",
                                  "$.transport.advertise")
            if host in _WILDCARDS:
                raise ConfigError(f"{url!r} advertises a wildcard address, which no peer can dial: "
                                  "advertise this node's address", "$.transport.advertise")
        if scheme not in bound:
            raise ConfigError(f"{url} advertises {scheme}:// but transport.bind has no {scheme}:// "
                              "listener", "$.transport.advertise")
        advertised.add(scheme)
    for url in t.bind:
        scheme = scheme_of(url)
        if scheme != "mem" and scheme not in advertised and \
                parse_host_port(url, scheme)[0] in _WILDCARDS:
            raise ConfigError(f"{url} binds a wildcard address: set transport.advertise to the "
                              "URL peers should dial", "$.transport.advertise")


def _tcp_listeners(cfg: Config) -> list[tuple[str, str, int]]:
    """``(key path, host, port)`` of every TCP listener the config names (membership's TCP and UDP
    share a port; ucx:// has its control connection on TCP). Every URL parses: ``_check_addresses``
    checked them first."""
    out = [("$.admin.listen", *split_listen(cfg.admin.listen)),
           ("$.membership.bind-port", cfg.membership.bind_address, cfg.membership.bind_port)]
    urls = [("$.transport.bind", url) for url in cfg.transport.bind]
    urls.append(("$.storage.stream-bind", cfg.storage.stream_bind))
    for path, url in urls:
        scheme = url.partition("://")[0]
        if scheme in ("tcp", "ucx"):
            out.append((path, *parse_host_port(url, scheme)))
    return out


def _check_port_clashes(cfg: Config) -> None:
    """Two listeners of this node on one port: the second bind fails at start (EADDRINUSE) after
    the data directory, node id and admin token were made. Port 0 never clashes; names that
    resolve to one address (``localhost``, ``127.0.0.1``) are left to that start."""
    seen: list[tuple[str, str, int]] = []
    for path, host, port in _tcp_listeners(cfg):
        for other_path, other_host, other_port in seen:
            if port and port == other_port and (
                    host == other_host or host in _WILDCARDS or other_host in _WILDCARDS):
                raise ConfigError(f"port {port} on {host} is also {other_path}'s: two listeners "
                                  "cannot share it", path)
        seen.append((path, host, port))


def _printable(text: str) -> str:
    """``text`` with control characters escaped: an unknown key is echoed in the one error line,
    and a newline (a quoted TOML key may hold one) or an escape sequence must not reach the
    terminal or journal as is."""
    return text if text.isprintable() else repr(text)[1:-1]


def _section_fields(section: str) -> dict[str, msgspec.structs.FieldInfo]:
    """Encoded (kebab) field name -> FieldInfo for one section, or ConfigError if unknown."""
    top = {f.encode_name: f for f in msgspec.structs.fields(Config)}
    if section not in top:
        raise ConfigError(f"unknown config section {section!r}", _printable(f"$.{section}"))
    section_type = top[section].type
    return {f.encode_name: f for f in msgspec.structs.fields(section_type)}


def _is_text(tp: Any) -> bool:
    """True for ``str`` and ``Literal`` of strings: override values for them are taken verbatim."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if tp is str:
        return True
    return get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp))


def parse_override(key: str, raw: str) -> tuple[str, str, Any]:
    """Parse one ``section.field=value`` style override into ``(section, field, value)``.

    Text fields take the value verbatim; other fields parse it as a TOML value, so
    ``storage.capacity-bytes=1_000_000``, ``node.roles=["storage"]`` and
    ``admin.metrics-require-token=true`` work as they would in the file.

    Raises:
        ConfigError: unknown section or field, or a value that is not valid TOML.
    """
    parts = key.strip().replace("_", "-").lower().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {key!r} is not of the form section.field")
    section, field = parts
    fields = _section_fields(section)
    if field not in fields:
        raise ConfigError(f"unknown config key {field!r}", _printable(f"$.{section}.{field}"))
    if _is_text(fields[field].type):
        return section, field, raw
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"value {raw!r} is not a valid TOML value ({exc})",
                          f"$.{section}.{field}") from None
    if list(doc) != ["v"]:  # more lines after the value: they were dropped without a word
        raise ConfigError(f"value {raw!r} is more than one TOML value", f"$.{section}.{field}")
    return section, field, doc["v"]


_SECTIONS: frozenset[str] = frozenset(f.encode_name for f in msgspec.structs.fields(Config))


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, Any]]:
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        body = name[len(ENV_PREFIX):]
        if "__" not in body:
            # A section's name with one "_" is a misspelt override; other names are not ours
            # (GIAANND_TEST_CORPUS, docs/model.md) and must not stop the daemon.
            if body.partition("_")[0].lower() in _SECTIONS:
                raise ConfigError(f"environment variable {name} is not {ENV_PREFIX}SECTION__FIELD")
            continue
        section, field = body.split("__", 1)
        out.append(parse_override(f"{section}.{field}", environ[name]))
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 (TOML 1.0 "Spec"); tomllib decodes first
        raise ConfigError(f"config file {path} is not UTF-8 text: byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start}") from None


def _convert(data: dict[str, Any]) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path: str | None = None
        if " - at `" in message:
            message, _, rest = message.rpartition(" - at `")
            path = rest.rstrip("`")
        unknown = "Object contains unknown field `"
        if message.startswith(unknown):
            # Point at the offending key itself, not just its parent (msgspec omits `$` itself);
            # the whole of it, backticks included.
            path = f"{path or '$'}.{message[len(unknown):-1]}"
        raise ConfigError(_printable(message), path and _printable(path)) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> Config:
    """Build the effective configuration from defaults, file, environment and ``--set`` flags.

    Args:
        path: TOML file, or None for defaults only.
        environ: environment to read ``GIAANND_SECTION__FIELD`` overrides from (default
            ``os.environ``; pass ``{}`` to ignore the environment).
        overrides: ``section.field=value`` strings, applied last.

    Returns:
        The validated Config.

    Raises:
        ConfigError: anything invalid, naming the key path.
    """
    data: dict[str, Any] = _read_toml(Path(path)) if path is not None else {}
    if path is not None:
        _anchor_data_dir(data, Path(path))
    updates = _env_overrides(os.environ if environ is None else environ)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} is not of the form section.field=value")
        updates.append(parse_override(key, raw))
    for section, field, value in updates:
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"expected a table, got {type(target).__name__}", f"$.{section}")
        target[field] = value
    return _validate(_resolve_paths(_convert(data)))


#: The path-valued keys other than ``node.data-dir``, as ``(section, field)``: relative to
#: ``data-dir`` unless absolute (``_resolve_paths``).
_DATA_DIR_PATHS: tuple[tuple[str, str], ...] = (
    ("node", "node_id_file"), ("cluster", "key_file"), ("admin", "token_file"),
    ("compute", "lexicon"), ("compute", "corpus_dir"), ("compute", "export_dir"))


def _anchor_data_dir(data: dict[str, Any], config_file: Path) -> None:
    """A relative ``node.data-dir`` read from ``config_file`` is taken from the file's directory,
    before the environment and ``--set`` (whose values ``_resolve_paths`` takes from the working
    directory) may replace it: where a file's path points must not depend on the directory the
    daemon was started in (``/`` under systemd, a shell's anywhere)."""
    node = data.get("node")
    # (anything but a non-empty string is _convert's error to report)
    if isinstance(node, dict) and isinstance(node.get("data-dir"), str) and node["data-dir"]:
        node["data-dir"] = os.path.join(os.path.dirname(os.path.abspath(config_file)),
                                        os.path.expanduser(node["data-dir"]))


def _resolve_paths(cfg: Config) -> Config:
    """Every path-valued key resolved once, the same way for the daemon and every reader of its
    config (``cluster.key-file`` is read by the runtime and the key rotation, ``token-file`` by
    the daemon, giaannctl is told it with ``--token-file``): ``~`` expanded; ``data-dir`` made
    absolute (a relative value left here came from the environment or ``--set``: the working
    directory); every other key relative to ``data-dir`` unless absolute, as ``node-id-file`` and
    the compute directories always were. Defaults (empty: none or the built-in file; ``node-id``)
    are left as they are, so ``config show`` output still follows a ``data-dir`` given later (the
    systemd unit's ``--set node.data-dir=/var/lib/giaannd/%i``)."""
    data_dir = os.path.abspath(os.path.expanduser(cfg.node.data_dir))
    sections: dict[str, dict[str, str]] = {"node": {"data_dir": data_dir}}
    for section, field in _DATA_DIR_PATHS:
        value = getattr(getattr(cfg, section), field)
        if value and value != getattr(type(getattr(cfg, section))(), field):
            sections.setdefault(section, {})[field] = os.path.abspath(
                os.path.join(data_dir, os.path.expanduser(value)))
    return msgspec.structs.replace(cfg, **{
        section: msgspec.structs.replace(getattr(cfg, section), **fields)
        for section, fields in sections.items()})


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes (quote, backslash, \n, \uXXXX) are all valid TOML basic-string escapes;
        # JSON leaves DEL raw, which TOML forbids in a string (TOML 1.0, "String").
        return msgspec.json.encode(value).decode().replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(cfg: Config) -> str:
    """Render a Config as TOML that ``load_config`` reads back to an equal Config."""
    lines: list[str] = []
    gossip = msgspec.to_builtins(cfg.membership.resolved())
    for section, fields in msgspec.to_builtins(cfg).items():
        lines.append(f"[{section}]")
        for key, value in fields.items():
            # Unset keys (membership timing) have no TOML form: shown as a comment with the
            # profile's value; they read back as unset.
            if value is None:
                effective = _toml_value(gossip[key]) if section == "membership" else "-"
                lines.append(f"# {key} = {effective}  (unset: from the profile)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
