"""What a call to a storage node can raise: the StorageClient's error types and reply checking.

Theory of operation
-------------------
Every request the client sends (client.py ``StorageClient._call``) ends in one of three ways:

- **a typed error reply** (``StoreFull``, ``NotOwner``, ``BadRequest``, ``Unavailable``,
  ``VocabConflict``, ``RegisterConflict``): ``raise_for_reply`` turns it into the matching
  ``Remote*`` exception, so callers never inspect reply types for refusals;
- **a transport or protocol failure** (``PeersError``, ``OSError``, ``protocol.ProtocolViolation``,
  or ``KeyError`` for "no transport for this scheme"): raised as is;
- a success reply, which the caller checks for the type it expects.

``REQUEST_FAILURES`` is the tuple of all of those a replicated operation treats as "this node
failed, try another / book the failure" (anything else is a bug and propagates). Operations over
many nodes raise their own summary error: ``QuorumNotReached`` (writes), ``ReadFailed`` (reads,
scans, vocabulary lookups), ``VocabWriteFailed``, ``ScanInterrupted``, ``RegisterUnavailable``.
Both kinds, the ``Remote*`` refusals and these summaries, are ``RemoteFault``s (giaannd/errors.py).

**Unreachable peers** (ARCHITECTURE §5): ``is_unreachable`` says whether a failure means the node
could not be reached at the connection level (connect refused or timed out, connection lost
mid-request); the client then calls its ``on_unreachable(node)`` hook, which in the daemon starts
suspicion in membership. Typed error replies, request deadlines (a slow node is not an unreachable
one), a peer membership already declared dead (``PeerDead``) and handshake rejections do not count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from giaannd import protocol as p
from giaannd.errors import RemoteFault
from giaannd.protocol import BatchId
from peers.errors import DeadlineExceeded, HandshakeRejected, PeerDead, PeersError, TransportClosed

__all__ = [
    "REQUEST_FAILURES",
    "QuorumNotReached",
    "ReadFailed",
    "RegisterUnavailable",
    "RemoteBadRequest",
    "RemoteNotOwner",
    "RemoteRegisterConflict",
    "RemoteStoreFull",
    "RemoteUnavailable",
    "RemoteVocabConflict",
    "ScanInterrupted",
    "StorageRequestError",
    "VocabWriteFailed",
    "is_unreachable",
    "raise_for_reply",
]


class StorageRequestError(RemoteFault):
    """A storage node answered with a typed error, or a quorum/read could not be met."""

    reason = "storage_request"

    def __init__(self, message: str, node: str = "") -> None:
        super().__init__(f"{node}: {message}" if node else message)
        self.node = node


class RemoteStoreFull(StorageRequestError):
    """The node's store is at capacity; nothing changed there."""

    reason = "store_full"

    def __init__(self, node: str, reply: p.StoreFull) -> None:
        super().__init__(f"store full ({reply.used_bytes} of {reply.capacity_bytes} bytes used, "
                         f"{reply.needed_bytes} more needed)", node)
        self.reply = reply


class RemoteNotOwner(StorageRequestError):
    reason = "not_owner"

    def __init__(self, node: str, reply: p.NotOwner) -> None:
        super().__init__(f"not an owner under placement epoch {reply.epoch}: {reply.message}", node)
        self.epoch = reply.epoch
        self.message = reply.message


class RemoteBadRequest(StorageRequestError):
    """The node rejected the request as malformed (a bug on our side)."""

    reason = "bad_request"


class RemoteUnavailable(StorageRequestError):
    """The node cannot serve now (stopping, disk error, hint space full)."""

    reason = "unavailable"


class QuorumNotReached(StorageRequestError):
    """Some row got fewer than W durable acknowledgements. Retry with the same batch id."""

    reason = "quorum_not_reached"

    def __init__(self, batch_id: BatchId, min_acks: int, quorum: int, failures: Mapping[str, str]) -> None:
        detail = "; ".join(f"{n}: {e}" for n, e in sorted(failures.items()))
        super().__init__(f"batch {tuple(batch_id)}: {min_acks} of {quorum} acks for some rows ({detail})")
        self.batch_id, self.min_acks, self.quorum, self.failures = batch_id, min_acks, quorum, dict(failures)
        # a StoreFull among the failures is what the caller most needs to see
        self.store_full = any("store full" in e for e in failures.values())


class ReadFailed(StorageRequestError):
    """Every replica of some rows failed."""

    reason = "read_failed"


class ScanInterrupted(StorageRequestError):
    """The placement changed during a scan (or a node scans under another placement): the pages
    yielded so far may miss or repeat rows. Start the scan again."""

    reason = "scan_interrupted"


class RemoteVocabConflict(StorageRequestError):
    """A vocabulary id is held with another string: a real 64-bit hash collision (nothing changed)."""

    reason = "vocab_conflict"

    def __init__(self, node: str, reply: p.VocabConflict) -> None:
        kind = "column" if reply.kind == 0 else "feature"
        super().__init__(f"{kind} id {reply.id:#018x} is held as {reply.held!r}, offered {reply.offered!r} "
                         "(64-bit hash collision)", node)
        self.reply = reply


class VocabWriteFailed(StorageRequestError):
    """Some vocabulary entries got fewer than W durable acks (retrying is always safe)."""

    reason = "vocab_write_failed"


class RemoteRegisterConflict(StorageRequestError):
    """A register acceptor saw a higher ballot than the one we sent (another proposer is at work);
    nothing changed there. The proposer retries above ``ballot`` (registers.py)."""

    reason = "register_conflict"

    def __init__(self, node: str, reply: p.RegisterConflict) -> None:
        super().__init__(f"register ballot refused: ({reply.round}, {reply.proposer:#x}) seen", node)
        self.ballot = (reply.round, reply.proposer)


class RegisterUnavailable(StorageRequestError):
    """Fewer than a majority of a register's owners answered (or contention outlasted the attempts).
    A compare-and-set may or may not have taken effect: read the register again. ``sealed``: some
    owner refused because it sealed the key (a placement change hands it over, or its coordinator
    died before unsealing: protocol.REGISTER_SEALED)."""

    reason = "register_unavailable"

    def __init__(self, message: str, node: str = "", *, sealed: bool = False) -> None:
        super().__init__(message, node)
        self.sealed = sealed


def raise_for_reply(node: str, reply: p.Reply) -> None:
    """Raise the ``Remote*`` error of a typed error reply from ``node``; return for any other reply."""
    if isinstance(reply, p.StoreFull):
        raise RemoteStoreFull(node, reply)
    if isinstance(reply, p.NotOwner):
        raise RemoteNotOwner(node, reply)
    if isinstance(reply, p.BadRequest):
        raise RemoteBadRequest(reply.message, node)
    if isinstance(reply, p.Unavailable):
        raise RemoteUnavailable(reply.message, node)
    if isinstance(reply, p.VocabConflict):
        raise RemoteVocabConflict(node, reply)
    if isinstance(reply, p.RegisterConflict):
        raise RemoteRegisterConflict(node, reply)


#: What one node's failure looks like to a replicated operation (module docstring). ``KeyError``:
#: no transport for the node's address scheme.
REQUEST_FAILURES: Final = (StorageRequestError, PeersError, OSError, p.ProtocolViolation, KeyError)


def is_unreachable(exc: BaseException, connecting: bool) -> bool:
    """Whether ``exc`` says the peer could not be reached (module docstring, "Unreachable peers").

    While connecting: refused, reset, timed out (``DeadlineExceeded``) all count. On an open
    connection only its loss counts; a request deadline (``TimeoutError``, an ``OSError`` too) does
    not: the peer may just be slow."""
    if isinstance(exc, PeerDead | HandshakeRejected):
        return False
    if connecting:
        return isinstance(exc, OSError | DeadlineExceeded)
    return isinstance(exc, TransportClosed | ConnectionError) and not isinstance(exc, TimeoutError)
