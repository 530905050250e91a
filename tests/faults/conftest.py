"""Fault tests need root, iproute2 (ip, tc) and a kernel with netns, veth and netem."""

import pytest

from tools.netns import available


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if "tests/faults/" in str(item.fspath).replace("\\", "/")]
    if not mine:
        return
    reason = available()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"fault tests: {reason}")
    for item in mine:
        item.add_marker(skip)
