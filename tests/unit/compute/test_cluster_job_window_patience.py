"""A window's storage calls are retried for as long as the runner's ``patience_s`` (window_runner.py,
"Storage failures"): a node cut off from storage must not fail the whole job before its own lease
deadline drops the window. Without it, train.py's attempts (6) and the window fails."""

import dataclasses

import pytest

from giaannd.compute.cluster_jobs.corpus_chunks import GROUPED, chunk_key, encode_window
from giaannd.compute.cluster_jobs.flag_pass import findings_key
from giaannd.compute.cluster_jobs.lease_events import RunWindow
from giaannd.compute.cluster_jobs.window_runner import FLAG_STAGE, ClusterSpec, WindowRunner
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import load_bundled_corpus

from ._write_once import WriteOnceRegisters

K = 10


class CutRegisters(WriteOnceRegisters):
    """Every call fails as an unreachable network would, ``cut`` times in all, then answers."""

    def __init__(self, cut: int) -> None:
        super().__init__()
        self.cut = cut

    def _call(self) -> None:
        if self.cut:
            self.cut -= 1
            raise ConnectionRefusedError("cut off from storage (test)")

    async def cas_register(self, key, expect, value=b"", timeout_s=None):
        self._call()
        return await super().cas_register(key, expect, value, timeout_s)

    async def read_register(self, key, timeout_s=None):
        self._call()
        return await super().read_register(key, timeout_s)

    read_write_once_register = read_register


def _runner(regs: CutRegisters, patience_s: float | None) -> WindowRunner:
    for part, data in enumerate(encode_window(load_bundled_corpus(4 * K))):
        regs.stored[chunk_key("j", 0, part, GROUPED)] = data
    settings = dataclasses.replace(TrainSettings(), retry_backoff_s=0.0)  # no waits between attempts
    return WindowRunner(regs, "j", ClusterSpec(k=K, sentences=4 * K, group=4),  # type: ignore[arg-type]
                        Lexicon.default(), settings, TrainProgress(), patience_s=patience_s)


@pytest.mark.asyncio
async def test_cluster_job_window_retries_storage_failures_within_its_patience():
    regs = CutRegisters(cut=30)  # far more failures than train.py's 6 attempts
    runner = _runner(regs, patience_s=3600.0)
    assert await runner(RunWindow(FLAG_STAGE, 1, 7)) == 0
    assert findings_key("j", 1) in regs.stored and regs.cut == 0
    assert runner.progress.as_dict()["retries"] == 30


@pytest.mark.asyncio
async def test_cluster_job_window_without_patience_gives_up_after_the_attempts():
    regs = CutRegisters(cut=30)
    with pytest.raises(ConnectionRefusedError):
        await _runner(regs, patience_s=None)(RunWindow(FLAG_STAGE, 1, 7))
    assert findings_key("j", 1) not in regs.stored
