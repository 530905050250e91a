"""local_cluster.free_port: a port a listener binds later, drawn outside the kernel's ephemeral
range, so an outgoing connection cannot take it in between (the harness's listeners failed with
EADDRINUSE, 1 stress run in ~200, with ports from bind(0))."""

import random
import socket

from giaannd.sdk.local_cluster import PINNED_PORT_SPAN, ephemeral_port_range, free_port


def test_the_port_is_below_the_ephemeral_range_and_bindable():
    low, high = ephemeral_port_range()
    assert 1024 <= low <= high
    for _ in range(20):
        port = free_port()
        assert max(1024, low - PINNED_PORT_SPAN) <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped():
    low, _ = ephemeral_port_range()
    taken = free_port(random.Random(5))
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert free_port(random.Random(5)) != taken  # the same draw, the next port


def test_no_port_is_handed_out_twice_by_one_process():
    """A cluster's nodes draw their ports one after another and bind them later: a port drawn
    twice passed the check both times and the second listener failed with EADDRINUSE (test suite,
    Dec 2). The draws here repeat a port (checked first, so the test proves something)."""
    low, _ = ephemeral_port_range()
    start = max(1024, low - PINNED_PORT_SPAN)
    raw = random.Random(11)
    draws = [raw.randrange(start, low) for _ in range(400)]
    assert len(set(draws)) < len(draws)
    rng = random.Random(11)
    ports = [free_port(rng) for _ in range(400)]
    assert len(set(ports)) == len(ports)


def test_the_range_read_from_proc_or_linux_default(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(path)) == (40000, 50000)
    path.write_text("garbage")
    assert ephemeral_port_range(str(path)) == (32768, 60999)
    assert ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
