"""The backend harness of the conformance suite: every test runs unchanged against each scheme."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from giaannd.sdk.local_cluster import free_port
from peers.transport import Identity, make_transport
from peers.transport.memory import MemoryNetwork

KEYRING = [b"conformance-key-0123456789abcdef"]
CLUSTER = "conformance"
ROOT = Path(__file__).resolve().parents[2]


def _ucx_available():
    try:
        import ucxx  # noqa: F401

        from peers.transport import ucx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return False
    return True


class Harness:
    def __init__(self, scheme):
        self.scheme = scheme
        self.network = MemoryNetwork()
        self._names = 0
        self.procs = []

    def transport(self, node_id="node", *, keyring=KEYRING, cluster=CLUSTER, versions=(1, 1)):
        options = {"network": self.network} if self.scheme == "mem" else {}
        return make_transport(self.scheme, Identity(node_id, cluster, keyring, versions), **options)

    def address(self):
        self._names += 1
        if self.scheme == "mem":
            return f"mem://srv{self._names}"
        return f"{self.scheme}://127.0.0.1:0"

    def fixed_address(self):
        """An address that can be bound again after a restart."""
        if self.scheme == "mem":
            return self.address()
        return f"{self.scheme}://127.0.0.1:{free_port()}"

    async def crash_mid_upload(self, address, mib):
        """Start a peer that uploads ``mib`` MiB to ``address`` and dies half way. Returns a
        coroutine function that performs the crash once the upload has started."""
        if self.scheme == "mem":
            self.network.sever_mid_frame_bytes = mib * 2**20 // 2
            client = self.transport("crasher")
            from peers.transport import connect
            conn = await connect(client, address, timeout_s=5)
            task = asyncio.get_running_loop().create_task(conn.request("sink", [bytes(mib * 2**20)], timeout_s=5))

            async def crash():
                try:
                    await task
                except OSError:
                    pass
            return crash
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen([sys.executable, "-m", "tests.conformance._peer", self.scheme, address, str(mib)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE)
        self.procs.append(proc)

        async def crash():
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        return crash

    def cleanup(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()


SCHEMES = ["mem", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(not _ucx_available(), reason="ucxx unavailable"))]


@pytest.fixture(params=SCHEMES)
def harness(request):
    h = Harness(request.param)
    yield h
    h.cleanup()
