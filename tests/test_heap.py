"""The collector settings a server runs under (fleetpilot.heap)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fleetpilot.heap import FULL_COLLECTION_AFTER, settle_heap


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settling_freezes_startup_objects_and_spaces_full_collections(
    restored_collector: None,
) -> None:
    """What a server built before serving is never scanned again, full collections wait for
    FULL_COLLECTION_AFTER middle ones, and the young generations keep CPython's pace."""
    built_at_startup = [object() for _ in range(10)], {"config": [1, 2, 3]}
    young, middle, _ = gc.get_threshold()
    settle_heap()
    assert gc.get_threshold() == (young, middle, FULL_COLLECTION_AFTER)
    assert FULL_COLLECTION_AFTER > 10  # CPython's default, which paused the router
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
    assert id(built_at_startup) not in tracked  # frozen: outside every generation
    assert gc.is_tracked(built_at_startup)
