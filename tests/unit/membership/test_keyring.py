import json
import os
import stat

import pytest

from peers.keyring import Keyring, KeyringError


def test_keyring_rotation_steps():
    ring = Keyring([b"a" * 16])
    ring.install(b"b" * 32)
    ring.install(b"b" * 32)  # idempotent
    assert ring.primary == b"a" * 16 and len(ring.keys) == 2
    with pytest.raises(KeyringError, match="install"):
        ring.use(b"c" * 24)
    ring.use(b"b" * 32)
    assert ring.primary == b"b" * 32
    with pytest.raises(KeyringError, match="primary"):
        ring.remove(b"b" * 32)
    ring.remove(b"a" * 16)
    assert ring.keys == (b"b" * 32,)


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 33])
def test_keyring_rejects_bad_key_sizes(bad):
    with pytest.raises(KeyringError, match="16, 24 or 32"):
        Keyring([bad])


def test_keyring_save_load_roundtrip_atomic_and_private(tmp_path):
    ring = Keyring.generate()
    ring.install(os.urandom(16))
    path = tmp_path / "keys.json"
    ring.save(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert Keyring.load(path).keys == ring.keys
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]  # no temp left behind


@pytest.mark.parametrize("content", ["", "[]", '{"version": 2, "keys": []}',
                                     '{"version": 1, "keys": ["not base64!"]}',
                                     '{"version": 1, "keys": []}',
                                     json.dumps({"version": 1, "keys": ["AAAA"]}),
                                     "[" * 100_000])  # corrupt: nested past the parser's recursion limit
def test_keyring_load_errors_name_the_file(tmp_path, content):
    path = tmp_path / "k.json"
    path.write_text(content)
    with pytest.raises(KeyringError, match="k.json"):
        Keyring.load(path)


def test_keyring_save_fsyncs_the_directory_after_the_rename(tmp_path, monkeypatch):
    """Without the directory fsync the rename may not survive a power loss: the node would come
    back with the keyring from before a rotation step (``giaannd.atomic_file`` does the same)."""
    path = tmp_path / "keys.json"
    Keyring([b"a" * 16]).save(path)
    ring = Keyring([b"b" * 16, b"a" * 16])
    synced: list[tuple[bool, bytes]] = []  # (a directory?, the target's primary when fsync'ed)
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), Keyring.load(path).primary))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ring.save(path)
    assert synced[-1] == (True, b"b" * 16)  # the directory, once the new file is in place


def test_keyring_missing_file(tmp_path):
    with pytest.raises(KeyringError, match="cannot read"):
        Keyring.load(tmp_path / "absent.json")
