"""Topology operations under writes that create columns, checked row for row against a reference.

Each run starts an in-process cluster (tools/cluster_harness: real storage services, mem:// or
tcp:// by seed), writes, then runs one scenario while a writer keeps writing batches into existing
columns and, in about a third of them, into columns nobody wrote before. After the operations it
delivers the hints and checks that every owner under the final placement holds exactly the
reference rows (``Cluster.mismatches``). The seed sets the data, the transport, the chunk size and
the writer's pace; timing does the rest, so a race shows up as a failure in some seeds, not all.

This is how three silent defects of Dec 1-2 were found (a column born between the plan and its
stream, 4 in 440 runs; a column born for a pair the plan had no stream for, 2 in ~180 replaces;
a member down during a join whose hints, re-split once it was back, counted twice on the
newcomer, 2 in 4), which is why it is kept: run it after any change to the topology code, e.g.
``python -m tools.topology_stress --kind all --runs 100`` (about 1.5 s a run on one core).

Exit status: 0 when every run ended with its owners equal to the reference, 1 otherwise (each
failure printed with its seed, which reproduces its data, not always its timing), 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
from giaannd.storage.rebalance.release import release_unowned
from tools.cluster_harness import Cluster, make_batch

__all__ = ["KINDS", "main", "run_one"]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 120, dtype=np.uint64)
#: share of the writer's batches that also write a column nobody wrote before
BORN_SHARE = 0.3
#: kind -> (nodes, replicas)
KINDS: dict[str, tuple[int, int]] = {
    "join": (3, 2), "decommission": (4, 2), "decommission-r1": (4, 1), "join-then-decommission": (4, 2),
    "removenode": (4, 3), "removenode-then-join": (5, 3), "replace": (4, 3), "pause-resume": (4, 2),
    "cancel": (4, 2), "join-receiver-restart": (3, 2), "join-with-folds": (3, 2), "join-member-down": (4, 3),
    "join-member-back": (4, 3), "decommission-target-back": (5, 3), "decommission-leaver-killed": (4, 3),
}


async def _writer(cluster: Cluster, rng: np.random.Generator, stop: asyncio.Event, pause_s: float) -> int:
    written = 0
    while not stop.is_set():
        columns = rng.choice(COLUMNS, 8)
        if rng.random() < BORN_SHARE:
            columns[0] = rng.integers(1, 2**63, dtype=np.uint64)
        await cluster.write(make_batch(rng, 8, 4, columns))
        written += 1
        await asyncio.sleep(pause_s)
    return written


async def _settle(cluster: Cluster) -> None:
    await cluster.client.flush()
    live = list(cluster.services)
    async with asyncio.timeout(20):
        while await cluster.control().hints_held_for(live):
            await cluster.control().deliver_hints()
            await asyncio.sleep(0.02)


class _Scenario:
    def __init__(self, cluster: Cluster, rng: np.random.Generator) -> None:
        self.cluster, self.rng = cluster, rng
        self.chunk = int(rng.choice([1024, 4096, 65536]))
        self.pause_s = float(rng.choice([0.0, 0.001, 0.003]))

    async def with_writes(self, coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        stop = asyncio.Event()
        writer = asyncio.create_task(_writer(self.cluster, self.rng, stop, self.pause_s))
        try:
            return await coro
        finally:
            stop.set()
            await writer

    def op(self, kind: str, *, add: str | None = None, remove: str | None = None) -> Rebalance:
        c = self.cluster
        after = members_after(c.client_topology, add=[StorageNode(add, c.addresses[add])] if add else [],
                              remove=[remove] if remove else [])
        return Rebalance(c.control(), kind, after, chunk_bytes=self.chunk)

    async def done(self, op: Rebalance, run: Awaitable[dict[str, Any]] | None = None) -> None:
        """``run`` (default ``op.run()``: a scenario's own driver of it) under the writer; it must
        end done."""
        progress = await self.with_writes(op.run() if run is None else run)
        if progress["state"] != "done":
            raise AssertionError(f"{op.kind} ended {progress['state']}: {progress.get('error')}")

    async def release_given_away(self) -> None:
        """What each node's release does storage.release-delay-s after a ring change (the harness
        runs no daemon): drop the columns it gave away, so a next operation may bring them back."""
        await _settle(self.cluster)
        for service in list(self.cluster.services.values()):
            await release_unowned(service)


async def _scenario(kind: str, s: _Scenario) -> None:
    c = s.cluster
    if kind == "join":
        await c.add_node("s3")
        await s.done(s.op("join", add="s3"))
    elif kind == "decommission":
        for leaver in ("s3", "s2"):
            await s.done(s.op("decommission", remove=leaver))
            await c.retire(leaver)
    elif kind == "decommission-r1":
        await s.done(s.op("decommission", remove="s2"))
        await c.retire("s2")
    elif kind == "join-then-decommission":
        await c.add_node("s4")
        await s.done(s.op("join", add="s4"))
        await s.release_given_away()
        await s.done(s.op("decommission", remove="s1"))
        await c.retire("s1")
    elif kind in ("removenode", "removenode-then-join"):
        dead = "s2" if kind == "removenode" else "s3"
        await c.kill(dead)
        await c.write_many(s.rng, 20, COLUMNS)  # hinted for the dead node
        await s.done(s.op("removenode", remove=dead))
        if kind == "removenode-then-join":
            await c.add_node("s5")
            await s.done(s.op("join", add="s5"))
    elif kind == "replace":
        await c.kill("s2")
        await c.write_many(s.rng, 20, COLUMNS)
        await c.add_node("s4")
        await s.done(s.op("replace", add="s4", remove="s2"))
    elif kind == "pause-resume":
        await c.add_node("s4")
        op = s.op("join", add="s4")

        async def paused() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            for _ in range(3):
                await asyncio.sleep(float(s.rng.uniform(0.0, 0.1)))
                op.pause()
                await asyncio.sleep(float(s.rng.uniform(0.0, 0.1)))
                op.resume()
            return await task

        await s.done(op, paused())
    elif kind == "join-receiver-restart":
        await c.add_node("s3")
        op = s.op("join", add="s3")
        op.set_rate(200_000)  # (slow enough that the kill lands mid-stream)

        async def restarted() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            await asyncio.sleep(float(s.rng.uniform(0.02, 0.2)))
            if not task.done():
                await c.kill("s3")  # everything it acknowledged is in its log
                await asyncio.sleep(float(s.rng.uniform(0.0, 0.2)))
                await c.restart_node("s3")
                op.set_rate(None)
            return await task

        await s.done(op, restarted())
    elif kind == "join-with-folds":
        await c.add_node("s3")
        op = s.op("join", add="s3")

        async def folding() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            while not task.done():  # folds on random nodes, sources and receiver alike
                await asyncio.sleep(float(s.rng.uniform(0.0, 0.05)))
                service = c.services[str(s.rng.choice(sorted(c.services)))]
                if service.folds is not None:
                    await service.folds.fold()
            return await task

        await s.done(op, folding())
    elif kind == "join-member-down":
        await c.kill("s1")  # down for good: its shares of the writes are hinted
        await c.add_node("s4")
        await s.done(s.op("join", add="s4"))
    elif kind in ("join-member-back", "decommission-target-back"):
        # a member down when the operation starts comes back during it: its hints are delivered
        # (re-split where the placement moved on) while the streams run
        down = "s1" if kind == "join-member-back" else "s3"
        await c.kill(down)
        await c.write_many(s.rng, 20, COLUMNS)
        if kind == "join-member-back":
            await c.add_node("s4")
            op = s.op("join", add="s4")
        else:
            op = s.op("decommission", remove="s1")

        async def back() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            await asyncio.sleep(float(s.rng.uniform(0.0, 0.3)))
            await c.restart_node(down)
            return await task

        await s.done(op, back())
        if kind == "decommission-target-back":
            await c.retire("s1")
    elif kind == "decommission-leaver-killed":
        # the leaving node dies mid-stream: the decommission is cancelled (or ended, if the kill
        # came late), and a removenode of it copies its columns from the survivors instead
        op = s.op("decommission", remove="s1")
        op.set_rate(200_000)

        async def killed() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            await asyncio.sleep(float(s.rng.uniform(0.02, 0.2)))
            await c.kill("s1")
            await asyncio.sleep(float(s.rng.uniform(0.0, 0.1)))
            op.cancel()  # (the operator's next step: else it fails once its waits for s1 time out)
            try:
                return await task
            except TopologyOpError:
                return {"state": "failed"}

        if (await s.with_writes(killed()))["state"] == "done":
            return
        await s.done(s.op("removenode", remove="s1"))
    elif kind == "cancel":
        await c.add_node("s4")
        op = s.op("join", add="s4")

        async def cancelled() -> dict[str, Any]:
            task = asyncio.create_task(op.run())
            await asyncio.sleep(float(s.rng.uniform(0.0, 0.3)))
            op.cancel()
            try:
                return await task
            except TopologyOpError:  # cancelled before its cutover: the old placement stays
                return {"state": "cancelled"}

        await s.with_writes(cancelled())
    else:
        raise ValueError(f"unknown kind {kind!r}")


async def run_one(kind: str, seed: int, root: Path) -> list[str]:
    """One run: the mismatches between the owners and the reference (empty: every row right)."""
    nodes, replicas = KINDS[kind]
    rng = np.random.default_rng(seed)
    cluster = await Cluster(root, nodes, scheme="tcp" if seed % 2 else "mem", replicas=replicas).start()
    try:
        await cluster.write_many(rng, 40, COLUMNS)
        await _scenario(kind, _Scenario(cluster, rng))
        await _settle(cluster)
        return cluster.mismatches(list(cluster.services))  # (the owners that are up)
    finally:
        await cluster.close()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.topology_stress", description=__doc__.split("\n")[0])
    parser.add_argument("--kind", action="append", choices=[*KINDS, "all"], default=None,
                        help="scenario (repeatable; default all)")
    parser.add_argument("--runs", type=int, default=20, help="seeds per kind (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--json", action="store_true", help="one JSON object per kind")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    kinds = args.kind or ["all"]
    args.kinds = list(KINDS) if "all" in kinds else list(dict.fromkeys(kinds))
    return args


def main(argv: list[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    args = _parse(argv)
    failed = 0
    for kind in args.kinds:
        bad: list[int] = []
        started = time.monotonic()
        for seed in range(args.seed, args.seed + args.runs):
            root = Path(tempfile.mkdtemp(prefix="giaannd-stress-"))
            try:
                problems = asyncio.run(run_one(kind, seed, root))
            except Exception as exc:  # noqa: BLE001 - a run that fails is reported, the others go on
                problems = [f"{type(exc).__name__}: {exc}"]
                traceback.print_exc(limit=3, file=sys.stderr)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if problems:
                bad.append(seed)
                out(f"FAILED {kind} seed={seed}: {'; '.join(problems[:4])}")
        failed += len(bad)
        seconds = time.monotonic() - started
        if args.json:
            out(json.dumps({"kind": kind, "runs": args.runs, "failed": len(bad), "failed_seeds": bad,
                            "seconds": round(seconds, 1)}))
        else:
            out(f"{kind}: {args.runs - len(bad)} of {args.runs} runs right ({seconds:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
