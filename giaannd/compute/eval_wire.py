"""A spread evaluation's shares over the data plane: the two ends of the ``"eval.share"`` compute call.

eval_spread.py cuts an evaluation into shares and merges the figures; it reaches other nodes
through ``ComputeService.eval_peers``. This module is what a daemon puts there:

- :class:`EvalPeers` (the caller's end): called at eval time, it reads the membership table *then*
  (so nodes that joined since are used and nodes declared dead are not: no list to keep in step
  with member events) and names every other alive member whose gossiped ``NodeMeta`` lists the
  ``compute`` role and a data-plane address this node can dial. Each name maps to a call that
  encodes the share, checks its size, sends it as a ``ComputeCall`` (protocol.py, tag 17; the
  share is the call's one bulk buffer) on a connection of its own, and decodes the figures.
- :func:`share_server` (the serving end): the handler the compute role registers with
  ``NodeRuntime.serve_compute``. It checks the body's size before decoding, decodes the share and
  runs it (``ComputeService.eval_share``).

**Sizes.** A share larger than ``compute.eval-share-max-bytes`` is not sent: the call raises
:class:`ShareTooLarge` before connecting, and eval_spread.py runs that share on the receiving node
and lists it under ``redone`` with the reason, so the reply says so. The serving end refuses a
larger body with ``BadRequest`` (the same knob, its own value). Both stay under the frame's buffer
limit (``protocol.MAX_COMPUTE_BODY_BYTES``).

**Failures** of the call (connect refused or timed out, the connection lost, a typed refusal, a
bad reply) raise; eval_spread.py then redoes the share locally. How long a call may take is
eval_spread.py's ``compute.eval-share-timeout-s``; connecting is bounded on its own here.

One connection per share, closed after it: a spread evaluation sends one share per node, so a
pooled connection would save one handshake per node per evaluation and hold a socket forever.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Final

import numpy as np

from giaannd import protocol as p
from giaannd.cluster.view import pick_transport_address
from giaannd.compute.eval_spread import (
    EvalShare,
    RemoteShare,
    ShareFigures,
    decode_figures,
    decode_share,
    encode_share,
)
from giaannd.errors import AdminHTTPError, Refused, RemoteFault
from peers.errors import PeersError
from peers.membership.meta import NodeMeta
from peers.transport import Handler, Incoming, Reply, connect, scheme_of

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime

__all__ = ["CONNECT_TIMEOUT_S", "EVAL_SHARE_OP", "MAX_FIGURES_BYTES", "EvalPeers", "ShareRefused",
           "ShareTooLarge", "share_server"]

log = logging.getLogger(__name__)

#: The op name of a share call (``ComputeCall.op``).
EVAL_SHARE_OP: Final = "eval.share"
#: Default bound on connecting to a peer for one share (``compute.eval-connect-timeout-s``). A live
#: node on a LAN answers the handshake in milliseconds; a node that died but is still listed alive
#: refuses (connect retries until this passes), so this is what a dead node costs before its share
#: is redone here.
CONNECT_TIMEOUT_S: Final = 3.0
#: Bytes of a share's answer (``ShareFigures``: seven numbers, well under 100 bytes).
MAX_FIGURES_BYTES: Final = 4096


class ShareTooLarge(Refused):
    """The encoded share is over ``compute.eval-share-max-bytes``: not sent (run here instead)."""

    reason = "eval_share_too_large"


class ShareRefused(RemoteFault):
    """The peer answered the share with a typed refusal (``BadRequest``, ``Unavailable``...)."""

    reason = "eval_share_refused"


def _body(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class EvalPeers:
    """``ComputeService.eval_peers`` over the data plane (module docstring).

    Args:
        runtime: the node runtime (membership table, transports, identity).
        max_bytes: ``compute.eval-share-max-bytes``.
        connect_timeout_s: ``compute.eval-connect-timeout-s``.
    """

    def __init__(self, runtime: NodeRuntime, max_bytes: int, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.runtime = runtime
        self.max_bytes = max_bytes
        self.connect_timeout_s = connect_timeout_s

    def __call__(self) -> Mapping[str, RemoteShare]:
        """Every other alive compute member -> a call that runs a share there (read now)."""
        rt = self.runtime
        node = rt.membership
        if node is None:  # membership not running: eval runs here only
            return {}
        out: dict[str, RemoteShare] = {}
        for info in node.alive_members():
            if info.name == rt.node_name:
                continue
            try:
                meta = NodeMeta.decode(info.meta)
            except ValueError:
                continue  # a member whose metadata we cannot read is not asked
            if "compute" not in meta.roles:
                continue
            address = pick_transport_address(meta, rt.transports)
            if address is not None:
                out[info.name] = partial(self.call, info.name, info.node_id, address)
        return out

    async def call(self, name: str, node_id: str, address: str, share: EvalShare) -> ShareFigures:
        """Run ``share`` on the member ``name`` (``node_id``) at ``address``. A member that cannot
        be connected to is reported to membership (``report_unreachable``: suspicion, not death),
        as the storage client does.

        Raises:
            ShareTooLarge: not sent (over ``max_bytes``).
            ShareRefused: a typed refusal. ProtocolViolation: a bad answer. PeersError / OSError:
                the transport failed (unreachable, connection lost, wrong peer at the address).
        """
        data = encode_share(share)
        limit = min(self.max_bytes, p.MAX_COMPUTE_BODY_BYTES)
        if len(data) > limit:
            raise ShareTooLarge(f"share of {len(data)} bytes is over compute.eval-share-max-bytes ({limit}): "
                                "not sent")
        transport = self.runtime.transports[scheme_of(address)]
        try:
            conn = await connect(transport, address, timeout_s=self.connect_timeout_s)
        except (PeersError, OSError):
            self.runtime.report_unreachable(name)
            raise
        try:
            if conn.peer != node_id:  # the address now belongs to another node
                raise PeersError(f"{address} is {conn.peer}, expected {node_id}")
            result = await conn.request(p.encode(p.ComputeCall(EVAL_SHARE_OP)), [_body(data)])
            reply = p.decode_reply(result.payload)
            if not isinstance(reply, p.ComputeAnswer):
                raise ShareRefused(f"{address}: {type(reply).__name__}: {getattr(reply, 'message', reply)}")
            body = p.check_body(result.bulk, MAX_FIGURES_BYTES)
            try:
                return decode_figures(body)
            except ValueError as exc:
                raise p.ProtocolViolation(f"{address}: bad share figures: {exc}") from None
        finally:
            await conn.close("eval share done")


RunShare = Callable[[EvalShare], Awaitable[ShareFigures]]


def share_server(run: RunShare, max_bytes: int, storage_errors: tuple[type[BaseException], ...]) -> Handler:
    """The ``ComputeCall`` handler of a compute node (module docstring).

    Args:
        run: runs a share here (``ComputeService.eval_share``).
        max_bytes: ``compute.eval-share-max-bytes``: larger bodies are refused undecoded.
        storage_errors: failures of this node's storage use, answered ``Unavailable``.
    """
    limit = min(max_bytes, p.MAX_COMPUTE_BODY_BYTES)

    async def handle(incoming: Incoming) -> Reply:
        try:
            call = p.compute_call(incoming.payload)
            if call.op != EVAL_SHARE_OP:
                raise p.ProtocolViolation(f"unknown compute call {call.op!r}")
            share = decode_share(p.check_body(incoming.bulk, limit))
        except ValueError as exc:  # ProtocolViolation and msgspec's errors are ValueErrors
            return Reply(p.encode(p.BadRequest(f"eval share: {exc}"[:p.MAX_TEXT_CHARS])))
        try:
            figures = await run(share)
        except ValueError as exc:  # a share whose prompts disagree (share_prompts)
            return Reply(p.encode(p.BadRequest(f"eval share: {exc}"[:p.MAX_TEXT_CHARS])))
        except AdminHTTPError as exc:  # no storage client yet (503)
            return Reply(p.encode(p.Unavailable(f"eval share: {exc.message}"[:p.MAX_TEXT_CHARS])))
        except storage_errors as exc:
            log.warning("eval share from peer=%s failed on storage: %s", incoming.peer, exc)
            return Reply(p.encode(p.Unavailable(f"eval share: storage failed: {exc}"[:p.MAX_TEXT_CHARS])))
        return Reply(p.encode(p.ComputeAnswer()), [_body(encode_share(figures))])

    return handle
