"""The in-process cluster harness (tools/cluster_harness) when a node fails to start: what it
started is stopped, so no listener stays bound (a failed start left the node's data-plane socket
open; the unclosed-socket warning then failed an unrelated later test, Dec 2)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tools.cluster_harness import cluster as cluster_module
from tools.cluster_harness.cluster import Cluster
from tools.cluster_harness.data import free_tcp_address

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _bindable(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
        return True


@pytest.mark.asyncio
async def test_a_node_that_fails_to_start_leaves_no_listener_bound(tmp_path: Path, monkeypatch) -> None:
    address = free_tcp_address()
    # the node's data plane and its stream endpoint get one address: the runtime binds it, then
    # the storage role's stream endpoint fails to
    monkeypatch.setattr(cluster_module, "free_tcp_address", lambda: address)
    with pytest.raises(OSError):
        await Cluster(tmp_path, 1, scheme="tcp", replicas=1).start()
    assert _bindable(address), "the failed node's data-plane listener is still bound"
