"""A long-lived ``StorageClient`` (a compute node's, a storage node's hint deliverer) while a storage
node is restarted again and again at a new address (port 0, a new pod IP): the connections the
client keeps must not grow with the restarts.

Before (Nov 30): the client kept one connection and one connect lock per address it ever dialled,
closed or not, for its whole life: every restart at a new address left the closed connection (its
link, session and decoder) and the lock behind."""

import asyncio

import pytest

from giaannd import protocol as p
from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from peers.keyring import Keyring
from peers.transport import Identity, Reply, make_transport

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
ROUNDS = 30


async def _usage(incoming):
    assert isinstance(p.decode_request(incoming.payload), p.GetUsage)
    return Reply(p.encode(p.UsageReply(capacity_bytes=1, used_bytes=0, num_rows=0, num_entries=0, is_full=False)))


async def test_leak_client_connections_of_a_node_restarted_at_new_addresses():
    keys = list(Keyring.generate().keys)
    topology = ClusterView(replicas=1, schemes=("tcp",))
    client = StorageClient(topology, {"tcp": make_transport("tcp", Identity("compute", "leak", keys))},
                           request_timeout_s=10, connect_timeout_s=10)
    kept = []
    try:
        for _ in range(ROUNDS):
            # the node (re)starts on a fresh port; the previous one is gone
            server = make_transport("tcp", Identity("s1", "leak", keys))
            listener = await server.listen("tcp://127.0.0.1:0", _usage)
            topology.add(StorageNode("s1", listener.address))
            try:
                assert isinstance(await client.usage("s1"), p.UsageReply)
            finally:
                await listener.close()
            async with asyncio.timeout(5):  # the client's side of the connection saw it go
                while any(not conn.is_closed for conn in client._conns.values()):
                    await asyncio.sleep(0.01)
            kept.append((len(client._conns), len(client._conn_locks)))
        assert max(kept[-1]) <= 1, f"(connections, locks) kept after each restart: {kept}"
    finally:
        await client.close()
