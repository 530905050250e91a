"""Wire schema rules and pure helpers (backoff, pool, registry)."""

import importlib
import random

import msgspec
import pytest

from peers import wire
from peers.transport.pool import BufferPool
from peers.transport.registry import scheme_of


def test_wire_tags_are_append_only():
    tags = {cls.__name__: cls.__struct_config__.tag for cls in wire.Message.__args__}
    assert tags == {"Hello": 1, "Welcome": 2, "Auth": 3, "Ready": 4, "Reject": 5, "Request": 10,
                    "Response": 11, "ErrorReply": 12, "Cancel": 13, "Goodbye": 14}


def test_wire_unknown_trailing_fields_tolerated():
    dec = wire.decoder()
    assert dec.decode(msgspec.msgpack.encode([13, 5, "a future field"])) == wire.Cancel(5)


def test_wire_bounds_enforced():
    dec = wire.decoder()
    with pytest.raises(msgspec.ValidationError):
        dec.decode(msgspec.msgpack.encode([1, 1, 1, "n", "c", b"short"]))  # nonce must be 16 bytes


def test_backoff_full_jitter_bounds():
    connect_mod = importlib.import_module("peers.transport.connect")
    retry_mod = importlib.import_module("peers.retry")
    rng = random.Random(1)
    bounds = {"base_s": connect_mod.BACKOFF_BASE_S, "cap_s": connect_mod.BACKOFF_CAP_S}
    delays = retry_mod.backoff_delays(20, rng, **bounds)
    for i, d in enumerate(delays):
        assert 0.0 <= d <= min(connect_mod.BACKOFF_CAP_S, connect_mod.BACKOFF_BASE_S * 2 ** i)
    assert max(delays[10:]) > connect_mod.BACKOFF_BASE_S * 4  # it does grow
    assert retry_mod.backoff_delays(20, random.Random(1), **bounds) == delays  # seeded: reproducible


def test_pool_reuses_touched_buffers():
    pool = BufferPool(max_idle_bytes=1 << 20)
    a = pool.lease(5000)
    assert a.view.nbytes == 5000 and pool.leased == 1
    backing = a._backing
    a.release()
    a.release()  # idempotent
    b = pool.lease(8000)  # same 8 KiB size class
    assert b._backing is backing and pool.allocations == 1 and pool.leased == 1
    b.release()
    big = pool.lease(2 << 20)  # over max_idle: not kept
    big.release()
    assert pool.idle_bytes <= 1 << 20 and pool.leased == 0


@pytest.mark.parametrize("address,scheme", [("tcp://h:1", "tcp"), ("ucx://h:1", "ucx"), ("mem://x", "mem")])
def test_registry_scheme(address, scheme):
    assert scheme_of(address) == scheme


def test_registry_unknown_scheme():
    with pytest.raises(ValueError):
        scheme_of("http://x")
