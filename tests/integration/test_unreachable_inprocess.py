"""Data-plane failures start membership suspicion (issue 5, ARCHITECTURE §5), on two in-process
daemons wired as ``giaannd`` wires them.

- b's data plane is down while its gossip is fine: a's storage client cannot connect, a reports b
  (rate-limited per peer), b is suspected and refutes, and stays alive;
- a typed error reply (NotOwner) is not a failure to reach: nothing is reported;
- b really dead (gossip stopped too, no leave): the report only starts suspicion; b is declared dead
  later, by membership's own suspicion timer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from giaannd import protocol as p
from giaannd.client.storage_client import RemoteNotOwner, StorageRequestError
from peers.errors import PeersError
from peers.membership.events import MemberEvent, MemberFailed, MemberSuspected
from tests.integration.test_cluster_inprocess import pair, wait_async, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.mark.asyncio
async def test_data_plane_failures_start_suspicion_only(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b):
        status, doc = await b.call("POST", "/v1/node/join", {"seeds": [a.gossip_addr]})
        assert status == 200 and doc["joined"], doc
        await wait_for(lambda: a.runtime.topology.is_live("b") and b.runtime.topology.is_live("a"),
                       "join converged")
        node_a, node_b = a.membership.node, b.membership.node
        assert node_a is not None and node_b is not None
        events: list[MemberEvent] = []
        node_a.on_event(events.append)
        client = a.runtime.storage_client(connect_timeout_s=1.0, request_timeout_s=3.0)

        # A typed refusal is an answer: b is reachable, nothing is reported.
        with pytest.raises(RemoteNotOwner):
            await client._call("b", p.ScanRows(owned=True, placement_epoch="not-this-one"))
        assert a.runtime.unreachable_reported == 0

        # b's data plane goes down (listeners closed, a's open connection dropped); gossip stays up.
        for listener in b.runtime.listeners.values():
            await listener.close()
        for conn in list(client._conns.values()):
            await conn.close()
        incarnation = (await a.members())["b"]["incarnation"]
        refutes = node_b.counters().get("refutes", 0)
        with pytest.raises((PeersError, OSError, StorageRequestError)):
            await client.usage("b")
        assert a.runtime.unreachable_reported == 1
        assert node_a.counters().get("unreachable_reports", 0) == 1
        # (the per-peer rate limit is tested in tests/unit/daemon/test_unreachable_hook.py: here each
        # failed connect retries for connect_timeout_s, longer than the loopback probe interval)

        # b hears it is suspected and refutes with a higher incarnation; a keeps it alive.
        async def refuted() -> bool:
            row = (await a.members())["b"]
            return bool(node_b.counters().get("refutes", 0) > refutes and row["incarnation"] > incarnation
                        and row["status"] == "alive")
        await wait_async(refuted, "b refuted the data plane's suspicion")
        assert any(isinstance(e, MemberSuspected) and e.name == "b" for e in events)
        suspicion_s = node_a.config.suspicion_mult * node_a.config.probe_interval_s
        await asyncio.sleep(2 * suspicion_s)  # past any suspicion timer: a refuted suspect is not reaped
        assert (await a.members())["b"]["status"] == "alive"
        assert not any(isinstance(e, MemberFailed) for e in events)

        # b crashes (gossip stops without a leave). The report, seen from inside the hook (no
        # await between it and the look before/after): it makes b a suspect, never dead.
        def status_of(name: str) -> str:
            return next(m.status for m in node_a.members() if m.name == name)

        seen: list[tuple[str, bool, str]] = []

        def hook(name: str) -> None:
            before = status_of(name)
            reported = a.runtime.report_unreachable(name)
            seen.append((before, reported, status_of(name)))

        crash_client = a.runtime.storage_client(connect_timeout_s=0.05, request_timeout_s=1.0,
                                                on_unreachable=hook)
        await node_b.stop()
        await asyncio.sleep(node_a.config.probe_interval_s * 1.5)  # past the rate limit
        with pytest.raises((PeersError, OSError, StorageRequestError)):
            await crash_client.usage("b")
        assert len(seen) == 1 and seen[0][1], seen
        before, _, after = seen[0]
        assert after == ("dead" if before == "dead" else "suspect"), seen

        # Death itself comes from membership's suspicion timer.
        async def b_dead() -> bool:
            return bool((await a.members())["b"]["status"] == "dead")
        await wait_async(b_dead, "membership declared b dead")
        failed = [e for e in events if isinstance(e, MemberFailed) and e.name == "b"]
        assert len(failed) == 1
