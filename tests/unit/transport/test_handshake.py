"""Handshake core: version negotiation table, mutual proof, rejections with reasons, key rotation."""

import pytest

from peers import handshake, wire
from peers.errors import HandshakeRejected

K1, K2, K3 = b"1" * 32, b"2" * 32, b"3" * 32


@pytest.mark.parametrize("ours,theirs,expected", [
    ((1, 1), (1, 1), 1),
    ((1, 3), (2, 5), 3),
    ((2, 5), (1, 3), 3),
    ((1, 2), (3, 4), None),
    ((3, 4), (1, 2), None),
    ((1, 9), (4, 4), 4),
])
def test_handshake_negotiate_version_table(ours, theirs, expected):
    assert handshake.negotiate_version(ours, theirs) == expected


@pytest.mark.parametrize("ours,theirs,expected", [
    (["inline"], ["inline"], "inline"),
    (["ucx", "inline"], ["inline"], "inline"),
    (["ucx", "inline"], ["ucx", "inline"], "ucx"),
])
def test_handshake_choose_bulk_table(ours, theirs, expected):
    assert handshake.choose_bulk(ours, theirs) == expected


def _pair(client_keys=(K1,), server_keys=(K1,), client_cluster="c", server_cluster="c",
          client_versions=(1, 1), server_versions=(1, 1), client_ucx=None, server_ucx=None):
    c = handshake.ClientHandshake(node_id="a", cluster=client_cluster, keyring=list(client_keys),
                                  nonce=b"\x01" * 16, versions=client_versions,
                                  transports=["ucx", "inline"], ucx_address=client_ucx)
    s = handshake.ServerHandshake(node_id="b", cluster=server_cluster, keyring=list(server_keys),
                                  nonce=b"\x02" * 16, versions=server_versions,
                                  transports=["ucx", "inline"], ucx_address=server_ucx)
    return c, s


def _run(c, s):
    welcome = s.on_hello(c.hello())
    auth = c.on_welcome(welcome)
    ready, server_view = s.on_auth(auth)
    return c.on_ready(ready), server_view


def test_handshake_success_agrees_on_everything():
    client_view, server_view = _run(*_pair(client_versions=(1, 3), server_versions=(1, 2)))
    assert client_view.version == server_view.version == 2
    assert client_view.peer_node_id == "b" and server_view.peer_node_id == "a"
    assert client_view.bulk == server_view.bulk == "inline"  # no UCX addresses offered


def test_handshake_picks_ucx_when_both_have_addresses():
    client_view, server_view = _run(*_pair(client_ucx=b"ca", server_ucx=b"sa"))
    assert client_view.bulk == server_view.bulk == "ucx"
    assert client_view.peer_ucx_address == b"sa" and server_view.peer_ucx_address == b"ca"


def test_handshake_key_rotation_any_key_of_the_ring_is_accepted():
    # mid-rotation: the client already uses K2 as primary, the server still proves with K1
    _run(*_pair(client_keys=(K2, K1), server_keys=(K1, K2)))
    _run(*_pair(client_keys=(K1, K2), server_keys=(K2, K1)))


def test_handshake_wrong_key_rejected_by_client_with_reply():
    c, s = _pair(client_keys=(K3,), server_keys=(K1,))
    with pytest.raises(HandshakeRejected) as info:
        c.on_welcome(s.on_hello(c.hello()))
    assert info.value.reason == "bad_key" and not info.value.by_peer
    assert isinstance(info.value.reply, wire.Reject) and info.value.reply.reason == "bad_key"
    # the server learns the reason from the Reject
    with pytest.raises(HandshakeRejected) as peer:
        s.on_auth(info.value.reply)
    assert peer.value.by_peer and peer.value.reason == "bad_key"


def test_handshake_client_proof_with_unknown_key_rejected_by_server():
    c, s = _pair(client_keys=(K3, K1), server_keys=(K1,))  # c verifies s with K1, proves with K3
    auth = c.on_welcome(s.on_hello(c.hello()))
    with pytest.raises(HandshakeRejected) as info:
        s.on_auth(auth)
    assert info.value.reason == "bad_key"


@pytest.mark.parametrize("kwargs,reason", [
    (dict(client_cluster="x"), "wrong_cluster"),
    (dict(client_versions=(2, 3), server_versions=(1, 1)), "version"),
])
def test_handshake_server_rejects(kwargs, reason):
    c, s = _pair(**kwargs)
    with pytest.raises(HandshakeRejected) as info:
        s.on_hello(c.hello())
    assert info.value.reason == reason and isinstance(info.value.reply, wire.Reject)
    with pytest.raises(HandshakeRejected) as client_side:
        c.on_welcome(info.value.reply)
    assert client_side.value.by_peer and client_side.value.reason == reason


def test_handshake_replayed_proof_fails_with_fresh_nonce():
    c, s = _pair()
    auth = c.on_welcome(s.on_hello(c.hello()))
    s2 = handshake.ServerHandshake(node_id="b", cluster="c", keyring=[K1], nonce=b"\x03" * 16)
    s2.on_hello(c.hello())
    with pytest.raises(HandshakeRejected):
        s2.on_auth(auth)


def test_handshake_out_of_order_message_is_protocol_rejection():
    c, s = _pair()
    with pytest.raises(HandshakeRejected) as info:
        s.on_hello(wire.Auth(b"x"))
    assert info.value.reason == "protocol"


def test_handshake_short_keys_refused():
    with pytest.raises(ValueError):
        handshake.ServerHandshake(node_id="b", cluster="c", keyring=[b"short"], nonce=b"\x02" * 16)
