"""Sans-IO connection handshake: versions, cluster name, mutual proof of the cluster key, transports.

Theory of operation (everything that affects the handshake's transitions lives in this file)::

    client                                   server
    Hello(versions, node, cluster, Nc, caps) ─────►  check cluster, negotiate version
                              ◄───── Welcome(v, node, Ns, proof_s = HMAC(k, "S"|transcript), caps)
    verify proof_s with any key of the ring
    Auth(proof_c = HMAC(k', "C"|transcript)) ─────►  verify proof_c with any key of the ring
                              ◄───── Ready(bulk)     (or Reject(reason) at any step, either side)

``transcript`` binds both nonces, both node ids, the cluster name and the chosen version, so a proof
cannot be replayed on another connection or reflected back (the role byte differs). Each side
proves with its *primary* key but accepts a proof made with *any* key of its keyring: during a key
rotation (install everywhere → switch primary → remove the old key) every pair keeps a common key.

The result of a successful handshake is an ``Agreement``. A failure raises ``HandshakeRejected`` on
the side that detects it, which also returns a ``Reject`` to send, so both sides learn the reason.
No I/O, clocks or global randomness: nonces come from the caller.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from peers import wire
from peers.errors import HandshakeRejected

__all__ = [
    "MIN_KEY_BYTES",
    "TRANSPORT_PREFERENCE",
    "Agreement",
    "negotiate_version",
    "choose_bulk",
    "ClientHandshake",
    "ServerHandshake",
]

#: Cluster keys shorter than this are refused at configuration time (128-bit security).
MIN_KEY_BYTES: Final = 16
#: Bulk paths, best first. "ucx" needs both sides to carry a UCX worker address.
TRANSPORT_PREFERENCE: Final = ("ucx", "inline")


@dataclass(frozen=True, slots=True)
class Agreement:
    """What the two sides agreed on."""

    version: int
    peer_node_id: str
    bulk: str  # one of TRANSPORT_PREFERENCE
    peer_ucx_address: bytes | None
    peer_bulk_salt: int = 0


def negotiate_version(ours: tuple[int, int], theirs: tuple[int, int]) -> int | None:
    """Highest version in both inclusive ranges, or None when they do not overlap (pure)."""
    low, high = max(ours[0], theirs[0]), min(ours[1], theirs[1])
    return high if low <= high else None


def choose_bulk(ours: Sequence[str], theirs: Sequence[str]) -> str:
    """Best bulk path both sides offer (``inline`` is always possible: it is the control stream)."""
    for name in TRANSPORT_PREFERENCE:
        if name == "inline" or (name in ours and name in theirs):
            return name
    return "inline"  # pragma: no cover - "inline" is in the preference list


def _transcript(cluster: str, version: int, client: str, server: str, nc: bytes, ns: bytes) -> bytes:
    parts = [cluster.encode(), str(version).encode(), client.encode(), server.encode(), nc, ns]
    return b"\x00".join(len(p).to_bytes(4, "little") + p for p in parts)


def _proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, role + transcript, hashlib.sha256).digest()


def _verify(keyring: Sequence[bytes], role: bytes, transcript: bytes, proof: bytes) -> bool:
    # compare_digest on every key, so timing does not tell which key (if any) matched
    ok = False
    for key in keyring:
        ok |= hmac.compare_digest(_proof(key, role, transcript), proof)
    return ok


def _check_keyring(keyring: Sequence[bytes]) -> None:
    if not keyring or any(len(k) < MIN_KEY_BYTES for k in keyring):
        raise ValueError(f"keyring needs ≥ 1 key of ≥ {MIN_KEY_BYTES} bytes; the first is primary")


class _Base:
    def __init__(
        self,
        *,
        node_id: str,
        cluster: str,
        keyring: Sequence[bytes],
        nonce: bytes,
        transports: Sequence[str] = ("inline",),
        ucx_address: bytes | None = None,
        versions: tuple[int, int] = (wire.PROTOCOL_MIN, wire.PROTOCOL_MAX),
        bulk_salt: int = 0,
    ) -> None:
        _check_keyring(keyring)
        if len(nonce) != wire.NONCE_BYTES:
            raise ValueError(f"nonce must be {wire.NONCE_BYTES} bytes")
        self.node_id, self.cluster, self.keyring = node_id, cluster, list(keyring)
        self.nonce, self.versions = nonce, versions
        self.transports = [t for t in transports if t != "ucx" or ucx_address is not None]
        self.ucx_address = ucx_address
        self.bulk_salt = bulk_salt

    def _reject(self, reason: str, message: str) -> tuple[wire.Reject, HandshakeRejected]:
        return wire.Reject(reason, message), HandshakeRejected(message, reason=reason, by_peer=False)


class ClientHandshake(_Base):
    """The connecting side. Drive: ``hello()`` → ``on_welcome()`` → ``on_ready()``."""

    _version = 0
    _server_id = ""
    _welcome: wire.Welcome | None = None

    def hello(self) -> wire.Hello:
        """The first frame to send."""
        return wire.Hello(self.versions[0], self.versions[1], self.node_id, self.cluster,
                          self.nonce, list(self.transports), self.ucx_address, self.bulk_salt)

    def on_welcome(self, msg: wire.Message) -> wire.Auth:
        """Check the server's answer; return our proof.

        Raises:
            HandshakeRejected: the server rejected us (``by_peer``), or its proof/version is bad;
                in the latter case ``exc.reply`` holds the ``Reject`` to send back.
        """
        if isinstance(msg, wire.Reject):
            raise HandshakeRejected(f"rejected by server: {msg.message}", reason=msg.reason, by_peer=True)
        if not isinstance(msg, wire.Welcome):
            raise self._fail("protocol", f"expected Welcome, got {type(msg).__name__}")
        if not self.versions[0] <= msg.proto <= self.versions[1]:
            raise self._fail("version", f"server chose version {msg.proto} outside {self.versions}")
        transcript = _transcript(self.cluster, msg.proto, self.node_id, msg.node_id, self.nonce, msg.nonce)
        if not _verify(self.keyring, b"S", transcript, msg.proof):
            raise self._fail("bad_key", "server does not hold the cluster key")
        self._version, self._server_id, self._welcome = msg.proto, msg.node_id, msg
        return wire.Auth(_proof(self.keyring[0], b"C", transcript))

    def on_ready(self, msg: wire.Message) -> Agreement:
        """Final step: the server accepted our proof.

        Raises:
            HandshakeRejected: the server rejected our proof (``by_peer``) or sent nonsense.
        """
        if isinstance(msg, wire.Reject):
            raise HandshakeRejected(f"rejected by server: {msg.message}", reason=msg.reason, by_peer=True)
        if not isinstance(msg, wire.Ready) or self._welcome is None:
            raise self._fail("protocol", f"expected Ready, got {type(msg).__name__}")
        if msg.bulk_path not in TRANSPORT_PREFERENCE or (
                msg.bulk_path != "inline" and msg.bulk_path not in self.transports):
            raise self._fail("protocol", f"server chose unknown bulk path {msg.bulk_path!r}")
        return Agreement(self._version, self._server_id, msg.bulk_path, self._welcome.ucx_address,
                         self._welcome.bulk_salt)

    def _fail(self, reason: str, message: str) -> HandshakeRejected:
        reply, exc = self._reject(reason, message)
        exc.reply = reply
        return exc


class ServerHandshake(_Base):
    """The accepting side. Drive: ``on_hello()`` → ``on_auth()``.

    Each step returns the frame to send; on failure it raises ``HandshakeRejected`` whose ``reply``
    attribute is the ``Reject`` to send before closing.
    """

    _agreement: Agreement | None = None
    _transcript = b""

    def on_hello(self, msg: wire.Message) -> wire.Welcome:
        if not isinstance(msg, wire.Hello):
            raise self._fail("protocol", f"expected Hello, got {type(msg).__name__}")
        if msg.cluster != self.cluster:
            raise self._fail("wrong_cluster", f"cluster {msg.cluster!r} is not {self.cluster!r}")
        version = negotiate_version(self.versions, (msg.proto_min, msg.proto_max))
        if version is None:
            raise self._fail("version", f"no common protocol version: ours {self.versions}, "
                                        f"theirs {(msg.proto_min, msg.proto_max)}")
        self._transcript = _transcript(self.cluster, version, msg.node_id, self.node_id, msg.nonce, self.nonce)
        bulk = choose_bulk(self.transports, msg.transports)
        if bulk == "ucx" and not msg.ucx_address:  # offered ucx without an address: unusable
            bulk = "inline"
        self._agreement = Agreement(version, msg.node_id, bulk, msg.ucx_address, msg.bulk_salt)
        return wire.Welcome(version, self.node_id, self.nonce, _proof(self.keyring[0], b"S", self._transcript),
                            list(self.transports), self.ucx_address, self.bulk_salt)

    def on_auth(self, msg: wire.Message) -> tuple[wire.Ready, Agreement]:
        if isinstance(msg, wire.Reject):
            raise HandshakeRejected(f"rejected by client: {msg.message}", reason=msg.reason, by_peer=True)
        if not isinstance(msg, wire.Auth) or self._agreement is None:
            raise self._fail("protocol", f"expected Auth, got {type(msg).__name__}")
        if not _verify(self.keyring, b"C", self._transcript, msg.proof):
            raise self._fail("bad_key", "client does not hold the cluster key")
        return wire.Ready(self._agreement.bulk), self._agreement

    def _fail(self, reason: str, message: str) -> HandshakeRejected:
        reply, exc = self._reject(reason, message)
        exc.reply = reply
        return exc
