"""The plan that brings an engine's adapters to a declared list, and the reading of vLLM's
``/v1/models`` it starts from."""

from __future__ import annotations

from fleetpilot.engine.adapter_sync import AdapterSyncPlan, adapters_listed, plan_adapter_sync


def test_the_plan_unloads_extras_loads_missing_and_reloads_moved_adapters() -> None:
    loaded = {"old": "/a/old", "same": "/a/same", "moved": "/a/moved-v1"}
    desired = {"same": "/a/same", "moved": "/a/moved-v2", "new": "/a/new"}
    assert plan_adapter_sync(desired, loaded) == AdapterSyncPlan(
        unload=("old",), load=(("new", "/a/new"),), reload=(("moved", "/a/moved-v2"),)
    )


def test_an_engine_that_holds_exactly_the_list_needs_nothing() -> None:
    same = {"x": "/p/x", "y": "acme/y"}
    assert plan_adapter_sync(same, dict(same)).empty
    assert not plan_adapter_sync({}, {"x": "/p/x"}).empty


def test_adapters_are_read_from_vllms_model_cards() -> None:
    """Base models have no parent; an adapter's card names its base model as parent and its
    path as root (vLLM 0.33's OpenAIServingModels.show_available_models)."""
    models = {
        "object": "list",
        "data": [
            {"id": "base", "root": "meta/base", "parent": None},
            {"id": "sql", "root": "/adapters/sql", "parent": "base"},
            {"id": "hub", "root": "acme/hub-lora", "parent": "base"},
            "junk",
        ],
    }
    assert adapters_listed(models) == {"sql": "/adapters/sql", "hub": "acme/hub-lora"}
    assert adapters_listed({}) == {}
