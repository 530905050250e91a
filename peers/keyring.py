"""Cluster keyring: AES-GCM keys with install -> use -> remove rotation.

Gossip packets and streams are sealed with the *primary* key and opened with any
installed key (memberlist's keyring), so a rotation never splits the cluster:

1. ``install(new)`` on every node: all can now read packets sealed with ``new``;
2. ``use(new)`` on every node: each starts sealing with it (old ones still read);
3. ``remove(old)`` on every node.

The transport handshake uses the same file for its HMAC proof (``primary``).

Key file format (UTF-8 JSON, mode 0600)::

    {"version": 1, "keys": ["<base64 key>", ...]}

``keys[0]`` is the primary. Each key is 16, 24 or 32 raw bytes (AES-128/192/256).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
from pathlib import Path

__all__ = ["KEY_SIZES", "Keyring", "KeyringError"]

KEY_SIZES = (16, 24, 32)
#: A keyring is read on every packet; a handful of keys covers any rotation.
MAX_KEYS = 16
_FORMAT_VERSION = 1


class KeyringError(ValueError):
    """A bad key, key file, or rotation step (the message says which)."""


def _check_key(key: bytes) -> bytes:
    if len(key) not in KEY_SIZES:
        raise KeyringError(f"key must be 16, 24 or 32 bytes, got {len(key)}")
    return bytes(key)


class Keyring:
    """Ordered set of keys; the first is the primary, used for sealing."""

    def __init__(self, keys: list[bytes]) -> None:
        """Args: keys: primary first. Raises KeyringError when empty or malformed."""
        if not keys:
            raise KeyringError("a keyring needs at least one key")
        checked: list[bytes] = []
        for key in keys:
            key = _check_key(key)
            if key not in checked:
                checked.append(key)
        if len(checked) > MAX_KEYS:
            raise KeyringError(f"at most {MAX_KEYS} keys")
        self._keys = checked

    @classmethod
    def generate(cls, size: int = 32) -> Keyring:
        """A keyring with one fresh random key."""
        return cls([os.urandom(len(_check_key(b"\0" * size)))])

    @property
    def primary(self) -> bytes:
        """The key used to seal."""
        return self._keys[0]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, primary first (all are tried when opening)."""
        return tuple(self._keys)

    def install(self, key: bytes) -> None:
        """Add a key for opening (not yet for sealing). Idempotent."""
        key = _check_key(key)
        if key not in self._keys:
            if len(self._keys) >= MAX_KEYS:
                raise KeyringError(f"at most {MAX_KEYS} keys")
            self._keys.append(key)

    def use(self, key: bytes) -> None:
        """Make an installed key the primary.

        Raises:
            KeyringError: the key is not installed.
        """
        key = _check_key(key)
        if key not in self._keys:
            raise KeyringError("install the key before using it")
        self._keys.remove(key)
        self._keys.insert(0, key)

    def remove(self, key: bytes) -> None:
        """Remove a key that is not the primary. Idempotent for absent keys.

        Raises:
            KeyringError: the key is the primary.
        """
        key = _check_key(key)
        if key == self._keys[0]:
            raise KeyringError("cannot remove the primary key; use another key first")
        if key in self._keys:
            self._keys.remove(key)

    @staticmethod
    def encode_key(key: bytes) -> str:
        """Base64 text for a key (as in the key file and CLIs)."""
        return base64.b64encode(_check_key(key)).decode("ascii")

    @staticmethod
    def decode_key(text: str) -> bytes:
        """Parse base64 key text. Raises KeyringError."""
        try:
            return _check_key(base64.b64decode(text.strip(), validate=True))
        except (binascii.Error, ValueError) as exc:
            raise KeyringError(f"bad base64 key: {exc}") from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read a key file.

        Raises:
            KeyringError: unreadable, not the documented format, or bad keys (names the file).
        """
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise KeyringError(f"{path}: cannot read keyring: {exc}") from exc
        if (not isinstance(doc, dict) or doc.get("version") != _FORMAT_VERSION
                or not isinstance(doc.get("keys"), list)
                or not all(isinstance(k, str) for k in doc["keys"])):
            raise KeyringError(f'{path}: expected {{"version": 1, "keys": [base64, ...]}}')
        try:
            return cls([cls.decode_key(k) for k in doc["keys"]])
        except KeyringError as exc:
            raise KeyringError(f"{path}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key file atomically (temp file, fsync, rename), mode 0600; the directory is
        fsync'ed after the rename, so the new keys survive a power loss (not only a crash)."""
        target = Path(path)
        doc = {"version": _FORMAT_VERSION, "keys": [self.encode_key(k) for k in self._keys]}
        fd, tmp = tempfile.mkstemp(prefix=".keyring-", dir=target.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """fsync a directory: makes a rename inside it durable (``giaannd.atomic_file.fsync_dir``)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
