"""An in-memory register service whose every key can be written once (the corpus chunks' rule),
for the window runner's tests."""

from giaannd.client.registers import CasOutcome, RegisterRead


class WriteOnceRegisters:
    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    async def cas_register(self, key, expect, value=b"", timeout_s=None):
        ok = key not in self.stored
        self.stored.setdefault(key, value)
        return CasOutcome(ok, (1, 1, 1), self.stored[key])

    async def read_register(self, key, timeout_s=None):
        if key not in self.stored:
            return RegisterRead((0, 0, 0), b"", True)
        return RegisterRead((1, 1, 1), self.stored[key], True)

    read_write_once_register = read_register
