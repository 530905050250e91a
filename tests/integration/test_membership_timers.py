"""Membership timers on loops whose timers fire early (uvloop rounds delays to milliseconds):
every node keeps probing for as long as it runs."""

import asyncio

import pytest

from peers.keyring import Keyring
from peers.membership import MembershipConfig
from tests.integration.test_membership_node import cluster

pytestmark = pytest.mark.integration


class _EarlyTimerLoop(asyncio.SelectorEventLoop):
    """Runs every timer 1 ms before its deadline, as uvloop does with about half of them (it
    rounds delays to whole milliseconds)."""

    def call_at(self, when, callback, *args, context=None):
        return super().call_at(when - 0.001, callback, *args, context=context)


def _probes_over(loop_factory, seconds):
    async def main():
        nodes = await cluster(3, Keyring.generate())
        try:
            start = [x.counters().get("probes", 0) for x in nodes]
            await asyncio.sleep(seconds)
            return [x.counters().get("probes", 0) - s for x, s in zip(nodes, start)]
        finally:
            for node in nodes:
                await node.stop()

    loop = loop_factory()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("loop_factory", ["early", "uvloop"])
def test_membership_timers_keep_running_when_the_loop_fires_them_early(loop_factory):
    """Every node keeps probing (and gossiping) for as long as it runs, on a loop whose timers
    fire early: before the fix the first early tick stopped that node's probes for good (seen as
    a frozen member never suspected by two of four peers on uvloop)."""
    if loop_factory == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop
    else:
        factory = _EarlyTimerLoop
    interval = MembershipConfig.loopback().probe_interval_s
    seconds = 2.0
    probes = _probes_over(factory, seconds)
    # one probe per interval each; half of that leaves room for a loaded machine
    assert all(p >= seconds / interval / 2 for p in probes), probes
