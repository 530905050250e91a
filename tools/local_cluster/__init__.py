"""A local giaannd cluster on loopback, and the main demo (``make demo``).

    python -m tools.local_cluster [--storage 3] [--compute 1] [--sentences 2000] [--heldout 200]
                                  [--transport auto|ucx|tcp] [--quick] [--keep] [--dir DIR]
    python -m tools.local_cluster --serve [...]     # start the cluster and wait for Ctrl-C

Every node is a real ``python -m giaannd`` process with its own data directory under one root
(a temporary directory unless ``--dir``), its own copy of a freshly generated cluster key file,
listeners on 127.0.0.1 with port 0, and the first node as the seed. The demo then:

1. waits (bounded) until every daemon is READY and every member sees all the others alive;
2. prints the member table (``giaannctl members list``);
3. trains on the first ``--sentences`` sentences of the bundled corpus through the compute node's
   admin API (``POST /v1/train``, the same call as ``giaannctl train start``) with the progress bar;
4. evaluates top-1 on the ``--heldout`` sentences that follow them (never trained);
5. generates from a prompt;
6. prints the measured figures (what the compute node reports, plus its data-plane counters);
7. shuts the cluster down with SIGTERM and checks that every daemon exits 0.

Nothing is downloaded: the corpus ships in ``giaannd/data``. The data plane is UCX (ucxx) where
it starts here and TCP otherwise; the demo says which. The launcher is ``giaannd.LocalCluster``
(giaannd/sdk/local_cluster.py), which the integration tests drive too; demo.py holds the demo
steps, done through ``giaannd.Client``. Exit status: 0 success, 1 a
step failed (the cluster
is still shut down and the node logs are kept for inspection), 2 bad arguments, 130 Ctrl-C (the
cluster is stopped and its files removed unless ``--keep``; a second Ctrl-C kills the daemons
instead of waiting for their graceful stop); SIGTERM is taken as Ctrl-C. With ``--serve``, Ctrl-C
is how it ends: status 0.
Without ``--keep`` the root is removed at the end; a ``--dir`` that already existed keeps what it
held before (only what the demo added is removed).
"""

from tools.local_cluster.demo import main

__all__ = ["main"]
