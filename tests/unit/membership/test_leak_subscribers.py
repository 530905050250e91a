"""Member-event subscriptions (``MembershipNode.subscribe``) under churn: a subscriber that stops
reading and drops its iterator must stop costing the node anything.

Before (Nov 30): the node kept every subscription's queue for its whole life, so each abandoned
``subscribe()`` (a watcher that broke out of its loop, a task that was cancelled) went on receiving
and buffering every later member event (up to ``SUBSCRIBER_QUEUE`` each) and was visited by every
publish: the queues grew with the number of subscriptions ever made. And ``stop()`` raised
``QueueFull`` when a subscriber's queue was full (one that read nothing for ``SUBSCRIBER_QUEUE``
events), leaving the others without their end."""

import asyncio
import gc

import pytest

from peers.keyring import Keyring
from peers.membership import MemberJoined, MembershipConfig, MembershipNode
from peers.membership import node as membership_node

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def _node(name, keyring):
    return MembershipNode(name=name, bind=("127.0.0.1", 0), cluster="leak", keyring=Keyring(list(keyring.keys)),
                          config=MembershipConfig.loopback())


async def _joined_event(events, name):
    async with asyncio.timeout(10):
        async for event in events:  # the subscriber leaves its loop once it saw what it wanted
            if isinstance(event, MemberJoined) and event.name == name:
                return event
    raise AssertionError("subscription ended")


async def test_leak_subscriptions_dropped_by_their_readers_are_let_go():
    keyring = Keyring.generate()
    seed = _node("seed", keyring)
    await seed.start()
    try:
        kept = seed.subscribe()  # a subscriber that stays: it still gets every event
        counts = []
        for i in range(12):
            joiner = _node(f"j{i}", keyring)
            await joiner.start()
            try:
                # a watcher that waits for one event, then stops reading and drops its iterator
                watcher = asyncio.ensure_future(_joined_event(seed.subscribe(), f"j{i}"))
                await joiner.join([seed.addr])
                await watcher
            finally:
                await joiner.stop()
            gc.collect()
            counts.append(len(seed._subscribers))
        assert counts[-1] <= 2, f"subscriptions kept per round: {counts}"
        assert (await _joined_event(kept, "j11")).name == "j11"  # from its queue
    finally:
        await seed.stop()


async def test_leak_stop_ends_a_subscription_whose_queue_is_full(monkeypatch):
    monkeypatch.setattr(membership_node, "SUBSCRIBER_QUEUE", 1)
    keyring = Keyring.generate()
    seed, joiner = _node("seed", keyring), _node("joiner", keyring)
    await seed.start()
    await joiner.start()
    try:
        events = seed.subscribe()  # reads nothing until the end: its queue fills
        await joiner.join([seed.addr])
        async with asyncio.timeout(10):
            while len(seed.alive_members()) < 2:
                await asyncio.sleep(0.02)
    finally:
        await joiner.stop()
        await seed.stop()
    async with asyncio.timeout(5):
        seen = [event async for event in events]  # ends: stop() told it
    assert len(seen) <= 1
