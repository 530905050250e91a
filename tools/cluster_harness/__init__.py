"""The cluster harness of the tests and benchmarks: one ``Cluster`` API, two kinds of node.

STYLE.md item 27's ``Cluster`` helper (h11's ``ConnectionPair``, grown to N storage nodes, a client
and a reference)::

    cluster = await Cluster(tmp_path, 3, scheme="tcp", replicas=2).start()
    try:
        await cluster.client.write(batch)
        await cluster.kill("s1")            # a crash every view notices at once
        await cluster.restart_node("s1")    # same data directory, same addresses
        assert cluster.mismatches() == []   # every owner holds exactly the reference rows
    finally:
        await cluster.close()

- **In-process nodes** (the default; fast, for the many storage, topology and compute tests): each
  node is a ``NodeRuntime`` plus the role services built by the daemon's own factories
  (``giaannd.daemon.build_role_services``: the storage role, its stream endpoint and topology
  operations), started and stopped in the daemon's order (node.py), over ``mem://`` (a
  ``MemoryNetwork`` of the cluster's own, with its fault hooks) or ``tcp://`` on loopback. The
  harness plays membership for their views (``noticed``), or with ``gossip=True`` each node runs
  the membership service over UDP.
- **Process nodes** (``processes=True``, or ``add_node(name, process=True)`` next to in-process
  ones): real ``python -m giaannd`` daemons on loopback, launched by ``tools.local_cluster``
  (``LocalCluster``, the same launcher as ``make demo``), for SIGKILL / SIGSTOP tests.

``client`` is a ``StorageClient`` of an in-process compute node's runtime; ``make_batch`` makes
random canonical row batches. cluster.py has the theory of operation.
"""

from tools.cluster_harness.cluster import CLUSTER_NAME, Cluster
from tools.cluster_harness.data import free_tcp_address, make_batch
from tools.cluster_harness.node import InProcessNode, node_config

__all__ = ["CLUSTER_NAME", "Cluster", "InProcessNode", "free_tcp_address", "make_batch", "node_config"]
