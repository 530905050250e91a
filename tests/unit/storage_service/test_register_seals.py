"""Register seals survive a restart (register_store.py, "Seals"; register_handoff.py step 1).

A leaver that seals its lost keys and restarts before the switch must still refuse them under the
same placement epoch: otherwise, with one stayer, it forms an old-placement quorum that new-placement
proposers never meet (register_handoff.py, "Why this is safe"). The seal file's names are looked up
on the module (``rs.SEALS_FILE``) so the restart tests fail on their assertion, not at import, on
code without durable seals."""

import asyncio
import os
from types import SimpleNamespace

import pytest

from giaannd import protocol as p
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.engine import register_seals
from giaannd.storage.engine import register_store as rs
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.register_store import RegisterStore
from giaannd.storage.rebalance import register_handoff as rh
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import StorageRequests, WaitRegistersSynced

E1, E2 = "epoch-one", "epoch-two"


def _restart(store, directory):
    store.close()
    return RegisterStore.open(directory)


def test_register_seals_survive_a_restart_under_the_same_epoch(tmp_path):
    s = RegisterStore.open(tmp_path)
    s.accept("job/a", (1, 1), (1, 1, 1), b"row")
    s.sync()
    s.seal(["job/a", "job/b"], E1)  # durable once it returns: no sync() needed
    s = _restart(s, tmp_path)
    assert s.sealed("job/a", E1) and s.sealed("job/b", E1)
    assert not s.sealed("job/c", E1)
    assert not s.sealed("job/a", E2)  # another epoch (after the switch): counts for nothing
    s.close()


def test_register_unseal_is_durable_and_removes_the_file(tmp_path):
    s = RegisterStore.open(tmp_path)
    s.seal(["job/a"], E1)
    s.seal(["job/b"], E2)  # seals of two epochs in one file
    s = _restart(s, tmp_path)
    assert s.sealed("job/a", E1) and s.sealed("job/b", E2) and not s.sealed("job/a", E2)
    assert s.unseal() == 2
    assert not (tmp_path / rs.SEALS_FILE).exists()
    s = _restart(s, tmp_path)
    assert not s.sealed("job/a", E1) and not s.sealed("job/b", E2) and s.unseal() == 0
    s.seal([], E1)  # nothing to seal: no file
    assert not (tmp_path / rs.SEALS_FILE).exists()
    s.close()


def test_register_seal_file_leaves_no_temporaries_and_open_clears_stale_ones(tmp_path):
    s = RegisterStore.open(tmp_path)
    s.seal(["job/a"], E1)
    assert sorted(os.listdir(tmp_path)) == sorted([rs.REGISTERS_FILE, rs.SEALS_FILE])
    s.close()
    stale = tmp_path / f".{rs.SEALS_FILE}.x1y2.tmp"  # a crash inside atomic_writer
    stale.write_bytes(b"half")
    s = RegisterStore.open(tmp_path)
    assert not stale.exists() and s.sealed("job/a", E1)
    s.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "trailing", "garbage", "empty",
                                    "wrong_shape", "version"])
def test_register_seal_file_corrupt_stops_open_naming_the_file(tmp_path, damage):
    s = RegisterStore.open(tmp_path)
    s.seal(["job/a", "job/b"], E1)
    s.close()
    path = tmp_path / rs.SEALS_FILE
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-3] ^= 0x40
    elif damage == "flip_header":
        raw[9] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-2]
    elif damage == "trailing":
        raw += b"\0"
    elif damage == "garbage":
        raw = bytearray(b"not a seal file at all, no")
    elif damage == "empty":
        raw = bytearray()
    elif damage == "wrong_shape":  # a well-framed record whose payload is not [[epoch, [keys]], ...]
        raw = bytearray(rs.SEAL_RECORD.encode(b"\x93\x01\x02\x03"))
    else:
        raw = bytearray(rs.SEAL_RECORD.encode(b"\x90", version=7))
    path.write_bytes(bytes(raw))
    with pytest.raises(rs.RegisterSealsCorrupt, match=str(path)) as err:
        RegisterStore.open(tmp_path)
    assert err.value.file_path == str(path) and "placement change" in str(err.value)
    assert path.read_bytes() == bytes(raw)  # left untouched for the operator


def _core_with_view(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    hints = HintStore.open(tmp_path / "hints")
    view = ClusterView(local="n0", replicas=1)
    view.set_members([StorageNode("n0", "mem://n0"), StorageNode("n1", "mem://n1")])
    core = StorageRequests(store, hints, "n0", lambda: view)
    core.registers = RegisterStore.open(tmp_path / "registers")
    return core, view, store, hints


def test_requests_register_sealed_key_stays_not_owner_after_a_restart(tmp_path):
    """The request core consults the reopened store: a prepare for a sealed key is NotOwner before
    the restart and after it (it was served after it when seals were in memory only)."""
    core, view, store, hints = _core_with_view(tmp_path)
    keys = [f"job/{i}" for i in range(40)]
    mine = [k for k in keys if view.placement.owners(p.register_key_id(k)) == ("n0",)]
    assert mine
    assert isinstance(core.handle(p.encode(p.RegisterPrepare(mine[0], 1, 1)), []), WaitRegistersSynced)
    core.registers.sync()
    core.registers.seal([mine[0]], view.placement.epoch)
    assert isinstance(core.handle(p.encode(p.RegisterPrepare(mine[0], 2, 1)), []).reply, p.NotOwner)
    core.registers = _restart(core.registers, tmp_path / "registers")  # kill -9 and start again
    for msg in (p.RegisterPrepare(mine[0], 3, 1), p.RegisterAccept(mine[0], 3, 1, 1, 3, 1, b"v"),
                p.RegisterGet(mine[0])):
        assert isinstance(core.handle(p.encode(msg), []).reply, p.NotOwner), msg
    core.registers.unseal()
    core.registers = _restart(core.registers, tmp_path / "registers")
    assert isinstance(core.handle(p.encode(p.RegisterPrepare(mine[0], 4, 1)), []), WaitRegistersSynced)
    core.registers.close()
    store.close()
    hints.close()


def test_handoff_export_seals_durably_and_unseal_clears_the_file(tmp_path):
    """register_handoff.serve: the first export page seals the keys this node loses, durably,
    before it answers; RegisterUnseal removes the file."""
    old = [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)]
    new = old[:3]  # d leaves
    s = RegisterStore.open(tmp_path)
    keys = [f"job/{i}" for i in range(60)]
    for k in keys:
        s.accept(k, (1, 1), (1, 1, 1), b"v")
    s.sync()
    view = ClusterView(local="d", replicas=2)  # the node's placement while it seals: the old one
    view.set_members([StorageNode(n, f"mem://{n}") for n, _ in old])
    epoch = view.placement.epoch
    service = SimpleNamespace(registers=s, node_name="d", topology=view)
    owners = dict(zip(keys, rh.moving(rh._placement(old, 2, "hash"), rh._placement(new, 2, "hash"), keys)))
    lost = sorted(k for k, (was, now) in owners.items() if "d" in was and "d" not in now)
    assert lost
    reply = asyncio.run(rh.serve(service, rh.RegisterExport(old, new, 2, max_bytes=10)))
    assert isinstance(reply, rh.RegisterStates) and not reply.done
    s = _restart(s, tmp_path)
    assert sorted(k for k in keys if s.sealed(k, epoch)) == lost
    service.registers = s
    reply = asyncio.run(rh.serve(service, rh.RegisterUnseal()))
    assert reply == rh.RegisterCount(len(lost)) and not (tmp_path / rs.SEALS_FILE).exists()
    s.close()


def test_register_seal_write_failure_refuses_the_export_and_a_retry_writes_it(tmp_path, monkeypatch):
    s = RegisterStore.open(tmp_path)

    def full(path, data):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(register_seals, "atomic_write_bytes", full)
        with pytest.raises(OSError):
            s.seal(["job/a"], E1)
        service = SimpleNamespace(registers=s, node_name="a", topology=None)
        export = rh.RegisterExport([("a", 1.0)], [("b", 1.0)], 1)
        with pytest.raises(RuntimeError, match="register seals not written"):  # the endpoint refuses it
            asyncio.run(rh.serve(service, export))
    assert s.sealed("job/a", E1) and not (tmp_path / rs.SEALS_FILE).exists()  # refusing meanwhile: safe
    s.seal(["job/a"], E1)  # the same seals again: written this time, not skipped
    s = _restart(s, tmp_path)
    assert s.sealed("job/a", E1)
    s.close()
