"""The cyclic GC during the daemon's start-up (``cli._no_collections``): off while the modules load
and the services are built, what that left frozen after, and on again, even when a build fails."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from giaannd import cli


@pytest.fixture(autouse=True)
def _gc_as_it_was() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_no_collections_freezes_what_start_up_built_then_collects_again() -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    with cli._no_collections():
        assert not gc.isenabled()
        built: list[list[int]] = [[] for _ in range(1000)]  # GC-tracked objects, as the imports leave
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(built)


def test_no_collections_enables_the_gc_again_when_building_the_services_fails() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="factory"):
        with cli._no_collections():
            raise RuntimeError("a role's factory failed")
    assert gc.isenabled()


def test_no_collections_leaves_a_gc_an_embedder_disabled_off() -> None:
    gc.disable()
    with cli._no_collections():
        pass
    assert not gc.isenabled()
