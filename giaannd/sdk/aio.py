"""``giaannd.AsyncClient``: ``Client``'s methods as coroutines, for asyncio code and notebooks.

Each call is one short HTTP request, so rather than a second HTTP implementation the coroutine
runs the ``Client`` method in a worker thread (``asyncio.to_thread``): the event loop never blocks,
and the two clients cannot drift apart in what they send or how they read answers. Waiting for a
job is the exception: ``AsyncJob.wait`` polls with ``asyncio.sleep`` between requests instead of
holding a thread for the job's whole life.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from giaannd.sdk.client import Client, Job
from giaannd.sdk.column import Column
from giaannd.sdk.errors import UnavailableError
from giaannd.sdk.follow import JOB_POLL_S, Follower, check_wait
from giaannd.sdk.http import DEFAULT_TIMEOUT_S

__all__ = ["AsyncClient", "AsyncJob"]


class AsyncJob:
    """``Job``'s methods as coroutines."""

    def __init__(self, job: Job) -> None:
        self.sync, self.job_id = job, job.job_id

    def __repr__(self) -> str:
        return f"AsyncJob({self.job_id!r})"

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.status)

    async def cancel(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.cancel)

    async def wait(self, progress: bool = True, *, timeout_s: float | None = None,
                   poll_s: float = JOB_POLL_S) -> dict[str, Any]:
        """As ``Job.wait``: the final document; ``JobFailedError`` / ``TimeoutError``; ``UsageError``
        for bounds that cannot bound it (``follow.check_wait``)."""
        check_wait(timeout_s, poll_s)
        f = Follower("job", {"job_id": self.job_id}, progress=progress)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                doc = await asyncio.to_thread(self.sync.client.api.json, "GET", f.path,
                                              timeout_s=f.poll_timeout(deadline, poll_s))
            except UnavailableError as exc:  # repeated for a while (follow.UNAVAILABLE_GRACE_S)
                now = time.monotonic()
                f.unavailable(exc, now, overdue=deadline is not None and now >= deadline)
                await asyncio.sleep(poll_s)
                continue
            if f.see(doc):
                return dict(doc)
            if deadline is not None and time.monotonic() >= deadline:
                assert timeout_s is not None
                raise f.overdue(doc, timeout_s)
            await asyncio.sleep(poll_s)


class AsyncClient:
    """``Client``'s methods as coroutines; the arguments are ``Client``'s (module docstring)."""

    def __init__(self, addr: str | None = None, token_file: str | os.PathLike[str] | None = None,
                 data_dir: str | os.PathLike[str] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 staging_dir: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.sync = Client(addr, token_file, data_dir, timeout_s=timeout_s, staging_dir=staging_dir,
                           environ=environ)

    @property
    def addr(self) -> str:
        return self.sync.addr

    def __repr__(self) -> str:
        return f"AsyncClient({self.addr!r})"

    async def call(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None) -> Any:
        return await asyncio.to_thread(self.sync.call, method, path, body, query)

    async def call_text(self, method: str, path: str, body: Any = None,
                        query: Mapping[str, Any] | None = None) -> str:
        return await asyncio.to_thread(self.sync.call_text, method, path, body, query)

    async def operation(self, op_id: str, body: Any = None, query: Mapping[str, Any] | None = None,
                        **params: Any) -> Any:
        return await asyncio.to_thread(lambda: self.sync.operation(op_id, body, query, **params))

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.status)

    async def members(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.members)

    async def ring(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.ring)

    async def usage(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.usage)

    async def metrics(self) -> str:
        return await asyncio.to_thread(self.sync.metrics)

    async def train(self, corpus: str | os.PathLike[str], *, epochs: int | None = None, limit: int | None = None,
                    workers: int | None = None, coalesce: int | None = None,
                    cluster: bool | None = None) -> AsyncJob:
        job = await asyncio.to_thread(lambda: self.sync.train(
            corpus, epochs=epochs, limit=limit, workers=workers, coalesce=coalesce, cluster=cluster))
        return AsyncJob(job)

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self.sync.job(job_id))

    async def jobs(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.jobs)

    async def eval(self, prompts: None | str | os.PathLike[str] | Sequence[str] = None, constants: str = "train",
                   limit: int | None = None, *, corpus: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: self.sync.eval(prompts, constants, limit, corpus=corpus))

    async def evals(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.evals)

    async def generate(self, prompt: str, max_tokens: int = 20) -> str:
        return await asyncio.to_thread(self.sync.generate, prompt, max_tokens)

    async def column(self, word: str, *, limit: int | None = None) -> Column:
        return await asyncio.to_thread(lambda: self.sync.column(word, limit=limit))

    async def column_info(self, word: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.column_info, word)

    async def export(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: self.sync.export(path, overwrite=overwrite))

    async def report(self, path: str | os.PathLike[str]) -> Path:
        return await asyncio.to_thread(self.sync.report, path)
