"""Tagging the raw-text windows a node leased, on every core it has (issue 15 item 4).

A cluster job on a text corpus stores its windows untagged (sentence texts, cut by the
sentencizer on the receiving node, ~100x cheaper than tagging: corpus_chunks.py). The flag pass's
lease holder of window ``w`` tags it (window_runner.py) and stores the tagged chunk back, so a
window is tagged once in the cluster (a redo after a take-over finds the tagged chunk) and the
tagging of a corpus is spread over every compute node. Each sentence is tagged alone
(``tag_sentence_texts``, the reference's protocol), so the tags do not depend on the grouping
into windows or on the node.

:class:`WindowTagger` runs the tagging off the event loop: with ``processes = 0`` in a worker
thread (one at a time: one spaCy pipeline per node), else in a pool of ``processes`` spawned
processes, each loading the model once (about a second and ~150 MB each), so ``parallel``
windows are tagged at once on as many cores. ``spawn``, not ``fork``: the daemon has threads
(asyncio's executor, the storage client's), which ``fork`` does not copy safely.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from typing import Any

from giaannd.model.tokens import TaggedSentence, load_english, tag_sentence_texts

__all__ = ["WindowTagger"]

_WORKER_NLP: Any = None  # the model of a pool process (loaded by its initializer)


def _load_model() -> None:
    global _WORKER_NLP
    _WORKER_NLP = load_english()


def _tag_in_worker(texts: list[str]) -> list[TaggedSentence]:
    return list(tag_sentence_texts(texts, nlp=_WORKER_NLP))


class WindowTagger:
    """Tags windows of sentence texts (module docstring).

    Args:
        processes: 0 for a worker thread, else the size of the process pool.
    """

    def __init__(self, processes: int = 0) -> None:
        if processes < 0:
            raise ValueError("processes must be >= 0")
        self.processes = processes
        self._nlp: Any = None
        self._lock = asyncio.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def tag(self, texts: list[str]) -> list[TaggedSentence]:
        """The tagged sentences of ``texts``, in order.

        Raises:
            TaggerUnavailableError: no spaCy model (in the pool: when its worker starts).
        """
        if self.processes == 0:
            async with self._lock:
                return await asyncio.to_thread(self._tag_here, texts)
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_load_model)
        return await asyncio.get_running_loop().run_in_executor(self._pool, _tag_in_worker, texts)

    def _tag_here(self, texts: list[str]) -> list[TaggedSentence]:
        if self._nlp is None:
            self._nlp = load_english()
        return list(tag_sentence_texts(texts, nlp=self._nlp))

    def close(self) -> None:
        """Stop the pool's processes (tagging in flight is abandoned)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
