"""The two ends of the ``"eval.share"`` compute call (giaannd/compute/eval_wire.py), the
``ComputeCall`` / ``ComputeAnswer`` messages (protocol.py) and their routing by the runtime,
without a network: the real-daemon test is tests/integration/test_eval_spread_processes.py."""

from types import SimpleNamespace

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.errors import ReadFailed
from giaannd.compute.eval_spread import (
    EvalShare,
    ShareFigures,
    WirePrompt,
    decode_figures,
    encode_share,
    spread_evaluate,
)
from giaannd.compute.eval_wire import EVAL_SHARE_OP, EvalPeers, ShareTooLarge, share_server
from giaannd.config import Config
from giaannd.errors import AdminHTTPError
from giaannd.runtime.node import NodeRuntime
from peers.membership.meta import NodeMeta
from peers.membership.node import MemberInfo
from peers.transport import Incoming, Reply


def share(n: int = 2, words: int = 3) -> EvalShare:
    w = WirePrompt(["a"] * words, ["a"] * words, [True] * words, [0] * words, [1] * words, [2] * words, [0], ["a"])
    return EvalShare([w] * n, [2], [], "train", "teacher")


def incoming(msg: object, bulk: list[np.ndarray]) -> Incoming:
    return Incoming(memoryview(p.encode(msg)), bulk, None, "peer-1")  # type: ignore[arg-type]


def body(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


def test_compute_call_tag_decoding_and_body_checks() -> None:
    payload = p.encode(p.ComputeCall(EVAL_SHARE_OP))
    assert p.request_tag(payload) == p.COMPUTE_CALL_TAG == 17
    assert p.runtime_request(payload) is None  # not a ring request
    assert p.compute_call(payload) == p.ComputeCall(EVAL_SHARE_OP)
    assert p.decode_reply(p.encode(p.ComputeAnswer())) == p.ComputeAnswer()
    assert p.request_tag(b"\xc1garbage") == -1
    with pytest.raises(p.ProtocolViolation):
        p.compute_call(p.encode(p.ComputeCall("x" * (p.MAX_COMPUTE_OP_CHARS + 1))))
    assert bytes(p.check_body([body(b"abc")], 3)) == b"abc"
    for bad in ([body(b"abcd")], [body(b"a"), body(b"b")], [np.zeros(2, np.uint64)], [np.zeros((1, 1), np.uint8)]):
        with pytest.raises(p.ProtocolViolation):
            p.check_body(bad, 3)


@pytest.mark.asyncio
async def test_runtime_routes_compute_calls_to_the_compute_handler_only(tmp_path) -> None:
    rt = NodeRuntime(Config.loopback(str(tmp_path), name="c1", roles=["compute"]))
    call = incoming(p.ComputeCall(EVAL_SHARE_OP), [body(b"x")])
    reply = await rt._dispatch(call)
    assert isinstance(p.decode_reply(reply.payload), p.Unavailable)  # no compute handler yet
    seen: list[Incoming] = []

    async def handler(inc: Incoming) -> Reply:
        seen.append(inc)
        return Reply(p.encode(p.ComputeAnswer()))

    rt.serve_compute(handler)
    assert isinstance(p.decode_reply((await rt._dispatch(call)).payload), p.ComputeAnswer) and seen == [call]
    # the storage role's requests still go to the storage handler (none here: Unavailable)
    assert isinstance(p.decode_reply((await rt._dispatch(incoming(p.GetUsage(), []))).payload), p.Unavailable)
    assert len(seen) == 1
    rt.serve_compute(None)
    assert isinstance(p.decode_reply((await rt._dispatch(call)).payload), p.Unavailable)


@pytest.mark.asyncio
async def test_share_server_runs_a_share_and_refuses_bad_ones_undecoded() -> None:
    ran: list[EvalShare] = []

    async def run(s: EvalShare) -> ShareFigures:
        ran.append(s)
        return ShareFigures(prompts=len(s.prompts), prediction_tokens=5, matches=3, steps=9)

    handle = share_server(run, 4096, (OSError,))
    reply = await handle(incoming(p.ComputeCall(EVAL_SHARE_OP), [body(encode_share(share()))]))
    assert isinstance(p.decode_reply(reply.payload), p.ComputeAnswer)
    figures = decode_figures(p.check_body([np.asarray(reply.bulk[0])], 4096))
    assert (figures.prompts, figures.matches, ran) == (2, 3, [share()])
    big = encode_share(share(n=200))
    assert len(big) > 4096
    for bad in (incoming(p.ComputeCall("train.window"), [body(encode_share(share()))]),
                incoming(p.ComputeCall(EVAL_SHARE_OP), [body(big)]),
                incoming(p.ComputeCall(EVAL_SHARE_OP), [body(b"\x01\x02not a share")])):
        assert isinstance(p.decode_reply((await handle(bad)).payload), p.BadRequest)
    assert len(ran) == 1  # none of them reached the service

    async def failing(s: EvalShare) -> ShareFigures:
        raise AdminHTTPError(503, "no storage client yet", "unavailable")

    reply = await share_server(failing, 4096, (OSError,))(
        incoming(p.ComputeCall(EVAL_SHARE_OP), [body(encode_share(share()))]))
    assert isinstance(p.decode_reply(reply.payload), p.Unavailable)


def member(name: str, roles: tuple[str, ...], status: str = "alive", tcp: bool = True) -> MemberInfo:
    meta = NodeMeta(roles=roles, transports={"tcp": f"tcp://127.0.0.1:1{len(name)}"} if tcp else {})
    return MemberInfo(name, f"id-{name}", ("127.0.0.1", 1), status, 1, meta.encode())


def fake_runtime(members: list[MemberInfo]) -> SimpleNamespace:
    alive = [m for m in members if m.status == "alive"]
    return SimpleNamespace(node_name="c1", transports={}, membership=SimpleNamespace(alive_members=lambda: alive),
                           report_unreachable=lambda name: False)


def test_eval_peers_are_the_other_alive_compute_members_read_at_call_time() -> None:
    members = [member("c1", ("compute",)), member("c2", ("compute",)), member("s1", ("storage",)),
               member("c3", ("storage", "compute")), member("c4", ("compute",), tcp=False)]
    rt = fake_runtime(members)
    rt.transports = {"tcp": object()}
    peers = EvalPeers(rt, 1 << 20)  # type: ignore[arg-type]
    assert sorted(peers()) == ["c2", "c3"]
    rt.membership = SimpleNamespace(alive_members=lambda: [members[0], members[2]])  # c2, c3 gone
    assert dict(peers()) == {}
    rt.membership = None
    assert dict(peers()) == {}


@pytest.mark.asyncio
async def test_a_share_over_the_size_limit_is_not_sent_but_run_here_and_reported() -> None:
    rt = fake_runtime([member("c2", ("compute",))])
    rt.transports = {"tcp": object()}  # never used: the share is refused before connecting
    peers = EvalPeers(rt, 1024)  # type: ignore[arg-type]
    with pytest.raises(ShareTooLarge):
        await peers.call("c2", "id-c2", "tcp://127.0.0.1:12", share(n=100))

    async def run_local(part):  # type: ignore[no-untyped-def]
        return ShareFigures(prompts=len(part), prediction_tokens=1, matches=1)

    prompts = list(range(200))
    result = await spread_evaluate(prompts, "c1", run_local, peers(),  # type: ignore[arg-type]
                                   lambda part: share(n=len(part)), 5.0)
    assert result.total.prompts == 200 and list(result.by_node) == ["c1"]
    assert result.redone[0]["node"] == "c2" and "eval-share-max-bytes" in result.redone[0]["error"]


@pytest.mark.asyncio
async def test_spread_evaluate_raises_a_local_failure_as_itself_not_as_a_group() -> None:
    async def run_local(part):  # type: ignore[no-untyped-def]
        raise ReadFailed("every replica of some rows failed")

    async def dead_peer(share: EvalShare) -> ShareFigures:  # its share is redone here, and fails as well
        raise ConnectionResetError("gone")

    for peers in ({}, {"c2": dead_peer}):
        with pytest.raises(ReadFailed):
            await spread_evaluate(list(range(4)), "c1", run_local, peers,  # type: ignore[arg-type]
                                  lambda part: share(n=len(part)), 5.0)
