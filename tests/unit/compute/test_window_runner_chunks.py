"""A leased window whose uploaded chunk holds fewer sentences than the job row says (a damaged
chunk that still decodes) fails the window with a clear error (window_runner.py) instead of
silently running part of it; the job's last window, short by design, runs."""

import pytest

from giaannd.compute.cluster_jobs.corpus_chunks import GROUPED, ChunkMissing, chunk_key, encode_window
from giaannd.compute.cluster_jobs.lease_events import RunWindow
from giaannd.compute.cluster_jobs.window_runner import FLAG_STAGE, ClusterSpec, WindowRunner
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import load_bundled_corpus

from ._write_once import WriteOnceRegisters as Registers

K = 10


def _runner(stored: int, total: int) -> WindowRunner:
    regs = Registers()
    for part, data in enumerate(encode_window(load_bundled_corpus(stored))):
        regs.stored[chunk_key("j", 0, part, GROUPED)] = data  # group 0: windows 0-3
    return WindowRunner(regs, "j", ClusterSpec(k=K, sentences=total, group=4),  # type: ignore[arg-type]
                        Lexicon.default(), TrainSettings(), TrainProgress())


@pytest.mark.asyncio
async def test_a_window_short_of_sentences_in_its_chunk_fails():
    with pytest.raises(ChunkMissing, match="window 3"):
        await _runner(35, 40)(RunWindow(FLAG_STAGE, 3, 7))  # the job has 40 sentences: window 3 holds 10


@pytest.mark.asyncio
async def test_the_jobs_last_window_may_be_short():
    assert await _runner(35, 35)(RunWindow(FLAG_STAGE, 3, 7)) == 0
